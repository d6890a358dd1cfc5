"""Each metric on a fresh registry after known operations."""

from __future__ import annotations

import torch
from prometheus_client import CollectorRegistry

from hicache.errors import CanaryMismatch, PoolExhausted
from hicache.specs import CanarySpec, Role
from hicached.cache.pool_cache import PoolCache
from hicached.copy.engine import TransferEngine
from hicached.server.metrics import REASONS, Metrics, ScrapeState
from hicached.service.calls import METHODS
from tests.helpers import make_pool, mha, random_device, spec


def test_state_metrics_are_read_at_scrape_time() -> None:
    pool = make_pool(spec(mha(), canary=CanarySpec(16), name="c"))
    reg = CollectorRegistry()
    state = {"open": 2, "reaped": 5, "attached": 4096}
    cache = PoolCache(pool)
    Metrics(reg, ScrapeState(pools=lambda: [(pool, cache)], sessions_open=lambda: state["open"],
                             sessions_reaped=lambda: state["reaped"],
                             attached_bytes=lambda: state["attached"]),
            build={"version": "9.9", "numpy": "x", "cuda_available": "false", "python": "3"})

    def v(name: str, **labels: str) -> float | None:
        got: float | None = reg.get_sample_value(name, labels)
        return got

    try:
        assert v("hicache_pool_used_pages", pool="c") == 0
        assert v("hicache_pool_capacity_pages", pool="c") == 16
        assert v("hicache_pool_capacity_bytes", pool="c") == pool.nbytes
        assert v("hicache_pool_pinned_bytes", pool="c") == 0
        engine = TransferEngine(1)
        dev = random_device(pool.spec, 32)
        host = pool.alloc(8)
        engine.backup(pool, dev, host, torch.arange(8))
        engine.load(pool, dev, host, torch.arange(8))
        pool.buffer("kv", Role.K).view(torch.uint8)[0, 0].view(-1)[0] ^= 0xFF
        try:
            engine.load(pool, dev, host, torch.arange(8))
        except CanaryMismatch:
            pass
        try:
            pool.alloc(10_000)
        except PoolExhausted:
            pass
        assert v("hicache_pool_used_pages", pool="c") == 2
        assert v("hicache_pool_used_bytes", pool="c") == 2 * pool.spec.page_bytes
        # 2 pages on the clean load, plus the intact page of the refused one
        assert v("hicache_canary_verified_pages_total", pool="c") == 3
        assert v("hicache_canary_mismatched_pages_total", pool="c") == 1
        assert v("hicache_pool_alloc_failures_total", pool="c") == 1
        assert v("hicache_sessions_open") == 2
        assert v("hicache_sessions_reaped_total") == 5
        assert v("hicache_sessions_attached_bytes") == 4096
        state["open"] = 0
        assert v("hicache_sessions_open") == 0
        assert v("hicache_build_info", version="9.9", numpy="x", cuda_available="false",
                 python="3") == 1
        uptime = v("hicache_uptime_seconds")
        assert uptime is not None and uptime >= 0
    finally:
        pool.close()


def test_request_metrics() -> None:
    reg = CollectorRegistry()
    m = Metrics(reg, ScrapeState(lambda: [], lambda: 0, lambda: 0, lambda: 0),
                build={"version": "1"})
    assert all(reg.get_sample_value("hicache_rejected_requests_total", {"reason": r}) == 0
               for r in REASONS)
    assert "INDICES_NOT_PAGE_ALIGNED" in REASONS and "CANARY_MISMATCH" in REASONS
    # every call the fast path carries has its series from the first scrape
    fast = [n for n, meth in METHODS.items() if not meth.grpc_only]
    assert "ReleaseHolds" in fast and all(
        reg.get_sample_value("hicache_fast_path_requests_total", {"method": n}) == 0
        for n in fast)
    m.transfer("p", "backup", 1000, 2, 0.5)
    m.transfer("p", "backup", 3000, 1, 0.002)
    assert reg.get_sample_value("hicache_transfer_bytes_total",
                                {"pool": "p", "op": "backup"}) == 4000
    assert reg.get_sample_value("hicache_transfer_pages_total",
                                {"pool": "p", "op": "backup"}) == 3
    assert reg.get_sample_value("hicache_transfer_requests_total",
                                {"pool": "p", "op": "backup"}) == 2
    # bandwidth is rate(hicache_transfer_bytes_total): no last-value gauge to mislead
    assert reg.get_sample_value("hicache_transfer_bandwidth_bytes_per_second",
                                {"pool": "p", "op": "backup"}) is None
    # the histogram resolves both a 2 ms control-plane-sized call and a 0.5 s bulk copy
    le = {"pool": "p", "op": "backup"}
    assert reg.get_sample_value("hicache_transfer_duration_seconds_bucket",
                                {**le, "le": "0.0025"}) == 1
    assert reg.get_sample_value("hicache_transfer_duration_seconds_bucket",
                                {**le, "le": "0.5"}) == 2


def test_a_scrape_takes_no_lock_of_the_copy_path() -> None:
    """With the allocator's and the cache's locks held by another thread (a copy starting or
    ending), a scrape still completes, with the page and key counts."""
    import threading

    pool = make_pool(spec(mha(), name="l"))
    cache = PoolCache(pool)
    reg = CollectorRegistry()
    Metrics(reg, ScrapeState(pools=lambda: [(pool, cache)], sessions_open=lambda: 0,
                             sessions_reaped=lambda: 0, attached_bytes=lambda: 0),
            build={"version": "1"})
    t = cache.begin_store([b"a", b"b"])
    cache.finish_store(t, True)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with cache._lock, pool.allocator._lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(5)
    got: dict[str, float | None] = {}
    scrape = threading.Thread(target=lambda: got.update(
        keys=reg.get_sample_value("hicache_cache_keys", {"pool": "l"}),
        used=reg.get_sample_value("hicache_pool_used_pages", {"pool": "l"}),
        keyed=reg.get_sample_value("hicache_pool_keyed_pages", {"pool": "l"})))
    scrape.start()
    scrape.join(5)
    blocked = scrape.is_alive()
    release.set()
    holder.join()
    scrape.join()
    try:
        assert not blocked, "the scrape waited for a lock the copy path holds"
        assert got == {"keys": 2, "used": 2, "keyed": 2}
    finally:
        pool.close()


def test_a_load_with_layer_events_is_timed_to_completion() -> None:
    """A load that returns once enqueued (pending) is recorded when its bytes landed, with
    the time until then; one that completes in its call with the engine's own time."""
    import threading
    import time
    from types import SimpleNamespace

    from hicached.copy.engine import Op, TransferResult
    from hicached.service.daemon import Daemon

    reg = CollectorRegistry()
    m = Metrics(reg, ScrapeState(lambda: [], lambda: 0, lambda: 0, lambda: 0),
                build={"version": "1"})
    held: list[int] = []
    host = SimpleNamespace(sessions=SimpleNamespace(begin_copy=lambda s: held.append(1),
                                                    end_copy=lambda s: held.pop()),
                           metrics=m)
    session = SimpleNamespace(pool_name="p", lock=threading.Lock(), loads=0)
    released = threading.Event()

    def enqueue(landed: object) -> TransferResult:
        assert callable(landed)
        threading.Timer(0.3, landed).start()  # the last layer lands 0.3 s later
        return TransferResult(Op.LOAD, 4096, 2, 0.0001, 0.0002, pending=True)

    le = {"pool": "p", "op": "load"}
    r = Daemon._held_load(host, session, "load", enqueue, release=released.set)  # type: ignore[arg-type]
    assert r.pending and held == [1]
    assert reg.get_sample_value("hicache_transfer_requests_total", le) is None  # not yet
    assert released.wait(5)
    deadline = time.monotonic() + 5
    while reg.get_sample_value("hicache_transfer_requests_total", le) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert held == []
    total = reg.get_sample_value("hicache_transfer_duration_seconds_sum", le)
    assert total is not None and total >= 0.3, total  # to completion, not to enqueue
    assert reg.get_sample_value("hicache_transfer_bytes_total", le) == 4096

    done = Daemon._held_load(host, session, "load",  # type: ignore[arg-type]
                             lambda landed: TransferResult(Op.LOAD, 10, 1, 0.25, 0.25))
    assert not done.pending and held == []
    assert reg.get_sample_value("hicache_transfer_duration_seconds_sum", le) == total + 0.5


def test_a_deleted_pools_series_go() -> None:
    """Pools created and deleted for months: the exporter keeps series of the pools there
    are, not of every pool there was."""
    reg = CollectorRegistry()
    m = Metrics(reg, ScrapeState(lambda: [], lambda: 0, lambda: 0, lambda: 0),
                build={"version": "1"})
    for i in range(50):
        name = f"p{i}"
        pool = make_pool(spec(mha(), page_size=4, size_tokens=16, name=name))
        m.pool_attached(pool, {"keys": 3, "damaged": 1})
        m.pool_dropped(name, "dropped_state_invalid")
        m.promoted(name, 2)
        m.transfer(name, "store", 100, 1, 0.001)
        if i < 49:
            m.pool_deleted(name)
        pool.close()
    names = {s.labels.get("pool") for f in reg.collect() for s in f.samples} - {None}
    assert names == {"p49"}, sorted(names)[:5]
    assert m._transfers.keys == 1
