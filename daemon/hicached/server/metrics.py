"""Prometheus metrics of the daemon, on an injected registry.

Primitives:

- ``Metrics(registry, state)``: counters and histograms updated on the request path, and a
  custom collector that reads pool occupancy, cache tallies (lookups, stores by status,
  evictions, keys), sessions and canary tallies at scrape time.
- ``REASONS``: every reason code; ``hicache_rejected_requests_total`` starts at 0 for each, so
  alert rules can reference any of them from the first scrape.
- ``serve(metrics, address)``: the HTTP endpoint (``HOST:PORT``; port 0 picks one), a
  ``MetricsEndpoint`` asleep until a scrape comes.

Names: prefix ``hicache_``, base units, ``_total`` for counters; labels ``pool``, ``op``
(``backup``/``load``/``store``/``load_keys``), ``reason``, ``method``, ``code``, ``result``
(``hit``/``miss``), ``status`` (``stored``/``already_present``/``no_space``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app
from prometheus_client.registry import Collector

from hicache.errors import all_error_classes
from hicache.locks import lock
from hicache.polling import PollCounts
from hicached.cache.index_types import EVICTED_AGE_BUCKETS
from hicached.cache.pool_cache import PoolCache
from hicached.core.pool import HostPool
from hicached.cuda.paths import Path as CopyPath
from hicached.publish.kv_event_config import KvEventStats
from hicached.server.metrics_tiers import CLUSTER_PREFIXES, tier_families
from hicached.server.tallies import HistogramColumns, Row, Tally, add_into
from hicached.service.calls import METHODS
from hicached.service.memory_budget import MemoryBudget
from hicached.tiers.mooncake import MooncakeStore
from hicached.tiers.stack import TierStack

CopyStats = tuple[dict[tuple[bool, CopyPath], tuple[int, int]],
                  dict[tuple[bool, int, CopyPath], float]]
"""GPU copies: (loading, way) -> (batches, bytes); (loading, size class, way) -> rate."""

REASONS = sorted({c.reason for c in all_error_classes()})

# 50 us .. 60 s: sub-millisecond control-plane calls and multi-second bulk copies.
DURATION_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,
                    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_DURATION = HistogramColumns(DURATION_BUCKETS)


@dataclass
class ScrapeState:
    """What the collector reads at scrape time (callables so nothing is cached stale)."""

    pools: Callable[[], list[tuple[HostPool, PoolCache]]]
    """Every pool with its cache."""
    sessions_open: Callable[[], int]
    sessions_reaped: Callable[[], int]
    attached_bytes: Callable[[], int]
    ipc_handles: Callable[[], tuple[int, int]] = lambda: (0, 0)
    """(CUDA IPC allocations mapped, their bytes)."""
    vmm_chunks: Callable[[], tuple[int, int]] = lambda: (0, 0)
    """(VMM chunks of workers' GPU memory mapped, their bytes)."""
    watchers: Callable[[], int] = lambda: 0
    """WatchEvents streams open."""
    builds: Callable[[], list[tuple[str, str, float]]] = lambda: []
    """Pools being built in the background: (name, CREATING or FAILED, progress 0..1)."""
    tiers: Callable[[], list[tuple[str, TierStack]]] = lambda: []
    """The tiers below each pool's host memory."""
    cluster_store: MooncakeStore | None = None
    """The cluster tier's client, if one is configured."""
    fast_connections: Callable[[], int] = lambda: 0
    """Connections open on the fast path's sockets."""
    fast_polls: Callable[[], PollCounts] = lambda: (0, 0, 0, 0)
    """The fast path's waits for a next request: (polled, caught by the poll, ns polling, not
    polled because the node's CPUs were all wanted)."""
    kv_events: Callable[[], KvEventStats] | None = None
    """The KV event stream's counts, if it is on."""
    budget: MemoryBudget | None = None
    """The memory budget the pools share by demand, if it is elastic."""
    cuda_copies: Callable[[], CopyStats] | None = None
    """GPU copies by way (``hicached.cuda.paths``), where a CUDA driver loaded."""
    tables: Callable[[], dict[str, int]] = lambda: {}
    """The sizes of what grows with sessions, connections, keys and requests (each must
    stay bounded over months: ``hicache_table_entries``)."""


def _cuda_copy_families(counts: dict[tuple[bool, CopyPath], tuple[int, int]],
                        rates: dict[tuple[bool, int, CopyPath], float]) -> Iterator[Metric]:
    labels = ["op", "path"]
    batches = CounterMetricFamily("hicache_cuda_copy_batches", "GPU copy batches by way "
                                  "(dma, batch, kernel) and op (backup: to host; load).",
                                  labels=labels)
    moved = CounterMetricFamily("hicache_cuda_copy_bytes", "Bytes of GPU copy batches by way "
                                "and op.", labels=labels)
    for (loading, path), (n, b) in sorted(counts.items()):
        op = "load" if loading else "backup"
        batches.add_metric([op, path.value], n)
        moved.add_metric([op, path.value], b)
    yield batches
    yield moved
    rate = GaugeMetricFamily("hicache_cuda_copy_rate_bytes_per_second", "Each way's recent "
                             "rate measured on the device, by op and fragment size class "
                             "(log2 of a page's bytes of one layer and component): what "
                             "the choice of way reads.", labels=[*labels, "size_class"])
    for (loading, cls, path), r in sorted(rates.items()):
        rate.add_metric(["load" if loading else "backup", path.value, str(cls)], r)
    yield rate


def _budget_families(b: MemoryBudget) -> Iterator[Metric]:
    shares = b.shares()
    for name, help_text, field in (
            ("share", "Bytes of the memory budget the pool may hold now (its pages' limit).",
             "share_bytes"),
            ("floor", "Bytes of the budget the pool always keeps.", "floor_bytes"),
            ("ceiling", "The most bytes of the budget the pool may hold.", "ceiling_bytes")):
        g = GaugeMetricFamily(f"hicache_pool_{name}_bytes", help_text, labels=["pool"])
        for v in shares:
            g.add_metric([v.pool], getattr(v, field))
        yield g
    tenants = b.tenants()
    for name, help_text, field in (
            ("share", "Bytes of the memory budget the tenant's pools may hold now.",
             "share_bytes"),
            ("used", "Bytes in the allocated pages of the tenant's pools.", "used_bytes"),
            ("quota", "The most bytes the tenant's pools may hold together (0: none but the "
                      "budget).", "quota_bytes"),
            ("guaranteed", "Bytes no other tenant can take from the tenant.",
             "guaranteed_bytes")):
        g = GaugeMetricFamily(f"hicache_tenant_{name}_bytes", help_text, labels=["tenant"])
        for t in tenants:
            g.add_metric([t.tenant], getattr(t, field))
        yield g
    st = b.stats
    yield GaugeMetricFamily("hicache_budget_slack_bytes",
                            "Bytes of the memory budget no pool holds.",
                            value=b.budget_bytes - b.used_bytes)
    for name, help_text, value in (
            ("grown_bytes", "Bytes of share pools took (on demand, or given by a rebalance).",
             st.grown_bytes),
            ("shrunk_bytes", "Bytes of share pools gave back (idle, or taken for another).",
             st.shrunk_bytes),
            ("released_bytes", "Memory shrinking pools gave back to the system.",
             st.released_bytes),
            ("moved_keys", "Keys whose pages moved below a shrinking pool's new size.",
             st.moved_keys),
            ("rounds", "Rebalancing rounds run.", st.rounds)):
        yield CounterMetricFamily(f"hicache_budget_{name}", help_text, value=value)


def _kv_event_families(st: KvEventStats) -> Iterator[Metric]:
    for name, help_text, value in (
            ("published", "KV events published (BlockStored, BlockRemoved, AllBlocksCleared).",
             st.published),
            ("dropped", "Cache events dropped because the publisher's queue was full (a "
                        "snapshot of every pool followed).", st.dropped),
            ("messages", "Messages (batches) sent on the KV event sockets (the node's "
                         "stream and every pool's).", st.messages),
            ("resyncs", "Snapshots published after drops.", st.resyncs),
            ("replays", "Replay requests answered.", st.replays),
            ("bad_replays", "Replay requests that were not SGLang's (ignored).",
             st.bad_replays)):
        yield CounterMetricFamily(f"hicache_kv_events_{name}", help_text, value=value)
    for name, help_text, value in (
            ("queued", "Cache events waiting to be published.", st.queued),
            ("subscribers", "Connections on the KV event PUB sockets.", st.subscribers),
            ("replay_subscribers", "Connections on the KV event replay sockets.",
             st.replay_subscribers),
            ("last_seq", "Sequence number of the node stream's last message.", st.last_seq),
            ("pool_streams", "Pools' own KV event streams open.", st.pool_streams)):
        yield GaugeMetricFamily(f"hicache_kv_events_{name}", help_text, value=value)


class _StateCollector(Collector):
    def __init__(self, state: ScrapeState, started: float) -> None:
        self._state = state
        self._started = started

    def collect(self) -> Iterator[Metric]:
        entries = self._state.pools()
        yield from _pool_families(entries)
        building = GaugeMetricFamily(
            "hicache_pool_build_progress", "Pools being created: faulted-in share (0..1), by "
            "state (CREATING, or FAILED until deleted or created again).",
            labels=["pool", "state"])
        for pool_name, build_state, progress in self._state.builds():
            building.add_metric([pool_name, build_state], progress)
        yield building
        yield from tier_families(entries, self._state.tiers(), self._state.cluster_store)
        if self._state.kv_events is not None:
            yield from _kv_event_families(self._state.kv_events())
        if self._state.budget is not None:
            yield from _budget_families(self._state.budget)
        yield GaugeMetricFamily("hicache_cache_watchers", "WatchEvents streams open.",
                                value=self._state.watchers())
        yield GaugeMetricFamily("hicache_fast_path_connections",
                                "Worker connections open on the fast path.",
                                value=self._state.fast_connections())
        polls, caught, polled_ns, busy = self._state.fast_polls()
        by_result = CounterMetricFamily(
            "hicache_fast_path_polls", "Waits of fast-path connections for a worker's next "
            "request with a poll window: caught (it came within the window), slept (after "
            "polling the window), node_busy (not polled: the node's CPUs were all wanted).",
            labels=["result"])
        by_result.add_metric(["caught"], caught)
        by_result.add_metric(["slept"], polls - caught)
        by_result.add_metric(["node_busy"], busy)
        yield by_result
        yield CounterMetricFamily("hicache_fast_path_poll_seconds",
                                  "CPU time fast-path connections spent polling.",
                                  value=polled_ns / 1e9)
        yield GaugeMetricFamily("hicache_sessions_open", "Open worker sessions.",
                                value=self._state.sessions_open())
        yield CounterMetricFamily("hicache_sessions_reaped", "Sessions ended by lease expiry.",
                                  value=self._state.sessions_reaped())
        yield GaugeMetricFamily("hicache_sessions_attached_bytes",
                                "Device bytes mapped for open sessions.",
                                value=self._state.attached_bytes())
        handles, handle_bytes = self._state.ipc_handles()
        yield GaugeMetricFamily("hicache_cuda_ipc_handles_open",
                                "Worker GPU allocations mapped over CUDA IPC.", value=handles)
        yield GaugeMetricFamily("hicache_cuda_ipc_mapped_bytes",
                                "Bytes of worker GPU allocations mapped over CUDA IPC.",
                                value=handle_bytes)
        chunks, chunk_bytes = self._state.vmm_chunks()
        yield GaugeMetricFamily("hicache_cuda_vmm_chunks_mapped",
                                "Physical allocations of worker GPU virtual memory (VMM chunks "
                                "passed as fds) mapped.", value=chunks)
        yield GaugeMetricFamily("hicache_cuda_vmm_mapped_bytes",
                                "Bytes of worker GPU VMM chunks mapped.", value=chunk_bytes)
        if self._state.cuda_copies is not None:
            yield from _cuda_copy_families(*self._state.cuda_copies())
        tables = GaugeMetricFamily(
            "hicache_table_entries", "Entries of what the daemon keeps per session, "
            "connection, removal or thread (each bounded by what is open or in flight now: a "
            "daemon that runs for months keeps them flat).", labels=["table"])
        for table, n in sorted(self._state.tables().items()):
            tables.add_metric([table], n)
        yield tables
        yield GaugeMetricFamily("hicache_uptime_seconds", "Seconds since the daemon started.",
                                value=time.monotonic() - self._started)


def _pool_families(entries: list[tuple[HostPool, PoolCache]]) -> Iterator[Metric]:
    """Each pool's size, pages by kind, canary tallies and its cache's tallies."""
    pool_l = ["pool"]
    g = {n: GaugeMetricFamily(f"hicache_{n}", h, labels=pool_l) for n, h in (
        ("pool_capacity_bytes", "Host bytes of the pool."),
        ("pool_used_bytes", "Host bytes in allocated pages."),
        ("pool_capacity_pages", "Pages in the pool."),
        ("pool_used_pages", "Allocated pages."),
        ("pool_pinned_bytes", "Page-locked host bytes."),
        ("pool_pin_seconds", "Seconds registering the pool with CUDA (0 = not pinned)."),
        ("pool_raw_pages", "Pages handed out by Alloc."),
        ("pool_keyed_pages", "Pages named by a key (ready or being written)."),
        ("pool_busy_pages", "Pages a copy is reading or writing now (never evicted)."),
        ("pool_pinned_pages", "Deprecated: hicache_pool_busy_pages under its old name."),
        ("pool_metadata_bytes", "Host bytes of the pool's tables (its key index aside)."),
        ("cache_keys", "Ready keys."),
        ("cache_keyed_bytes", "Host bytes of the pages of ready keys."),
        ("held_pages", "Pages held for a session's coming LoadKeys (Lookup with hold_ms); a "
                       "page two sessions hold counts twice."),
        ("cache_eviction_margin", "How much longer a reused page is kept than a page used "
                                  "once, in pool capacities, as the pool's reuse eviction "
                                  "learnt it from its traffic (0: least recently used)."))}
    c = {n: CounterMetricFamily(f"hicache_{n}", h, labels=pool_l) for n, h in (
        ("pool_alloc_failures", "Allocations refused for lack of pages."),
        ("canary_verified_pages", "Pages whose fingerprint matched on load."),
        ("canary_mismatched_pages", "Pages whose fingerprint differed on load."),
        ("cache_lookups", "Lookup requests."),
        ("cache_evicted_pages", "Ready keyed pages evicted to make room."),
        ("cache_removed_keys", "Keys dropped by RemoveKeys or ClearPool."),
        ("cache_load_misses", "LoadKeys refused with KEY_NOT_FOUND."),
        ("holds_taken", "Holds taken by Lookups (and the promotions they started)."),
        ("holds_expired", "Holds that reached their deadline unused."))}
    released = CounterMetricFamily(
        "hicache_holds_released", "Holds ended before their deadline, by reason: loaded "
        "(their LoadKeys consumed them), released (ReleaseHolds), session_end.",
        labels=["pool", "reason"])
    keys = CounterMetricFamily("hicache_cache_lookup_keys", "Keys looked up, by result.",
                               labels=["pool", "result"])
    stores = CounterMetricFamily("hicache_cache_store_keys", "Keys a Store named, by status.",
                                 labels=["pool", "status"])
    evictions = CounterMetricFamily(
        "hicache_cache_evictions", "Ready keyed pages evicted, by what needed the room: store "
        "(a Store's new pages), promotion (a page read up from the disk or the cluster), "
        "alloc (raw pages for an Alloc).", labels=["pool", "reason"])
    ages = HistogramMetricFamily(
        "hicache_cache_evicted_age_seconds", "Idle time of each evicted key at its eviction "
        "(since its last use: stored, hit by a touching Lookup, loaded); short ones say the "
        "pool is too small for its working set.", labels=["pool"])
    ratio = GaugeMetricFamily(
        "hicache_cache_hit_ratio", "Looked-up keys found, over keys looked up, since the "
        "daemon started (0 before the first Lookup); over a window: the rate of "
        "hicache_cache_lookup_keys_total by result.", labels=["pool"])
    for pool, cache in entries:
        name, st = pool.spec.name, cache.stats
        # one pass over the allocator's tables per scrape, without its lock
        count = pool.allocator.counts(locked=False)
        ready = cache.key_count
        used = count["used"]
        for metric, value in (("pool_capacity_bytes", pool.nbytes),
                              ("pool_used_bytes", used * pool.spec.page_bytes),
                              ("pool_capacity_pages", pool.page_num),
                              ("pool_used_pages", used),
                              ("pool_pinned_bytes", pool.pinned_bytes),
                              ("pool_pin_seconds", pool.pin_seconds),
                              ("pool_raw_pages", count["raw"]),
                              ("pool_keyed_pages", count["keyed"]),
                              ("pool_busy_pages", count["busy"]),
                              ("pool_pinned_pages", count["busy"]),
                              ("pool_metadata_bytes", pool.metadata_bytes),
                              ("cache_keys", ready),
                              ("cache_keyed_bytes", ready * pool.spec.page_bytes),
                              ("held_pages", cache.holds.table.total),
                              ("cache_eviction_margin", cache.eviction_margin)):
            g[metric].add_metric([name], value)
        if pool.canary is not None:
            c["canary_verified_pages"].add_metric([name], pool.canary.verified_pages)
            c["canary_mismatched_pages"].add_metric([name], pool.canary.mismatched_pages)
        for metric, value in (("pool_alloc_failures", pool.allocator.alloc_failures),
                              ("cache_lookups", st.lookups), ("cache_evicted_pages", st.evicted),
                              ("cache_removed_keys", st.removed),
                              ("cache_load_misses", st.load_misses),
                              ("holds_taken", st.holds_taken),
                              ("holds_expired", st.holds_expired)):
            c[metric].add_metric([name], value)
        for reason, value in (("loaded", st.holds_loaded), ("released", st.holds_released),
                              ("session_end", st.holds_ended)):
            released.add_metric([name, reason], value)
        keys.add_metric([name, "hit"], st.lookup_hits)
        keys.add_metric([name, "miss"], st.lookup_misses)
        looked = st.lookup_hits + st.lookup_misses
        ratio.add_metric([name], st.lookup_hits / looked if looked else 0.0)
        for reason, value in st.evicted_by.items():
            evictions.add_metric([name, reason], value)
        cumulative = list(itertools.accumulate(st.evicted_age))
        ages.add_metric([name], [*((repr(le), float(n)) for le, n in
                                   zip(EVICTED_AGE_BUCKETS, cumulative[:-1], strict=True)),
                                 ("+Inf", float(cumulative[-1]))], st.evicted_age_sum)
        for status, value in (("stored", st.stored), ("already_present", st.already_present),
                              ("no_space", st.no_space)):
            stores.add_metric([name, status], value)
    yield from (*g.values(), *c.values(), keys, stores, released, evictions, ages, ratio)


class Metrics:
    def __init__(self, registry: CollectorRegistry, state: ScrapeState,
                 build: dict[str, str]) -> None:
        self.registry = registry
        # the per-call counts: each thread adds into its own rows (``tallies``), summed here
        self._calls: Tally[tuple[str, str, bool]] = Tally(_DURATION.width)
        """(method, code, fast) -> a duration histogram's columns (its count: the calls)."""
        self._transfers: Tally[tuple[str, str]] = Tally(2 + _DURATION.width)
        """(pool, op) -> bytes, pages, then a duration histogram's columns."""
        # the fast path's calls start at 0, every one the method table says it carries
        fast = tuple(m.name for m in METHODS.values() if not m.grpc_only)
        registry.register(_CallCollector(self._calls, self._transfers, fast))
        self.rejected = Counter("hicache_rejected_requests",
                                "Requests refused with a domain error, by reason.", ["reason"],
                                registry=registry)
        for reason in REASONS:
            self.rejected.labels(reason)
        self.fast_dropped = Counter(
            "hicache_fast_path_dropped_connections", "Fast-path connections the daemon closed "
            "in the middle of a frame: its body too slow to arrive (body_timeout), no room in "
            "fast_path_inflight_bytes in time (overloaded), larger than the limit (too_large).",
            ["reason"], registry=registry)
        for reason in ("body_timeout", "overloaded", "too_large"):
            self.fast_dropped.labels(reason)
        info = Gauge("hicache_build_info", "Build of the daemon.", list(build),
                     registry=registry)
        info.labels(**build).set(1)
        self.pool_attach = Counter(
            "hicache_pool_attach", "Pools opened, by how their saved state was found: "
            "created, reattached, cold_version, cold_mismatch, cold_corrupt, cold_untrusted (files "
            "not the daemon's own: never re-attached).",
            ["pool", "outcome"], registry=registry)
        self.recovered_keys = Counter("hicache_pool_recovered_keys",
                                      "Keys found again in re-attached pools.", ["pool"],
                                      registry=registry)
        self.disk_seconds = Histogram("hicache_disk_io_seconds",
                                      "Disk tier page writes and reads (checksum included).",
                                      ["op"], buckets=DURATION_BUCKETS, registry=registry)
        for io in ("write", "read"):
            self.disk_seconds.labels(io)
        self.cluster_seconds = tuple(Histogram(
            f"{prefix}op_seconds", ("" if prefix == CLUSTER_PREFIXES[0] else
                                    "Deprecated: hicache_cluster_op_seconds says it. ") +
            "Calls to the cluster store (Mooncake), by op: setup, probe, exists, put, get, "
            "remove.", ["op"], buckets=DURATION_BUCKETS, registry=registry)
            for prefix in CLUSTER_PREFIXES)
        """The cluster store's calls, under both names (``hicache_remote_*`` deprecated)."""
        self.promotions = Counter("hicache_tier_promotions",
                                  "Keys read back from a lower tier into host memory by "
                                  "LoadKeys.", ["pool"], registry=registry)
        self.recovery_dropped = Counter(
            "hicache_pool_recovery_dropped_slots",
            "Saved key slots dropped on re-attach because their checksum failed.", ["pool"],
            registry=registry)
        self._outcomes: dict[str, set[str]] = {}
        """Per pool, the outcomes ``pool_attach`` has series for (removed with the pool)."""
        self._outcomes_lock = lock("metrics.outcomes")
        registry.register(_StateCollector(state, time.monotonic()))

    def observe_cluster(self, op: str, seconds: float) -> None:
        """One call to the cluster store, ``op`` long ``seconds``."""
        for h in self.cluster_seconds:
            h.labels(op).observe(seconds)

    def pool_attached(self, pool: HostPool, recovered: dict[str, int]) -> None:
        name = pool.spec.name
        self.promotions.labels(name)  # exported at 0 from the start: rate() works at once
        self._attached(name, pool.outcome.value if pool.outcome else "memory")
        self.recovered_keys.labels(name).inc(recovered.get("keys", 0))
        self.recovery_dropped.labels(name).inc(recovered.get("damaged", 0))

    def tally_sizes(self) -> dict[str, int]:
        """Per-thread tables and keys of the call and transfer tallies."""
        return {"tally_tables": self._calls.live_tables + self._transfers.live_tables,
                "tally_keys": self._calls.keys + self._transfers.keys}

    def pool_dropped(self, name: str, outcome: str) -> None:
        """A pool's saved state was not used (``outcome`` says why)."""
        self._attached(name, outcome)

    def _attached(self, name: str, outcome: str) -> None:
        with self._outcomes_lock:
            self._outcomes.setdefault(name, set()).add(outcome)
        self.pool_attach.labels(name, outcome).inc()

    def pool_deleted(self, name: str) -> None:
        """Forget the pool's series: a daemon whose pools come and go for months keeps the
        label sets of the pools it has, not of every pool it ever had."""
        for family in (self.recovered_keys, self.promotions, self.recovery_dropped):
            with contextlib.suppress(KeyError):
                family.remove(name)
        with self._outcomes_lock:
            outcomes = self._outcomes.pop(name, set())
        for outcome in outcomes:
            with contextlib.suppress(KeyError):
                self.pool_attach.remove(name, outcome)
        self._transfers.forget(lambda key: key[0] == name)

    def promoted(self, pool: str, n: int) -> None:
        self.promotions.labels(pool).inc(n)

    def call(self, method: str, code: str, fast: bool, seconds: float) -> None:
        """A call ended with ``code`` after ``seconds`` (``fast``: over the fast path):
        ``hicache_rpc_requests_total``, ``hicache_rpc_duration_seconds`` and
        ``hicache_fast_path_requests_total``."""
        _DURATION.observe(self._calls.row((method, code, fast)), 0, seconds)

    def transfer(self, pool: str, op: str, nbytes: int, pages: int, seconds: float) -> None:
        """A backup or load moved ``nbytes`` in ``pages`` in ``seconds``:
        ``hicache_transfer_{bytes,pages,requests}_total``,
        ``hicache_transfer_duration_seconds``."""
        row = self._transfers.row((pool, op))
        row[0] += nbytes
        row[1] += pages
        _DURATION.observe(row, 2, seconds)


class _CallCollector(Collector):
    """The per-call counts' families, rendered from their tallies at scrape time."""

    def __init__(self, calls: Tally[tuple[str, str, bool]],
                 transfers: Tally[tuple[str, str]], fast_methods: tuple[str, ...]) -> None:
        self._calls, self._transfers, self._fast_methods = calls, transfers, fast_methods

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("hicache_rpc_requests", "RPCs by method and gRPC code.",
                                       labels=["method", "code"])
        seconds = HistogramMetricFamily("hicache_rpc_duration_seconds",
                                        "RPC duration by method.", labels=["method"])
        fast = CounterMetricFamily(
            "hicache_fast_path_requests", "Calls served over the fast path (<socket>.fast): "
            "the data calls and heartbeats, by method; hicache_rpc_requests_total counts them "
            "too.", labels=["method"])
        per_code: dict[tuple[str, str], float] = {}
        per_method: dict[str, Row] = {}
        per_fast = dict.fromkeys(self._fast_methods, 0.0)
        for (method, code, is_fast), row in self._calls.totals().items():
            per_code[(method, code)] = per_code.get((method, code), 0.0) + row[0]
            add_into(per_method, {method: row})
            if is_fast:
                per_fast[method] = per_fast.get(method, 0.0) + row[0]
        for (method, code), n in sorted(per_code.items()):
            requests.add_metric([method, code], n)
        for method, row in sorted(per_method.items()):
            _DURATION.render(seconds, [method], row, 0)
        for method, n in sorted(per_fast.items()):
            fast.add_metric([method], n)
        op = ["pool", "op"]
        nbytes = CounterMetricFamily("hicache_transfer_bytes", "Bytes moved.", labels=op)
        pages = CounterMetricFamily("hicache_transfer_pages", "Pages moved.", labels=op)
        done = CounterMetricFamily("hicache_transfer_requests",
                                   "Completed backup/load requests.", labels=op)
        took = HistogramMetricFamily("hicache_transfer_duration_seconds",
                                     "Backup/load duration, validation included.", labels=op)
        for (pool, op_name), row in sorted(self._transfers.totals().items()):
            labels = [pool, op_name]
            nbytes.add_metric(labels, row[0])
            pages.add_metric(labels, row[1])
            done.add_metric(labels, row[2])
            _DURATION.render(took, labels, row, 2)
        yield from (requests, seconds, fast, nbytes, pages, done, took)


class MetricsEndpoint:
    """prometheus_client's WSGI app and threading server, served by a loop that sleeps until
    a scrape or ``shutdown`` (its own ``serve_forever`` polls twice a second, an idle daemon's
    most frequent wake-up)."""

    def __init__(self, metrics: Metrics, host: str, port: int) -> None:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]

        class Server(ThreadingWSGIServer):
            address_family = family

        class Quiet(WSGIRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass  # a scrape is not news

        self.httpd = make_server(str(sockaddr[0]), port, make_wsgi_app(metrics.registry),
                                 Server, handler_class=Quiet)
        self.server_address = self.httpd.server_address
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._loop, name="metrics-http", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self.httpd, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while True:
                for key, _ in sel.select():
                    if key.fileobj == self._wake_r:
                        return
                    self.httpd._handle_request_noblock()  # a scrape, on its own thread

    def shutdown(self) -> None:
        os.write(self._wake_w, b"x")
        self._thread.join(5)
        self.httpd.server_close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)


def serve(metrics: Metrics, address: str) -> tuple[MetricsEndpoint, int]:
    """Start the HTTP endpoint; returns (its server, the bound port)."""
    host, _, port = address.rpartition(":")
    server = MetricsEndpoint(metrics, host or "127.0.0.1", int(port))
    return server, int(server.server_address[1])
