"""Each metric on a fresh registry after known operations."""

from __future__ import annotations

import torch
from prometheus_client import CollectorRegistry

from hicache.errors import CanaryMismatch, PoolExhausted
from hicache.specs import CanarySpec, Role
from hicached.cache.pool_cache import PoolCache
from hicached.copy.engine import TransferEngine
from hicached.server.metrics import REASONS, Metrics, ScrapeState
from tests.helpers import make_pool, mha, random_device, spec


def test_state_metrics_are_read_at_scrape_time() -> None:
    pool = make_pool(spec(mha(), canary=CanarySpec(16), name="c"))
    reg = CollectorRegistry()
    state = {"open": 2, "reaped": 5, "attached": 4096}
    cache = PoolCache(pool)
    Metrics(reg, ScrapeState(pools=lambda: [(pool, cache)], sessions_open=lambda: state["open"],
                             sessions_reaped=lambda: state["reaped"],
                             attached_bytes=lambda: state["attached"]),
            build={"version": "9.9", "torch": "x", "cuda_available": "false", "python": "3"})

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
        assert v("hicache_build_info", version="9.9", torch="x", cuda_available="false",
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
    m.transfer("p", "backup", 1000, 2, 0.5)
    m.transfer("p", "backup", 3000, 1, 0.002)
    assert reg.get_sample_value("hicache_transfer_bytes_total",
                                {"pool": "p", "op": "backup"}) == 4000
    assert reg.get_sample_value("hicache_transfer_pages_total",
                                {"pool": "p", "op": "backup"}) == 3
    assert reg.get_sample_value("hicache_transfer_requests_total",
                                {"pool": "p", "op": "backup"}) == 2
    assert reg.get_sample_value("hicache_transfer_bandwidth_bytes_per_second",
                                {"pool": "p", "op": "backup"}) == 1_500_000
    # the histogram resolves both a 2 ms control-plane-sized call and a 0.5 s bulk copy
    le = {"pool": "p", "op": "backup"}
    assert reg.get_sample_value("hicache_transfer_duration_seconds_bucket",
                                {**le, "le": "0.0025"}) == 1
    assert reg.get_sample_value("hicache_transfer_duration_seconds_bucket",
                                {**le, "le": "0.5"}) == 2
