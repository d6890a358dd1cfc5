"""Metrics of the tiers below host memory, read at scrape time.

Primitives: ``tier_families(entries, stacks, store)``: keys and bytes per tier and pool
(``hicache_tier_*``) and whether a tier fails (``hicache_tier_failing``); the disk tier's
traffic and drops (``hicache_disk_*``); the cluster tier's state and traffic
(``hicache_cluster_*``, and again under the deprecated ``hicache_remote_*``: up, down
transitions, pages and bytes put and got, failures, misses, timeouts, removals, replica
fallbacks; per pool, pages waiting and dropped). ``CLUSTER_PREFIXES``.
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
        yield from _cluster_families(stacks, store)


CLUSTER_PREFIXES = ("hicache_cluster_", "hicache_remote_")
"""The cluster tier's metrics, each under its name (``hicache_cluster_*``) and under the name
it had before tier 3 was called the cluster everywhere (``hicache_remote_*``, deprecated: the
same numbers, kept for dashboards and alerts written against it)."""


def _cluster_families(stacks: list[tuple[str, TierStack]],
                      store: MooncakeStore) -> Iterator[Metric]:
    st = store.stats
    gauges: list[tuple[str, str, float]] = [
        ("up", "1 while the cluster tier (Mooncake) answers; 0 while it is down (host and "
               "disk still serve).", 1 if store.up else 0),
        ("avoided_endpoints", "Endpoints (nodes' transfer engines) whose replicas gets avoid "
                              "now, after a failed read.", len(store.replicas.avoided()))]
    counters: list[tuple[str, str, float]] = [
        ("down_transitions", "Times the cluster tier went down.", st.down_transitions),
        ("put_pages", "Pages put into the cluster store.", st.puts),
        ("put_bytes", "Bytes put into the cluster store.", st.put_bytes),
        ("put_failures", "Pages a put did not store (tier down, store full, peer "
                         "unreachable).", st.put_failures),
        ("get_pages", "Pages got from the cluster store (LoadKeys promotions).", st.gets),
        ("get_bytes", "Bytes got from the cluster store.", st.get_bytes),
        ("get_misses", "Keys a get did not bring back whole (gone from the store, or its "
                       "holder unreachable).", st.get_misses),
        ("timeouts", "Calls to the cluster store that did not answer in timeout_seconds.",
         st.timeouts),
        ("removed_keys", "Keys removed from the cluster store.", st.removed),
        ("replica_fallback_pages", "Pages read from another replica after the one Mooncake "
         "chose could not be read (a dead node's copy).", store.replicas.served),
        ("replica_read_failures", "Direct reads of a replica's endpoint that failed (the "
         "endpoint is then avoided for a while).", store.replicas.failed_reads)]
    waiting: dict[str, float] = {}
    dropped: dict[str, float] = {}
    checksums: dict[str, float] = {}
    for name, stack in stacks:
        if stack.cluster is not None:
            checksums[name] = stack.cluster.checksum_failures
        if stack.writer is not None:
            waiting[name], dropped[name] = stack.writer.waiting, stack.writer.dropped
        elif stack.cluster_spiller is not None:
            # with a disk tier its spill counter already tells
            waiting[name] = 0
            dropped[name] = stack.cache.stats.spill_dropped if stack.disk is None else 0
    per_pool: list[tuple[type[Metric], str, str, dict[str, float]]] = [
        (GaugeMetricFamily, "pending_pages", "Stored keys of a pool waiting to be put (write "
                                             "policy through).", waiting),
        (CounterMetricFamily, "dropped_pages", "Stored keys never put: evicted or removed "
                                               "before their turn, or beyond the queue.",
         dropped),
        (CounterMetricFamily, "checksum_failures", "Pages got from the cluster store whose "
         "digest did not match: not served, removed from the store.", checksums)]
    for prefix in CLUSTER_PREFIXES:
        old = "" if prefix == CLUSTER_PREFIXES[0] else "Deprecated: hicache_cluster_* says it. "
        for suffix, doc, value in gauges:
            yield GaugeMetricFamily(prefix + suffix, old + doc, value=value)
        for suffix, doc, value in counters:
            yield CounterMetricFamily(prefix + suffix, old + doc, value=value)
        for family, suffix, doc, samples in per_pool:
            m = family(prefix + suffix, old + doc, labels=["pool"])
            for name, value in samples.items():
                m.add_metric([name], value)
            yield m
