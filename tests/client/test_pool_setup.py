"""An engine's pool on a real daemon (``hicache_client.pool_setup``): created as asked, adopted
when another instance made it in another size, and, for a size the engine derived itself,
fitted to this rank's share of what the daemon's memory budget has left; a size the user set
is created as asked or refused, never shrunk."""

from __future__ import annotations

import dataclasses

import pytest

from hicache.errors import HostMemoryInsufficient, PoolSpecConflict
from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec, same_storage
from hicache_client import HiCacheClient
from hicache_client.pool_setup import BudgetShare, ensure_pool
from tests.daemon_proc import DaemonProc, Daemons

PS = 16
GEOMETRY = KVGeometry(PoolKind.MHA, DType.BFLOAT16, layer_num=2, head_num=2, head_dim=64)
BUDGET = 16 << 20


def spec(name: str, pages: int) -> PoolSpec:
    return PoolSpec(name, GEOMETRY, PS, size_tokens=pages * PS)  # 16 KiB pages


@pytest.fixture
def daemon(daemons: Daemons) -> DaemonProc:
    return daemons.start("--memory-budget", str(BUDGET))


def test_a_derived_size_gives_way_to_the_budget_each_rank_its_share(daemon: DaemonProc) -> None:
    with HiCacheClient(daemon.target) as c:
        per_page = 0
        sizes: list[int] = []
        for rank in range(2):
            asked = spec(f"engine-tp{rank}of2", 4096)  # 64 MiB: four times the budget
            got = ensure_pool(c, asked, create=True, wait_seconds=10, share=BudgetShare(2))
            assert got.name == asked.name and got.page_size == PS
            assert c.get_pool(asked.name).size_tokens == got.size_tokens
            sizes.append(got.size_tokens // PS)
            info = c.get_info()
            per_page = per_page or info.memory_used_bytes // sizes[0]
        # rank 0 took half of the budget; rank 1 half of what was left then
        assert abs(sizes[0] - BUDGET // 2 // per_page) <= 1
        assert abs(sizes[1] - (BUDGET - sizes[0] * per_page) // 2 // per_page) <= 1
        assert c.get_info().memory_used_bytes <= BUDGET


def test_a_size_the_user_set_is_never_shrunk(daemon: DaemonProc) -> None:
    with HiCacheClient(daemon.target) as c:
        asked = spec("explicit", 4096)
        with pytest.raises(HostMemoryInsufficient):
            ensure_pool(c, asked, create=True, wait_seconds=10, share=None)
        assert [p.spec.name for p in c.list_pools()] == []  # refused: nothing made
        small = spec("explicit", 64)
        assert ensure_pool(c, small, create=True, wait_seconds=10, share=None) == small


def test_a_pool_of_another_size_is_adopted_and_another_geometry_refused(
        daemon: DaemonProc) -> None:
    with HiCacheClient(daemon.target) as c:
        c.create_pool(spec("shared", 64))
        got = ensure_pool(c, spec("shared", 256), create=True, wait_seconds=10,
                          share=BudgetShare(1))
        assert got.size_tokens == 64 * PS  # the creator's size
        other = dataclasses.replace(spec("shared", 64), geometry=dataclasses.replace(
            GEOMETRY, head_num=4))
        with pytest.raises(PoolSpecConflict):
            ensure_pool(c, other, create=True, wait_seconds=10)
        assert ensure_pool(c, spec("shared", 8), create=False, wait_seconds=10) == got


def test_a_pool_of_rows_made_before_opaque_serves_the_opaque_spec_after_an_upgrade(
        daemons: Daemons) -> None:
    """vLLM's pools were created as MLA uint8 rows (``kv_lora_rank`` = the row) before the
    OPAQUE kind existed. Such a pool, kept in the state directory across a daemon restart, is
    adopted by a worker that now asks for the OPAQUE pool of the same rows (created or not),
    and its pages load exactly into rows zeroed first; rows of another width are refused."""
    import numpy as np
    import torch

    from hicache.specs import Role
    from hicache_client.shm import ShmDeviceBuffers

    legacy = PoolSpec("vllm-rows", KVGeometry(PoolKind.MLA, DType.UINT8, 2, kv_lora_rank=40),
                      PS, size_tokens=64 * PS)
    rows = dataclasses.replace(legacy, geometry=KVGeometry(PoolKind.OPAQUE, DType.UINT8, 2,
                                                           row_bytes=40))
    keys = [b"block-0", b"block-1"]
    first = daemons.start("--memory-budget", str(BUDGET))
    src = ShmDeviceBuffers.create(legacy, 2 * PS, first.shm_dir)
    try:
        gen = torch.Generator().manual_seed(7)
        for t in src.all_tensors():
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
        with HiCacheClient(first.target) as c:
            c.create_pool(legacy)
            with c.open_session(legacy.name, "before", src.descriptors) as s:
                assert s.store(keys, np.arange(2 * PS)).stored == 2
        assert first.stop() == 0
        second = daemons.start("--memory-budget", str(BUDGET))
        with HiCacheClient(second.target) as c:
            assert c.get_pool(legacy.name).spec == legacy  # kept as it was made
            assert same_storage(ensure_pool(c, rows, create=False, wait_seconds=10), rows)
            assert ensure_pool(c, rows, create=True, wait_seconds=10) == rows
            for wider in (42, 80):
                other = dataclasses.replace(rows, geometry=dataclasses.replace(
                    rows.geometry, row_bytes=wider))
                for create in (False, True):
                    with pytest.raises(PoolSpecConflict):
                        ensure_pool(c, other, create=create, wait_seconds=10)
            dst = ShmDeviceBuffers.create(rows, 2 * PS, second.shm_dir)
            try:
                for t in dst.all_tensors():
                    t.zero_()
                with c.open_session(rows.name, "after", dst.descriptors) as s:
                    assert s.lookup(keys).hit_prefix == 2
                    s.load_keys(keys, np.arange(2 * PS))
                for a, b in zip(src.layers("kv", Role.KV), dst.layers("kv", Role.KV),
                                strict=True):
                    assert a.shape == b.shape and torch.equal(a[:2 * PS], b[:2 * PS])
                    assert int(b[:2 * PS].count_nonzero()) > 0
            finally:
                dst.close()
    finally:
        src.close()
