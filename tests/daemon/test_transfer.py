from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hicache.errors import GeometryMismatch, HiCacheError, PageNotAllocated, PoolClosed
from hicache.specs import DType, KVGeometry, Layout, MemberSpec, PoolKind, PoolSpec, Role
from hicached.copy import cpu, native
from hicached.copy.engine import TransferEngine
from hicached.core.pool import HostPool
from hicached.core.worker_buffers import WorkerBuffers
from tests.helpers import (
    TOKEN_DTYPES,
    device_bytes,
    dsa,
    geometry_for,
    make_pool,
    mha,
    mla,
    native_kernel,
    pool_bytes,
    random_device,
    spec,
)

ENGINE = TransferEngine(threads=2)
LAYOUTS = list(Layout)


@pytest.fixture(params=["native", "python"])
def executor(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test with the native kernel and with the pure-Python fallback."""
    with native_kernel(request.param == "native"):
        yield request.param


def device_rows(dev: WorkerBuffers, member: str, role: Role, layer: int, pages: np.ndarray,
                ps: int, page_granular: bool) -> torch.Tensor:
    t = dev.layers(member, role)[layer].view(torch.uint8)
    if page_granular:
        return t[torch.from_numpy(pages)]
    tok = torch.from_numpy((pages[:, None] * ps + np.arange(ps)).reshape(-1))
    return t[tok]


def assert_same_pages(a: WorkerBuffers, b: WorkerBuffers, s: PoolSpec, pa: np.ndarray,
                      pb: np.ndarray, layers: range | None = None) -> None:
    for name, geometry in s.members():
        for comp in geometry.components(s.page_size):
            for layer in layers if layers is not None else range(geometry.layer_num):
                if layer >= geometry.layer_num:
                    continue
                x = device_rows(a, name, comp.role, layer, pa, s.page_size, comp.page_granular)
                y = device_rows(b, name, comp.role, layer, pb, s.page_size, comp.page_granular)
                assert torch.equal(x, y), (name, comp.role, layer)


def page_indices(pages: list[int] | np.ndarray, ps: int) -> torch.Tensor:
    p = np.asarray(pages, dtype=np.int64)
    return torch.from_numpy((p[:, None] * ps + np.arange(ps)).reshape(-1))


KIND_DTYPES = [(k, d) for k in (PoolKind.MHA, PoolKind.MLA) for d in TOKEN_DTYPES] + [
    (PoolKind.DSA_INDEXER, DType.UINT8),  # DSA index buffers are always uint8
    (PoolKind.OPAQUE, DType.UINT8),  # opaque rows are bytes
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
@pytest.mark.parametrize("kind,dtype", KIND_DTYPES, ids=lambda x: x.value)
@pytest.mark.parametrize("page_size", [1, 4])
def test_round_trip_is_exact(layout: Layout, dtype: DType, kind: PoolKind, page_size: int,
                             executor: str) -> None:
    s = spec(geometry_for(kind, dtype), page_size=page_size, layout=layout,
             size_tokens=16 * page_size)
    pool = make_pool(s)
    try:
        src = random_device(s, 12 * page_size, seed=1)
        host = pool.alloc(6 * page_size)
        dev_pages = np.array([9, 0, 3, 4, 5, 11])
        r = ENGINE.backup(pool, src, host, page_indices(dev_pages, page_size))
        assert r.pages == 6 and r.bytes == 6 * s.page_bytes
        dst = WorkerBuffers.allocate(s, 12 * page_size)
        back_pages = np.array([1, 2, 3, 7, 6, 10])
        ENGINE.load(pool, dst, host, page_indices(back_pages, page_size))
        assert_same_pages(src, dst, s, dev_pages, back_pages)
        pool.allocator.memcheck()
    finally:
        pool.close()


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
def test_host_placement_matches_sglang_layout(layout: Layout) -> None:
    """Bytes land where SGLang's host pool keeps token t of layer l."""
    ps = 4
    s = spec(mha(DType.FLOAT32), page_size=ps, layout=layout)
    pool = make_pool(s)
    try:
        src = random_device(s, 32)
        host = pool.alloc(8)  # pages 0, 1
        ENGINE.backup(pool, src, host, page_indices([5, 2], ps))
        hk = pool.buffer("kv", Role.K)
        for layer in range(3):
            dk = src.layers("kv", Role.K)[layer]
            for i, t in enumerate(host.tolist()):
                d_tok = [5, 2][i // ps] * ps + i % ps
                if layout is Layout.LAYER_FIRST:
                    h = hk[layer, t]
                elif layout is Layout.PAGE_FIRST:
                    h = hk[t, layer]
                else:
                    h = hk[t // ps, layer, t % ps]
                assert torch.equal(h.view(torch.uint8), dk[d_tok].view(torch.uint8))
    finally:
        pool.close()


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
def test_per_layer_load_touches_only_its_layers(layout: Layout, executor: str) -> None:
    s = spec(mha(), layout=layout)
    pool = make_pool(s)
    try:
        src = random_device(s, 32, seed=3)
        host = pool.alloc(16)
        dpages = page_indices([0, 1, 2, 3], 4)
        ENGINE.backup(pool, src, host, dpages)
        dst = random_device(s, 32, seed=4)
        before = device_bytes(dst)
        ENGINE.load(pool, dst, host, dpages, layer_begin=1, layer_end=2)
        assert_same_pages(src, dst, s, np.arange(4), np.arange(4), layers=range(1, 2))
        after = device_bytes(dst)
        # layers 0 and 2 of K and V are untouched (order: K0 K1 K2 V0 V1 V2)
        for i in (0, 2, 3, 5):
            assert torch.equal(before[i], after[i])
    finally:
        pool.close()


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
def test_pool_group_moves_every_member_with_shared_indices(layout: Layout) -> None:
    s = PoolSpec("g", mla(DType.FLOAT8_E4M3), 4, layout, size_tokens=64,
                 side_pools=(MemberSpec("indexer", dsa()),))
    pool = make_pool(s)
    try:
        src = random_device(s, 40, seed=5)
        host = pool.alloc(12)
        ENGINE.backup(pool, src, host, page_indices([7, 8, 9], 4))
        dst = WorkerBuffers.allocate(s, 40)
        ENGINE.load(pool, dst, host, page_indices([0, 4, 2], 4))
        assert_same_pages(src, dst, s, np.array([7, 8, 9]), np.array([0, 4, 2]))
    finally:
        pool.close()


def test_logical_anchor_group() -> None:
    s = PoolSpec("lg", KVGeometry(PoolKind.LOGICAL), 2, size_tokens=32,
                 side_pools=(MemberSpec("swa", mha(layers=2)),))
    pool = make_pool(s)
    try:
        src = random_device(s, 16)
        host = pool.alloc(4)
        ENGINE.backup(pool, src, host, page_indices([3, 1], 2))
        dst = WorkerBuffers.allocate(s, 16)
        ENGINE.load(pool, dst, host, page_indices([3, 1], 2))
        assert_same_pages(src, dst, s, np.array([3, 1]), np.array([3, 1]))
    finally:
        pool.close()


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
def test_runs_of_consecutive_pages_round_trip(layout: Layout, executor: str) -> None:
    """Runs coalesce into single copies; broken runs and reversed runs must not."""
    s = spec(mha(), page_size=2, layout=layout, size_tokens=64)
    pool = make_pool(s)
    try:
        src = random_device(s, 40, seed=11)
        host = pool.alloc(32)
        hp = np.array([4, 5, 6, 9, 10, 3, 2, 1, 15])
        dp = np.array([0, 1, 2, 3, 4, 12, 11, 10, 5])
        ENGINE.backup(pool, src, host.reshape(-1, 2)[torch.from_numpy(hp)].reshape(-1),
                      page_indices(dp, 2))
        dst = WorkerBuffers.allocate(s, 40)
        ENGINE.load(pool, dst, host.reshape(-1, 2)[torch.from_numpy(hp)].reshape(-1),
                    page_indices(dp + 6, 2))
        assert_same_pages(src, dst, s, dp, dp + 6)
    finally:
        pool.close()


def test_large_transfer_uses_threads_and_is_exact() -> None:
    s = spec(mha(layers=4, heads=8, dim=128), page_size=16, size_tokens=2048)
    pool = make_pool(s)
    try:
        src = random_device(s, 1024)
        host = pool.alloc(1024)
        pages = np.random.default_rng(0).permutation(64)
        r = ENGINE.backup(pool, src, host, page_indices(pages, 16))
        assert r.bytes > cpu.MIN_PARALLEL_BYTES
        dst = WorkerBuffers.allocate(s, 1024)
        ENGINE.load(pool, dst, host, page_indices(pages, 16))
        assert_same_pages(src, dst, s, pages, pages)
    finally:
        pool.close()


@pytest.mark.skipif(native.KERNEL is None, reason="native kernel not built")
@given(unit=st.integers(1, 300), units=st.integers(1, 12), shift=st.integers(0, 63),
       seed=st.integers(0, 2**32 - 1))
def test_streaming_stores_copy_exactly_at_any_size_and_alignment(unit: int, units: int,
                                                                shift: int, seed: int) -> None:
    """The kernel's non-temporal path (a destination aligned to 16 bytes first, 64-byte
    blocks, a tail by memcpy) against zeroed rows, with blocks of every length and start."""
    kernel = native.KERNEL
    assert kernel is not None
    rng = np.random.default_rng(seed)
    pages, layers, pitch = 24, 2, unit * units
    src = rng.integers(0, 256, size=(layers, pages * pitch + 64), dtype=np.uint8)
    dst = np.zeros((layers, pages * pitch + 128), dtype=np.uint8)
    sp = rng.permutation(pages)[:16].astype(np.int64)
    dp = rng.permutation(pages)[:16].astype(np.int64)
    sb = np.array([src[i].ctypes.data + shift for i in range(layers)], dtype=np.int64)
    db = np.array([dst[i].ctypes.data + 64 - shift for i in range(layers)], dtype=np.int64)
    moved = kernel.copy_pages(db, sb, dp, sp, unit, units, pitch, pitch, unit, unit, 1, 0, 1,
                              False)
    assert moved == layers * 16 * pitch
    want = np.zeros_like(dst)
    for layer in range(layers):
        for d, s_ in zip(dp.tolist(), sp.tolist(), strict=True):
            at = 64 - shift + d * pitch
            want[layer, at:at + pitch] = src[layer, shift + s_ * pitch:shift + (s_ + 1) * pitch]
    assert np.array_equal(dst, want)


@pytest.mark.skipif(native.KERNEL is None, reason="native kernel not built")
def test_backups_stream_into_the_pool_from_a_quarter_mib_and_loads_into_devices_do_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing reads a pool page until a later load: a backup of 256 KiB or more is written
    with non-temporal stores; a load's rows are read by the engine next, so it streams only
    past ``STREAMING_BYTES``. Odd rows (74 bytes) put every block off the 16-byte grid."""
    assert native.KERNEL is not None
    kernel: Any = native.KERNEL
    seen: list[int] = []

    class Spy:
        BufferFault = kernel.BufferFault

        def copy_pages(self, *args: Any) -> int:
            seen.append(args[12])
            return int(kernel.copy_pages(*args))

    monkeypatch.setattr(native, "KERNEL", Spy())
    s = spec(mha(layers=8, heads=1, dim=37), page_size=16, size_tokens=128 * 16)
    pool = make_pool(s)
    try:
        src = random_device(s, 80 * 16)
        host = pool.alloc(64 * 16)
        pages = np.random.default_rng(1).permutation(80)[:64]
        r = ENGINE.backup(pool, src, host, page_indices(pages, 16))
        assert r.bytes // 2 >= cpu.BACKUP_STREAMING_BYTES  # each of K and V's plans streams
        assert seen == [cpu.BACKUP_STREAMING_BYTES] * 2
        dst = WorkerBuffers.allocate(s, 80 * 16)
        ENGINE.load(pool, dst, host, page_indices(pages, 16))
        assert seen[2:] == [cpu.STREAMING_BYTES] * 2
        assert_same_pages(src, dst, s, pages, pages)
    finally:
        pool.close()


def test_device_geometry_mismatch_lists_every_bad_buffer() -> None:
    s = spec(mha())
    pool = make_pool(s)
    try:
        dev = WorkerBuffers.allocate(s, 16)
        dev.buffers["kv"][Role.K][1] = torch.zeros(20, 2, 8, dtype=torch.float16)
        dev.buffers["kv"][Role.V] = dev.buffers["kv"][Role.V][:2]
        with pytest.raises(GeometryMismatch) as exc:
            ENGINE.backup(pool, dev, pool.alloc(4), torch.arange(4))
        fields = [v.field for v in exc.value.violations]
        assert fields == ["buffers[kv.K[1]]", "buffers[kv.V]"]
    finally:
        pool.close()


def test_closed_pool_rejects_transfers() -> None:
    s = spec(mha())
    pool = make_pool(s)
    dev = WorkerBuffers.allocate(s, 16)
    idx = pool.alloc(4)
    pool.close()
    with pytest.raises(PoolClosed):
        ENGINE.backup(pool, dev, idx, torch.arange(4))


def test_load_of_unwritten_layers_is_refused_and_moves_nothing() -> None:
    s = spec(mha())  # 3 layers
    pool = make_pool(s)
    try:
        src, dst = random_device(s, 16), random_device(s, 16, seed=1)
        host = pool.alloc(8)
        ENGINE.backup(pool, src, host[:4], torch.arange(4), layer_begin=0, layer_end=2)
        before = device_bytes(dst)
        for h, layers in ((host[:4], (0, 3)), (host[4:], (0, 1)), (host, (0, 2))):
            with pytest.raises(HiCacheError) as exc:
                ENGINE.load(pool, dst, h, torch.arange(h.numel()), *layers)
            assert exc.value.reason == "PAGE_NOT_WRITTEN", layers
        assert exc.value.metadata["page"] == str(int(host[4]) // 4)
        assert all(torch.equal(a, b) for a, b in zip(before, device_bytes(dst), strict=True))
        ENGINE.load(pool, dst, host[:4], torch.arange(4), 0, 2)  # what was written loads
        ENGINE.backup(pool, src, host[:4], torch.arange(4), layer_begin=2, layer_end=3)
        ENGINE.load(pool, dst, host[:4], torch.arange(4))  # now every layer was written
        assert_same_pages(src, dst, s, np.array([0]), np.array([0]))
    finally:
        pool.close()


def test_a_page_held_by_another_copy_is_busy_and_nothing_moves() -> None:
    s = spec(mha())
    pool = make_pool(s)
    try:
        src, dst = random_device(s, 16), random_device(s, 16, seed=1)
        host = pool.alloc(8)
        ENGINE.backup(pool, src, host, torch.arange(8))
        page = host[4:5].numpy() // 4
        host_before, dst_before = pool_bytes(pool), device_bytes(dst)
        pool.allocator.acquire(page, write=True)  # another request writes page 1
        with pytest.raises(HiCacheError) as exc:
            ENGINE.load(pool, dst, host, torch.arange(8))
        assert exc.value.reason == "PAGE_BUSY" and exc.value.metadata["first_bad_position"] == "4"
        with pytest.raises(HiCacheError):
            ENGINE.backup(pool, random_device(s, 16, seed=2), host, torch.arange(8))
        assert torch.equal(pool_bytes(pool), host_before)
        assert all(torch.equal(a, b) for a, b in zip(dst_before, device_bytes(dst), strict=True))
        pool.allocator.release(page, write=True)
        pool.allocator.acquire(page, write=False)  # another request reads page 1
        ENGINE.load(pool, dst, host, torch.arange(8))  # readers share
        with pytest.raises(HiCacheError) as exc:
            ENGINE.backup(pool, src, host, torch.arange(8))
        assert exc.value.reason == "PAGE_BUSY"
        pool.allocator.release(page, write=False)
        pool.allocator.memcheck()
    finally:
        pool.close()


def test_transfer_to_freed_page_is_rejected() -> None:
    s = spec(mha())
    pool = make_pool(s)
    try:
        dev = random_device(s, 16)
        idx = pool.alloc(4)
        pool.free(idx)
        with pytest.raises(PageNotAllocated):
            ENGINE.backup(pool, dev, idx, torch.arange(4))
    finally:
        pool.close()


# -- property-based: valid batches round-trip; invalid ones change nothing -------------------

GEOMS = st.sampled_from([
    mha(DType.BFLOAT16), mha(DType.FLOAT32, v_dim=4), mla(DType.FLOAT8_E5M2), mla(DType.UINT8),
])


@st.composite
def valid_case(draw: st.DrawFn) -> tuple[PoolSpec, np.ndarray, np.ndarray]:
    ps = draw(st.sampled_from([1, 2, 3, 4, 8]))
    layout = draw(st.sampled_from(LAYOUTS))
    geometry = draw(GEOMS)
    side = draw(st.booleans())
    s = PoolSpec("h", geometry, ps, layout, size_tokens=16 * ps,
                 side_pools=(MemberSpec("idx", dsa(layers=geometry.layer_num)),) if side else ())
    n = draw(st.integers(0, 8))
    dev_pages = draw(st.lists(st.integers(0, 11), min_size=n, max_size=n, unique=True))
    return s, np.arange(n), np.asarray(dev_pages, dtype=np.int64)


@given(valid_case())
def test_property_valid_batches_round_trip(case: tuple[PoolSpec, np.ndarray, np.ndarray]
                                           ) -> None:
    s, _, dev_pages = case
    pool = make_pool(s)
    try:
        src = random_device(s, 12 * s.page_size, seed=7)
        host = pool.alloc(dev_pages.size * s.page_size)
        ENGINE.backup(pool, src, host, page_indices(dev_pages, s.page_size))
        dst = WorkerBuffers.allocate(s, 12 * s.page_size)
        rev = dev_pages[::-1].copy()  # host page i goes back to another device page
        ENGINE.load(pool, dst, host, page_indices(rev, s.page_size))
        assert_same_pages(src, dst, s, dev_pages, rev)
        pool.allocator.memcheck()
    finally:
        pool.close()


def corrupt(draw: Callable[..., Any], idx: np.ndarray, ps: int, bound: int) -> np.ndarray:
    how = draw(st.sampled_from(["shift", "truncate", "extend", "negative", "huge", "dup",
                                "swap"]))
    idx = idx.copy()
    if how == "shift" and idx.size:
        idx[draw(st.integers(0, idx.size - 1))] += draw(st.sampled_from([-1, 1, 2, ps + 1]))
    elif how == "truncate" and idx.size:
        idx = idx[: draw(st.integers(0, idx.size - 1))]
    elif how == "extend":
        idx = np.concatenate([idx, np.arange(draw(st.integers(1, ps)), dtype=np.int64)])
    elif how == "negative" and idx.size:
        idx[draw(st.integers(0, idx.size - 1))] = -draw(st.integers(1, 10**6))
    elif how == "huge" and idx.size:
        idx[draw(st.integers(0, idx.size - 1))] = bound + draw(st.integers(0, 2**40))
    elif how == "dup" and idx.size >= ps:
        idx = np.concatenate([idx, idx[:ps]])
    elif how == "swap" and idx.size >= 2 and ps >= 2:
        i = draw(st.integers(0, idx.size - 2))
        idx[i], idx[i + 1] = idx[i + 1], idx[i]
    else:
        idx = np.concatenate([idx, np.array([bound], dtype=np.int64)])
    return idx


@given(valid_case(), st.data(), st.sampled_from(["host", "device", "both"]),
       st.sampled_from(["backup", "load"]))
def test_property_invalid_batches_change_no_byte(
        case: tuple[PoolSpec, np.ndarray, np.ndarray], data: st.DataObject, side: str,
        op: str) -> None:
    s, _, dev_pages = case
    ps = s.page_size
    pool = make_pool(s)
    try:
        src = random_device(s, 12 * ps, seed=8)
        host = pool.alloc(max(dev_pages.size, 1) * ps).numpy()
        dev_pages = dev_pages if dev_pages.size else np.array([0])
        ENGINE.backup(pool, src, host, page_indices(dev_pages, ps))
        h, d = host, page_indices(dev_pages, ps).numpy()
        if side in ("host", "both"):
            h = corrupt(data.draw, h, ps, 16 * ps)
        if side in ("device", "both"):
            d = corrupt(data.draw, d, ps, 13 * ps)
        target = random_device(s, 12 * ps, seed=9)
        snap_pool, snap_dev = pool_bytes(pool), device_bytes(target)
        snap_src = device_bytes(src)
        fn = ENGINE.backup if op == "backup" else ENGINE.load
        dev_kv = src if op == "backup" else target
        try:
            fn(pool, dev_kv, h, d)
        except HiCacheError as exc:
            assert exc.violations, "a rejection must list its violations"
            assert exc.reason in {v.reason for v in exc.violations}
        else:
            # the corruption happened to produce another valid batch (e.g. a swapped pair
            # inside the same run never is; a shift can land on a valid page run): fine
            return
        assert torch.equal(pool_bytes(pool), snap_pool)
        assert all(torch.equal(a, b) for a, b in zip(device_bytes(target), snap_dev,
                                                     strict=True))
        assert all(torch.equal(a, b) for a, b in zip(device_bytes(src), snap_src, strict=True))
        pool.allocator.memcheck()
    finally:
        pool.close()


def test_pool_is_usable_from_many_threads() -> None:
    from concurrent.futures import ThreadPoolExecutor

    s = spec(mha(), page_size=2, size_tokens=256)
    pool = make_pool(s)
    try:
        def worker(seed: int) -> bool:
            src = random_device(s, 32, seed=seed)
            dst = WorkerBuffers.allocate(s, 32)
            for _ in range(20):
                host = pool.alloc(8)
                ENGINE.backup(pool, src, host, torch.arange(8))
                ENGINE.load(pool, dst, host, torch.arange(8))
                pool.free(host)
            return all(torch.equal(a[:8].view(torch.uint8), b[:8].view(torch.uint8)) for a, b in
                       zip(src.layers("kv", Role.K), dst.layers("kv", Role.K), strict=True))

        with ThreadPoolExecutor(4) as ex:
            assert all(ex.map(worker, range(8)))
        pool.allocator.memcheck()
        assert pool.allocator.used_pages == 0
    finally:
        pool.close()


def test_host_pool_rejects_budget_over_available_memory() -> None:
    from hicache.errors import HostMemoryInsufficient

    s = PoolSpec("huge", mha(layers=64, heads=64, dim=128), 64, size_tokens=64 * 10**6)
    with pytest.raises(HostMemoryInsufficient) as exc:
        HostPool(s)
    assert int(exc.value.metadata["requested_bytes"]) > int(exc.value.metadata["allowed_bytes"])
