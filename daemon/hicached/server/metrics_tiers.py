"""Metrics of the tiers below host memory, read at scrape time.

Primitives: ``tier_families(entries, stacks, store)``: keys and bytes per tier and pool
(``hicache_tier_*``) and whether a tier fails (``hicache_tier_failing``); the disk tier's
traffic and drops (``hicache_disk_*``); the cluster tier's state and traffic
(``hicache_remote_*``: up, down transitions, pages and bytes put and got, failures, misses,
timeouts, removals, replica fallbacks; per pool, pages waiting and dropped).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from hicached.cache.pool_cache import PoolCache
from hicached.core.pool import HostPool
from hicached.tiers.mooncake import MooncakeStore
from hicached.tiers.stack import TierStack


def tier_families(entries: list[tuple[HostPool, PoolCache]],
                  stacks: list[tuple[str, TierStack]],
                  store: MooncakeStore | None) -> Iterator[Metric]:
    keys = GaugeMetricFamily("hicache_tier_keys", "Keys held, by tier (host, disk).",
                             labels=["pool", "tier"])
    size = GaugeMetricFamily("hicache_tier_bytes", "Bytes of the pages held, by tier.",
                             labels=["pool", "tier"])
    for pool, cache in entries:
        n = cache.key_count
        keys.add_metric([pool.spec.name, "host"], n)
        size.add_metric([pool.spec.name, "host"], n * pool.spec.page_bytes)
    c = {n: CounterMetricFamily(f"hicache_disk_{n}", h, labels=["pool"]) for n, h in (
        ("spilled_pages", "Pages written to the disk tier ahead of eviction."),
        ("read_pages", "Pages read back from the disk tier (promotions)."),
        ("spill_dropped_pages", "Keys evicted from host memory before they were written to "
                                "disk: gone from every tier (the spill window overflowed)."),
        ("checksum_failures", "Disk pages whose checksum failed on read: dropped, not served."),
        ("write_errors", "Disk writes that failed (the key stays in host memory only)."),
        ("evicted_pages", "Pages the disk tier evicted (LRU) to make room."))}
    caches = {p.spec.name: cache for p, cache in entries}
    for name, stack in stacks:
        tier = stack.disk
        if tier is None:
            continue
        st = tier.stats
        n = tier.keys
        keys.add_metric([name, "disk"], n)
        size.add_metric([name, "disk"], n * tier.page_bytes)
        dropped = caches[name].stats.spill_dropped if name in caches else 0
        for metric, value in (("spilled_pages", st.writes), ("read_pages", st.reads),
                              ("spill_dropped_pages", dropped),
                              ("checksum_failures", st.checksum_failures),
                              ("write_errors", st.write_errors),
                              ("evicted_pages", st.evicted)):
            c[metric].add_metric([name], value)
    failing = GaugeMetricFamily(
        "hicache_tier_failing", "1 while a tier below host memory fails its writes (a full "
        "disk, an unreachable cluster store; its writer backs off and retries) or could not "
        "be opened; 0 while it works.", labels=["pool", "tier"])
    for name, stack in stacks:
        for tier_name, bad in stack.failing().items():
            failing.add_metric([name, tier_name], 1 if bad else 0)
    yield from (keys, size, *c.values(), failing)
    if store is not None:
        yield from _remote_families(stacks, store)


def _remote_families(stacks: list[tuple[str, TierStack]],
                     store: MooncakeStore) -> Iterator[Metric]:
    st = store.stats
    yield GaugeMetricFamily("hicache_remote_up", "1 while the cluster tier (Mooncake) "
                            "answers; 0 while it is down (host and disk still serve).",
                            value=1 if store.up else 0)
    for name, value, doc in (
            ("down_transitions", st.down_transitions, "Times the cluster tier went down."),
            ("put_pages", st.puts, "Pages put into the cluster store."),
            ("put_bytes", st.put_bytes, "Bytes put into the cluster store."),
            ("put_failures", st.put_failures, "Pages a put did not store (tier down, store "
                                              "full, peer unreachable)."),
            ("get_pages", st.gets, "Pages got from the cluster store (LoadKeys promotions)."),
            ("get_bytes", st.get_bytes, "Bytes got from the cluster store."),
            ("get_misses", st.get_misses, "Keys a get did not bring back whole (gone from the "
                                          "store, or its holder unreachable)."),
            ("timeouts", st.timeouts, "Calls to the cluster store that did not answer in "
                                      "timeout_seconds."),
            ("removed_keys", st.removed, "Keys removed from the cluster store."),
            ("replica_fallback_pages", store.replicas.served, "Pages read from another "
             "replica after the one Mooncake chose could not be read (a dead node's copy)."),
            ("replica_read_failures", store.replicas.failed_reads, "Direct reads of a "
             "replica's endpoint that failed (the endpoint is then avoided for a while).")):
        yield CounterMetricFamily(f"hicache_remote_{name}", doc, value=value)
    yield GaugeMetricFamily("hicache_remote_avoided_endpoints", "Endpoints (nodes' transfer "
                            "engines) whose replicas gets avoid now, after a failed read.",
                            value=len(store.replicas.avoided()))
    waiting = GaugeMetricFamily("hicache_remote_pending_pages", "Stored keys of a pool "
                                "waiting to be put (write policy through).", labels=["pool"])
    dropped = CounterMetricFamily("hicache_remote_dropped_pages", "Stored keys never put: "
                                  "evicted or removed before their turn, or beyond the "
                                  "queue.", labels=["pool"])
    checksums = CounterMetricFamily(
        "hicache_remote_checksum_failures", "Pages got from the cluster store whose digest "
        "did not match: not served, removed from the store.", labels=["pool"])
    for name, stack in stacks:
        if stack.remote is not None:
            checksums.add_metric([name], stack.remote.checksum_failures)
        if stack.writer is not None:
            waiting.add_metric([name], stack.writer.waiting)
            dropped.add_metric([name], stack.writer.dropped)
        elif stack.remote_spiller is not None:
            waiting.add_metric([name], 0)
            # with a disk tier its spill counter already tells
            dropped.add_metric([name], stack.cache.stats.spill_dropped
                               if stack.disk is None else 0)
    yield from (waiting, dropped, checksums)
