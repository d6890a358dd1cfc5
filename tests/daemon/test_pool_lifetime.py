"""A pool's memory is never unmapped under a copy: closing waits for copies in flight.

Before, DeletePool checked only open sessions and shutdown closed pools after a drain that may
have timed out, so a copy still running (its session closed under it) could touch unmapped
memory. Now every copy is counted from before it plans until its pages are released; close
refuses new copies, waits (bounded) for the running ones, and leaves the memory mapped if one
outlives the bound.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hicache.errors import HiCacheError, PoolClosed
from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec, Role
from hicached.copy.engine import TransferEngine
from hicached.core.pool import HostPool, MemoryOptions
from hicached.core.worker_buffers import WorkerBuffers
from hicached.service.pool_build import PoolBuild
from hicached.service.pool_table import PoolTable

SPEC = PoolSpec("life", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 16, 8, 128), 16,
                Layout.LAYER_FIRST, size_tokens=64 * 16)


def create(table: PoolTable, spec: PoolSpec) -> tuple[HostPool, bool]:
    """``create_async``, its build waited for: the pool (or the build's error, raised) and
    whether it was created now."""
    got, created = table.create_async(spec)
    if isinstance(got, PoolBuild):
        assert got.wait(60)
        if got.error is not None:
            raise got.error
        return table.get(spec.name), created
    return got, created


def test_close_waits_for_a_copy_and_refuses_new_ones() -> None:
    pool = HostPool(SPEC)
    pool.begin_copy()
    assert not pool.close(wait_seconds=0.1)  # still copying: the memory stays mapped
    assert pool.components, "unmapped under a copy"
    assert pool.components[0].tensor.view(torch.uint8)[0].sum() is not None  # still readable
    with pytest.raises(PoolClosed):
        pool.begin_copy()
    pool.end_copy()
    assert pool.close(wait_seconds=0.1) and not pool.components
    assert pool.close()  # idempotent


def test_delete_during_a_running_copy_waits_then_frees() -> None:
    table = PoolTable(4 << 30, MemoryOptions(reserve_bytes=0))
    pool, _ = create(table, SPEC)
    engine = TransferEngine(threads=1)
    src = WorkerBuffers.allocate(SPEC, 64 * 16)
    for layer in src.layers("kv", Role.K) + src.layers("kv", Role.V):
        raw = layer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    host = pool.alloc(64 * 16)
    results: list[object] = []
    started = threading.Event()
    original = pool.begin_copy

    def begin_then_signal() -> None:
        original()
        started.set()
        time.sleep(0.3)  # hold the copy open while the delete arrives

    pool.begin_copy = begin_then_signal  # type: ignore[method-assign]

    def copy() -> None:
        try:
            results.append(engine.backup(pool, src, host, torch.arange(64 * 16)))
        except Exception as exc:
            results.append(exc)

    t = threading.Thread(target=copy)
    t.start()
    assert started.wait(10)
    t0 = time.monotonic()
    table.delete(SPEC.name)
    waited = time.monotonic() - t0
    t.join(10)
    assert results and not isinstance(results[0], Exception), results
    assert waited > 0.05, "the delete did not wait for the copy"
    assert not pool.components and pool.copies_in_flight == 0
    with pytest.raises(PoolClosed):  # and nothing copies into it afterwards
        engine.backup(pool, src, host, torch.arange(16))


def test_a_pool_whose_build_fails_late_leaves_nothing_behind() -> None:
    """A build that fails after its tiers started (the attach hook, the listener, the budget
    raising): no tiers, no listener entry, no budget member stay; the same name builds then."""
    from hicached.service.budget_config import BudgetConfig
    from hicached.service.memory_budget import MemoryBudget

    calls: list[str] = []

    class Listener:
        def attached(self, name: str, stack: object) -> None:
            calls.append(f"attached {name}")

        def deleting(self, name: str, stack: object) -> None:
            calls.append(f"deleting {name}")

    fail = [True]

    def on_attach(pool: object, recovered: object) -> None:
        if fail[0]:
            raise RuntimeError("metrics refused it")

    budget = MemoryBudget(1 << 30, BudgetConfig(elastic=True))
    table = PoolTable(1 << 30, MemoryOptions(reserve_bytes=0, hugepages=False),
                      on_attach=on_attach, listener=Listener(),  # type: ignore[arg-type]
                      budget=budget)
    spec = PoolSpec("late", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 2, 16), 4,
                    size_tokens=64)
    with pytest.raises(HiCacheError, match="metrics refused it"):
        create(table, spec)
    assert table.stacks() == [] and table._stacks == {}
    assert calls == ["attached late", "deleting late"]
    assert budget.shares() == []
    fail[0] = False
    _, created = create(table, spec)
    assert created and [n for n, _ in table.stacks()] == ["late"]
    table.delete("late")
