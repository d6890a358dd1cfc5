"""``[budget] elastic``: a real server's pools share its budget by demand, through its RPCs.

A worker fills one pool and the pool grows past its floor while the other stays at its own;
then the other gets busy and the rebalancing thread moves the memory over; keys that stayed
load back exact into zeroed device rows; the shares, tenants and moves are scraped from the
server's own registry. The ``[budget]`` table is read from TOML as an operator writes it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache.errors import SpecInvalid
from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers
from hicache_client.cli import _size
from hicache_client.cli import main as hicachectl
from hicached.server.app import HiCacheServer, create_server
from hicached.server.config import ServerConfig, config_from_mapping
from hicached.service.budget_config import BudgetConfig, PoolShare, TenantQuota
from hicached.service.pool_table import _tables
from tests.fakecuda import UUID_A, UUID_B, FakeCuda, library
from tests.helpers import sample

GEOMETRY = KVGeometry(PoolKind.MLA, DType.BFLOAT16, 2, kv_lora_rank=512, qk_rope_head_dim=0)
"""A page's bytes of one layer are one OS page: on a GPU host, a unit of locked memory each."""
BUSY, IDLE = (PoolSpec(n, GEOMETRY, 4, size_tokens=4 * 32) for n in ("busy", "idle"))
PB = BUSY.page_bytes
BUDGET = 2 * _tables(BUSY) + 40 * PB  # 40 pages of KV besides the pools' tables


@pytest.fixture(params=["cpu", "gpu"])
def served(request: pytest.FixtureRequest, tmp_path: Path
           ) -> Iterator[tuple[HiCacheServer, HiCacheClient, Path]]:
    """The server on a host without a GPU, and on one with (the fake driver: pools
    page-locked, by units that follow their shares)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    if request.param == "gpu":
        os.environ.setdefault("FAKECUDA_DEVICES", f"{UUID_A},{UUID_B}")
    cfg = ServerConfig(
        listen=(f"unix:{tmp_path}/s.sock",), shm_dir=str(shm), state_dir="",
        metrics_listen="", memory_budget_bytes=BUDGET, reserve_bytes=0, grace_seconds=2,
        cuda_driver=library() if request.param == "gpu" else "",
        budget=BudgetConfig(elastic=True, interval_seconds=0.05, grow_step_bytes=PB,
                            step_fraction=0.1, pin_unit_bytes=4096, pools=(
                                PoolShare("busy", floor_bytes=4 * PB, tenant="a"),
                                PoolShare("idle", floor_bytes=8 * PB, tenant="b")),
                            tenants=(TenantQuota("b", guaranteed_bytes=8 * PB),)))
    server, bound = create_server(cfg)
    client = HiCacheClient(bound[0], reconnect_seconds=0.5)
    yield server, client, shm
    client.close()
    server.drain_and_stop(1.0)
    if request.param == "gpu":
        assert FakeCuda(library()).stat("registered_bytes") == 0, "stopped: all unlocked"


def locked(server: HiCacheServer, pool: str) -> int:
    """The pool's page-locked bytes (0 on a host without a GPU)."""
    return int(sample(server, "hicache_pool_pinned_bytes", pool=pool))


def fill(bufs: ShmDeviceBuffers, rows: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in bufs.all_tensors():
        raw = t.view(torch.uint8)
        raw[rows] = torch.randint(0, 256, raw[rows].shape, dtype=torch.uint8, generator=g)


def until(check, seconds: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.02)


def test_pools_share_the_budget_by_demand_through_the_server(served, capsys, request) -> None:  # type: ignore[no-untyped-def]
    server, client, shm = served
    gpu = request.node.callspec.params["served"] == "gpu"
    client.create_pool(BUSY)
    client.create_pool(IDLE)
    assert sample(server, "hicache_pool_share_bytes", pool="busy") == 4 * PB  # floors
    assert sample(server, "hicache_pool_share_bytes", pool="idle") == 8 * PB
    with ShmDeviceBuffers.create(BUSY, 4 * 32, str(shm)) as bufs, \
            client.open_session("busy", "w", bufs.descriptors, heartbeat=True) as s:
        stored = {}
        for i in range(30):  # one page per key, each from its own device rows
            rows = torch.arange(4 * i, 4 * i + 4) % (4 * 32)
            fill(bufs, rows, seed=i)
            saved = [t.view(torch.uint8)[rows].clone() for t in bufs.all_tensors()]
            assert s.store([b"k%03d" % i], rows).status == b"\x01"
            stored[b"k%03d" % i] = (rows, saved)
        # 32 - 8 = 24 pages were the slack and the floor: the busy pool grew past its floor
        share = sample(server, "hicache_pool_share_bytes", pool="busy")
        assert share == 30 * PB and client.get_pool("busy").keys == 30
        info = client.get_pool("busy")  # GetPool says it too
        assert (info.share_bytes, info.floor_bytes, info.ceiling_bytes, info.tenant) == (
            30 * PB, 4 * PB, 32 * PB, "a")
        assert info.used_pages == 30 and info.free_pages == 0
        capsys.readouterr()  # hicachectl's table says it as well, by pool
        assert hicachectl(["--target", client.target, "pools"]) == 0
        table = capsys.readouterr().out.splitlines()
        assert "share (floor..ceiling)" in table[0] and "tenant" in table[0]
        busy_row = next(line for line in table if line.startswith("busy "))
        shown = f"{_size(30 * PB)} ({_size(4 * PB)}..{_size(32 * PB)})"
        assert shown in busy_row and " a " in busy_row, busy_row
        assert sample(server, "hicache_tenant_share_bytes", tenant="a") == 30 * PB
        assert sample(server, "hicache_budget_slack_bytes") == 2 * PB
        assert (locked(server, "idle") > 0) == gpu, "pools are locked where a GPU is"
        if gpu:  # every page of the share locked, and about nothing more (a unit a page)
            assert 30 * PB <= locked(server, "busy") <= 31 * PB
            assert 8 * PB <= locked(server, "idle") <= 9 * PB
        busy_locked = locked(server, "busy")
        # the idle pool gets busy: its Stores want more than its floor, the thread moves the
        # budget's memory from the busy pool's oldest keys
        with ShmDeviceBuffers.create(IDLE, 4 * 32, str(shm)) as ib, \
                client.open_session("idle", "w", ib.descriptors, heartbeat=True) as t:
            r = 0

            def grown() -> bool:
                nonlocal r
                r += 1
                t.store([b"i%03d-%d" % (i, r) for i in range(8)], torch.arange(32))
                return sample(server, "hicache_pool_share_bytes", pool="idle") >= 16 * PB

            until(grown)
        assert sample(server, "hicache_cache_evictions_total", pool="busy", reason="budget") > 0
        assert sample(server, "hicache_budget_rounds_total") > 0
        # one scrape: the budget's thread may still be moving pages between the two pools
        shares = [s.value for family in server.registry.collect() for s in family.samples
                  if s.name == "hicache_pool_share_bytes"]
        assert len(shares) == 2 and sum(shares) <= 40 * PB, shares
        if gpu:  # the locked memory moved with the shares (read between rounds)
            def follows() -> bool:
                share = sample(server, "hicache_pool_share_bytes", pool="busy")
                got = locked(server, "busy")
                return share == sample(server, "hicache_pool_share_bytes", pool="busy") \
                    and share <= got <= share + PB

            until(follows)
            assert locked(server, "busy") < busy_locked
            assert locked(server, "idle") >= 16 * PB
            # nothing else is registered (read between the budget's rounds, which go on)
            until(lambda: locked(server, "busy") + locked(server, "idle")
                  == FakeCuda(library()).stat("registered_bytes"))
        # what the busy pool still holds loads back exact into zeroed rows (each key held by
        # its Lookup: the budget's rounds may go on taking the pool's oldest keys meanwhile)
        kept = [k for k in stored if s.lookup([k], hold_ms=10_000).held == 1]
        assert kept and len(kept) < 30
        for key in kept:
            rows, saved = stored[key]
            for tensor in bufs.all_tensors():
                tensor.view(torch.uint8)[rows] = 0
            s.load_keys([key], rows)
            for tensor, want in zip(bufs.all_tensors(), saved, strict=True):
                assert torch.equal(tensor.view(torch.uint8)[rows], want), key


def test_the_budget_table_is_read_from_toml() -> None:
    cfg = config_from_mapping({"budget": {
        "elastic": True, "interval_seconds": 0.5, "grow_step_bytes": "1MiB",
        "pools": [{"pools": "llama-*", "floor_bytes": "1GiB", "ceiling_bytes": "8GiB",
                   "tenant": "team-a"}],
        "tenants": [{"name": "team-a", "quota_bytes": "16GiB", "guaranteed_bytes": "2GiB"}]}})
    b = cfg.budget
    assert b.elastic and b.interval_seconds == 0.5 and b.grow_step_bytes == 1 << 20
    assert b.pools == (PoolShare("llama-*", 1 << 30, 8 << 30, "team-a"),)
    assert b.tenants == (TenantQuota("team-a", 16 << 30, 2 << 30),)
    assert b.pin_unit_bytes == 2 << 20
    assert config_from_mapping({"budget": {"pin_unit_bytes": "64MiB"}}).budget.pin_unit_bytes \
        == 64 << 20
    for bad in ({"elastic": True, "bogus": 1},
                {"pools": [{"pools": "x", "floor_bytes": "2GiB", "ceiling_bytes": "1GiB"}]},
                {"tenants": [{"name": "t", "quota_bytes": 1, "guaranteed_bytes": 2}]},
                {"tenants": [{"name": "t"}, {"name": "t"}]},
                {"interval_seconds": 0}, {"pin_unit_bytes": 512}):
        with pytest.raises(SpecInvalid):
            config_from_mapping({"budget": bad})


@pytest.mark.parametrize("point", ["store.taken", "store.copied"])
def test_a_shrink_while_a_store_writes_leaves_its_pages_and_its_bytes(
        served, point: str) -> None:  # type: ignore[no-untyped-def]
    """The budget's round shrinks a pool while one of its Stores is stopped between taking
    its pages and keeping them: those pages are neither moved nor given back (the share stays
    above them); the key lands whole, and the next round shrinks the pool."""
    import threading

    from hicache import seams

    server, client, shm = served
    client.create_pool(BUSY)
    budget = server.daemon.pools.budget
    assert budget is not None
    pool = server.daemon.pools.get("busy")
    with ShmDeviceBuffers.create(BUSY, 4 * 32, str(shm)) as bufs, \
            client.open_session("busy", "w", bufs.descriptors, heartbeat=True) as s:
        for i in range(20):  # pages 0..19, then the Store under test takes page 20
            s.store([b"old%02d" % i], torch.arange(4))
        rows = torch.arange(8, 12)
        fill(bufs, rows, seed=99)
        want = [t.view(torch.uint8)[rows].clone() for t in bufs.all_tensors()]
        errors: list[BaseException] = []

        def write() -> None:
            try:
                assert s.store([b"racer"], rows).status == b"\x01"
            except BaseException as exc:  # reported below
                errors.append(exc)

        with seams.Pause(point) as stop:
            t = threading.Thread(target=write)
            t.start()
            assert stop.wait_reached(10)
            writing = np.flatnonzero(pool.allocator._writer).tolist()
            assert writing == [20], writing  # the racer's page, being written
            budget._shrink(budget._members["busy"], 4)  # a round takes the pool down
            assert pool.allocator.limit == 21, "the page being written stays inside the share"
            assert pool.allocator.used_pages <= pool.allocator.limit
            stop.release()
            t.join(10)
        assert not errors, errors
        for tensor in bufs.all_tensors():
            tensor.view(torch.uint8)[rows] = 0
        s.load_keys([b"racer"], rows)
        for tensor, saved in zip(bufs.all_tensors(), want, strict=True):
            assert torch.equal(tensor.view(torch.uint8)[rows], saved)
        budget._shrink(budget._members["busy"], 4)  # now it is free to go down
        assert pool.allocator.limit == 4
        s.load_keys([b"racer"], rows)  # moved below, still whole
        for tensor, saved in zip(bufs.all_tensors(), want, strict=True):
            assert torch.equal(tensor.view(torch.uint8)[rows], saved)
