"""The ways a batch moves between a GPU and the pool (``hicached.cuda.paths``), on the fake driver.

- The page kernel (``pages.cu``) compiles with the real NVRTC here (no GPU needed), for the
  architectures the daemon meets; its binaries are cached by source and architecture in a
  directory the daemon owns, and a damaged or planted file is never loaded.
- The fake driver runs the same kernel source, compiled as C++ (tests/fakecuda), and checks
  every fragment it copies: each way (``dma``, ``batch``, ``kernel``) round-trips every
  layout x page size x dtype x pool kind exact into rows zeroed first, over a pool locked in
  chunks (the seams the DMA ways must cut at) and over an elastic pool (locked memory only),
  with per-layer events after their layers.
- A property test holds a launch table and the kernel to a byte model of the plans.
- The choice: warm-up, the fastest, exploration, and ``dma`` wherever another way is missing
  (said once, with why).
"""

from __future__ import annotations

import ctypes
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path as FsPath

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.cuda_driver import (
    DEV_ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
    CudaDriver,
)
from hicache.specs import DType, KVGeometry, Layout, PoolKind
from hicached.copy.engine import TransferEngine
from hicached.copy.plan import CopyPlan
from hicached.core.pool import HostPool, MemoryOptions
from hicached.cuda.kernels import KERNEL, SOURCE, KernelBinaries, cache_key, load_page_kernel
from hicached.cuda.launch import PLAN_WORDS, TableRing, build_table, fragments
from hicached.cuda.nvrtc import CompileFailed, Nvrtc, load_nvrtc, nvrtc_problem
from hicached.cuda.paths import EXPLORE, WARMUP, CopyPaths, Path, size_class
from hicached.cuda.pinner import DriverPinner
from hicached.cuda.runner import CudaRunner
from hicached.transport.cuda_ipc import CudaIpcTransport
from tests.cuda_fixtures import (
    attached_pair,
    free_gpu_kv,
    make_gpu_kv,
    page_indices,
    release_pair,
    rows,
)
from tests.fakecuda import FakeCuda
from tests.helpers import SMALL, geometry_for, spec

ENGINE = TransferEngine(threads=2)
pytestmark = pytest.mark.usefixtures("counters_settle")
WAYS = [Path.DMA, Path.BATCH, Path.KERNEL]


@pytest.fixture(scope="module")
def nvrtc() -> Nvrtc:
    got = load_nvrtc()
    if got is None:
        if os.environ.get("CI"):
            raise AssertionError(f"NVRTC: {nvrtc_problem()} (the [test] extra installs it)")
        pytest.skip(nvrtc_problem())
    return got


@pytest.fixture(scope="module")
def binaries(nvrtc: Nvrtc) -> KernelBinaries:
    return KernelBinaries("", nvrtc)


def transport_for(driver: CudaDriver, way: Path, binaries: KernelBinaries
                  ) -> CudaIpcTransport:
    """A transport whose sessions copy by ``way`` alone (dma where the device lacks it)."""
    return CudaIpcTransport(driver, (way,), binaries)


def counts(fake: FakeCuda) -> dict[str, int]:
    return {k: fake.stat(k) for k in ("copies", "launches", "batches", "kernel_faults",
                                      "straddling_copies", "unpinned_copies")}


def took(fake: FakeCuda, before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in counts(fake).items()}


def assert_way(way: Path, diff: dict[str, int]) -> None:
    """The batch went the way asked, and nothing went wrong on the device."""
    assert diff["kernel_faults"] == 0 and diff["straddling_copies"] == 0, diff
    if way is Path.KERNEL:
        assert diff["launches"] > 0 and diff["copies"] == 0 and diff["batches"] == 0, diff
    elif way is Path.BATCH:
        assert diff["batches"] > 0 and diff["launches"] == 0, diff
    else:
        assert diff["batches"] == 0 and diff["launches"] == 0 and diff["copies"] > 0, diff


# -- NVRTC and the kernel binaries ------------------------------------------------------------

@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100"])
def test_the_page_kernel_compiles_with_nvrtc(nvrtc: Nvrtc, arch: str) -> None:
    from hicached.cuda.kernels import OPTIONS

    cubin = nvrtc.compile(SOURCE, "pages.cu", arch, OPTIONS)
    assert cubin[:4] == b"\x7fELF" and KERNEL.encode() in cubin


def test_a_source_that_does_not_compile_says_why(nvrtc: Nvrtc) -> None:
    with pytest.raises(CompileFailed, match="does not compile for sm_90") as info:
        nvrtc.compile(b'extern "C" __global__ void f() { undeclared(); }', "bad.cu", "sm_90")
    assert "undeclared" in info.value.log


def test_binaries_are_cached_by_source_and_architecture(nvrtc: Nvrtc, tmp_path: FsPath
                                                        ) -> None:
    cache = tmp_path / "kernels"
    first = KernelBinaries(str(cache), nvrtc)
    cubin = first.cubin("sm_90")
    assert first.compiled == 1 and first.cubin("sm_90") == cubin and first.compiled == 1
    (path,) = cache.iterdir()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    again = KernelBinaries(str(cache), nvrtc)
    assert again.cubin("sm_90") == cubin and again.compiled == 0  # read, not compiled
    other = KernelBinaries(str(cache), nvrtc)
    other.cubin("sm_80")
    assert other.compiled == 1 and len(list(cache.iterdir())) == 2
    changed = KernelBinaries(str(cache), nvrtc, SOURCE + b"\n// another revision\n")
    changed.cubin("sm_90")
    assert changed.compiled == 1, "another source is another binary"
    keys = {cache_key(SOURCE, "sm_90", "nvrtc-13.0", ()), cache_key(SOURCE, "sm_90",
                                                                   "nvrtc-13.1", ()),
            cache_key(SOURCE, "sm_90a", "nvrtc-13.0", ()), cache_key(SOURCE + b" ", "sm_90",
                                                                    "nvrtc-13.0", ())}
    assert len(keys) == 4


@pytest.mark.parametrize("damage", ["truncated", "flipped", "symlink", "open_to_others"])
def test_a_damaged_or_planted_binary_is_compiled_again_never_loaded(
        nvrtc: Nvrtc, tmp_path: FsPath, damage: str) -> None:
    cache = tmp_path / "kernels"
    good = KernelBinaries(str(cache), nvrtc).cubin("sm_90")
    (path,) = cache.iterdir()
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "flipped":
        raw = bytearray(path.read_bytes())
        raw[200] ^= 0xFF
        path.write_bytes(bytes(raw))
    elif damage == "symlink":
        planted = tmp_path / "planted.cubin"
        planted.write_bytes(b"\x7fELF" + b"\0" * 64)
        path.unlink()
        path.symlink_to(planted)
    else:
        path.chmod(0o666)
    again = KernelBinaries(str(cache), nvrtc)
    assert again.cubin("sm_90") == good and again.compiled == 1


# -- the launch table -------------------------------------------------------------------------

def _plan(rng: np.random.Generator, dst: np.ndarray, src: np.ndarray, pages: int,
          layers: int, unit_bytes: int, units: int, dst_stride: int, src_stride: int,
          page_slots: int) -> tuple[CopyPlan, int, int]:
    """A plan over two arenas (int64 layer bases into them); returns it and the bytes each
    side's layer spans."""
    dst_pitch = units * dst_stride
    src_pitch = units * src_stride
    span_d = page_slots * dst_pitch
    span_s = page_slots * src_pitch
    d_pages = rng.choice(page_slots, pages, replace=False).astype(np.int64)
    s_pages = rng.choice(page_slots, pages, replace=True).astype(np.int64)
    plan = CopyPlan(dst_base=dst.ctypes.data + np.arange(layers, dtype=np.int64) * span_d,
                    src_base=src.ctypes.data + np.arange(layers, dtype=np.int64) * span_s,
                    dst_pages=d_pages, src_pages=s_pages, unit_bytes=unit_bytes, units=units,
                    dst_pitch=dst_pitch, src_pitch=src_pitch, dst_stride=dst_stride,
                    src_stride=src_stride)
    return plan, span_d, span_s


def _model(plan: CopyPlan, dst: np.ndarray, src: np.ndarray, d0: int, s0: int, lo: int,
           hi: int) -> None:
    """The bytes ``plan`` moves at layers [lo, hi), copied one row at a time, into ``dst``
    (standing for the arena at ``d0``) from ``src`` (the arena at ``s0``)."""
    for layer in range(lo, min(hi, plan.dst_base.size)):
        for dp, sp in zip(plan.dst_pages.tolist(), plan.src_pages.tolist(), strict=True):
            for u in range(plan.units):
                d = int(plan.dst_base[layer]) - d0 + dp * plan.dst_pitch + u * plan.dst_stride
                s = int(plan.src_base[layer]) - s0 + sp * plan.src_pitch + u * plan.src_stride
                dst[d:d + plan.unit_bytes] = src[s:s + plan.unit_bytes]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), pages=st.integers(1, 9), plans=st.integers(1, 3),
       layers=st.integers(1, 4), units=st.integers(1, 5),
       unit=st.sampled_from([1, 3, 16, 48, 64, 256]), pad=st.sampled_from([0, 16, 5]),
       window=st.integers(0, 3))
def test_a_launch_moves_what_its_plans_say_byte_for_byte(
        driver: CudaDriver, fake: FakeCuda, binaries: KernelBinaries, seed: int, pages: int,
        plans: int, layers: int, units: int, unit: int, pad: int, window: int) -> None:
    """Random plans (1..3 components, fewer layers for some, strided or packed rows, aligned
    or not, repeated source pages) through one table and the kernel on the fake (device to
    device: both arenas in device memory), against a row-by-row byte model, over a window of
    layers; bytes outside the plans stay as they were."""
    rng = np.random.default_rng(seed)
    kernel, why = load_page_kernel(driver, 0, binaries)
    assert kernel is not None, why
    with driver.context(0):
        size = 1 << 18
        dst_dev, src_dev = driver.mem_alloc(size), driver.mem_alloc(size)
        dst = np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(dst_dev))
        src = np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(src_dev))
        stream = driver.stream_create()
        ring = TableRing(driver, 2, 1 << 14)
        try:
            src[:] = rng.integers(0, 256, size, dtype=np.uint8)
            dst[:] = rng.integers(0, 256, size, dtype=np.uint8)
            made, used_d, used_s = [], 0, 0
            for p in range(plans):
                n_layers = max(1, layers - p)  # later components may have fewer layers
                stride = unit + pad
                plan, span_d, span_s = _plan(rng, dst[used_d:], src[used_s:], pages, n_layers,
                                             unit, units, stride, stride if p % 2 else unit,
                                             page_slots=pages + 2)
                used_d += span_d * n_layers + 64
                used_s += span_s * n_layers + 64
                assert used_d < size and used_s < size
                made.append(plan)
            table = build_table(made)
            lo = min(window, layers - 1)
            hi = layers
            want = dst.copy()
            for plan in made:
                _model(plan, want, src, dst_dev, src_dev, lo, hi)
            before = fake.stat("kernel_faults")
            slot, address = ring.put(table)
            kernel.launch(stream, address, lo, hi, fragments(table, lo, hi))
            ring.done(slot, stream)
            driver.stream_synchronize(stream)
            got = dst.copy()  # (a failure's report reads no device memory once freed)
            faults = fake.stat("kernel_faults") - before
            del dst, src
        finally:
            driver.stream_synchronize(stream)
            ring.close()
            driver.stream_destroy(stream)
            driver.mem_free(dst_dev)
            driver.mem_free(src_dev)
    assert faults == 0
    wrong = np.flatnonzero(got != want)
    assert wrong.size == 0, f"{wrong.size} bytes differ, first at {wrong[:8].tolist()}"


def test_a_table_stores_equal_page_lists_once_and_refuses_uneven_plans() -> None:
    pages = np.arange(4, dtype=np.int64)
    base = np.zeros(3, dtype=np.int64)
    plan = CopyPlan(base, base + 1, pages, pages.copy(), 16, 2, 32, 32, 16, 16)
    table = build_table([plan, plan])
    assert table.size == 4 + 2 * PLAN_WORDS + 3 + 3 + 4  # bases twice, pages once
    assert fragments(table, 0, 3) == 3 * 2 * 4 and fragments(table, 2, 1) == 0
    short = CopyPlan(base, base, pages[:2], pages[:2], 16, 2, 32, 32, 16, 16)
    with pytest.raises(ValueError, match="same number of pages"):
        build_table([plan, short])


def test_a_table_slot_is_not_handed_to_another_call_until_its_launches_are_recorded(
        driver: CudaDriver) -> None:
    """Two calls of one session share a stream's ring (a retry beside the call it gave up
    on): the one that finds every slot taken waits until the other's ``done``, and gets the
    slot then, its table written over the old one only after that; a failed record frees the
    slot too."""
    import threading

    with driver.context(0):
        stream = driver.stream_create()
        ring = TableRing(driver, 1, 1 << 12)
        try:
            first = np.arange(8, dtype=np.int64)
            slot, address = ring.put(first)
            got: list[tuple[int, int]] = []
            second = threading.Thread(target=lambda: got.append(
                ring.put(np.full(8, 7, dtype=np.int64))))
            second.start()
            second.join(0.3)
            assert second.is_alive() and not got, "the slot was handed out while taken"
            seen = np.ctypeslib.as_array((ctypes.c_int64 * 8).from_address(address))
            assert seen.tolist() == first.tolist(), "the taken slot's table was overwritten"
            ring.done(slot, stream)
            second.join(5)
            assert got == [(slot, address)] and seen.tolist() == [7] * 8
            real = driver.event_record

            def refused(event: int, s: int) -> None:
                raise RuntimeError("the stream's launches failed")

            driver.event_record = refused  # type: ignore[method-assign,assignment]
            try:
                with pytest.raises(RuntimeError):
                    ring.done(slot, stream)
            finally:
                driver.event_record = real  # type: ignore[method-assign]
            again: list[tuple[int, int]] = []
            third = threading.Thread(target=lambda: again.append(ring.put(first)))
            third.start()
            third.join(5)
            assert again == [(slot, address)], "a failed record kept the slot taken"
            ring.done(slot, stream)
            real_sync = driver.event_synchronize

            def lost(event: int) -> None:
                raise RuntimeError("the device fell off the bus")

            driver.event_synchronize = lost  # type: ignore[method-assign,assignment]
            try:
                with pytest.raises(RuntimeError):
                    ring.put(first)  # waits for the slot's event: fails, not handed out
            finally:
                driver.event_synchronize = real_sync  # type: ignore[method-assign]
            last: list[tuple[int, int]] = []
            fourth = threading.Thread(target=lambda: last.append(ring.put(first)))
            fourth.start()
            fourth.join(5)
            assert last == [(slot, address)], "a failed put kept the slot taken"
            ring.done(slot, stream)
            driver.stream_synchronize(stream)
        finally:
            ring.close()
            driver.stream_destroy(stream)


def test_a_kernel_fragment_outside_mapped_memory_is_a_fault_not_a_write(
        driver: CudaDriver, fake: FakeCuda, binaries: KernelBinaries) -> None:
    """The fake's check is real: host memory that is not registered (mapped) is refused."""
    kernel, _ = load_page_kernel(driver, 0, binaries)
    assert kernel is not None
    unmapped = np.zeros(4096, dtype=np.uint8)
    with driver.context(0):
        src_dev = driver.mem_alloc(4096)
        stream = driver.stream_create()
        ring = TableRing(driver, 1, 1 << 12)
        try:
            one = np.array([0], dtype=np.int64)
            plan = CopyPlan(np.array([unmapped.ctypes.data]), np.array([src_dev]), one, one,
                            64, 1, 64, 64, 64, 64)
            table = build_table([plan])
            before = fake.stat("kernel_faults")
            slot, address = ring.put(table)
            kernel.launch(stream, address, 0, 1, 1)
            ring.done(slot, stream)
            driver.stream_synchronize(stream)
            assert fake.stat("kernel_faults") == before + 1 and not unmapped.any()
        finally:
            ring.close()
            driver.stream_destroy(stream)
            driver.mem_free(src_dev)


# -- every way, every layout, dtype, kind and page size -----------------------------------------

KIND_DTYPES = [(PoolKind.MHA, DType.BFLOAT16), (PoolKind.MHA, DType.FLOAT8_E4M3),
               (PoolKind.MHA, DType.FLOAT32), (PoolKind.MLA, DType.BFLOAT16),
               (PoolKind.MLA, DType.FLOAT16), (PoolKind.DSA_INDEXER, DType.UINT8)]


@pytest.fixture(params=WAYS, ids=lambda w: w.value)
def way_transport(request: pytest.FixtureRequest, driver: CudaDriver,
                  binaries: KernelBinaries) -> Iterator[tuple[Path, CudaIpcTransport]]:
    t = transport_for(driver, request.param, binaries)
    yield request.param, t
    t.close()


@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.value)
@pytest.mark.parametrize("kind,dtype", KIND_DTYPES, ids=lambda x: x.value)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_every_way_round_trips_exact_into_zeroed_rows(
        driver: CudaDriver, fake: FakeCuda, way_transport: tuple[Path, CudaIpcTransport],
        layout: Layout, kind: PoolKind, dtype: DType, page_size: int) -> None:
    way, transport = way_transport
    s = spec(geometry_for(kind, dtype), page_size=page_size, layout=layout,
             size_tokens=16 * page_size)
    pool = HostPool(s, SMALL, pinner=DriverPinner(driver))
    src, dst, a, b = attached_pair(driver, transport, s, 12 * page_size, (1, 2))
    try:
        assert a.buffers is not None and b.buffers is not None
        host = pool.alloc(6 * page_size)
        dev_pages = np.array([9, 0, 3, 4, 5, 11])
        before = counts(fake)
        ENGINE.backup(pool, a.buffers, host, page_indices(dev_pages, page_size),
                      runner=a.runner)
        back = np.array([1, 2, 3, 7, 6, 10])
        for v in dst.all_views():
            v.zero_()
        ENGINE.load(pool, b.buffers, host, page_indices(back, page_size), runner=b.runner)
        assert_way(way, took(fake, before))
        for x, y in zip(rows(src, s, dev_pages), rows(dst, s, back), strict=True):
            assert torch.equal(x, y)
        for x in rows(dst, s, np.array([0, 4, 5, 8, 9, 11])):
            assert not x.any(), "a row no page names stays zero"
    finally:
        release_pair(driver, src, dst, a, b)
        pool.close()


@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.value)
def test_every_way_crosses_a_pool_locked_in_chunks(
        driver: CudaDriver, fake: FakeCuda, way_transport: tuple[Path, CudaIpcTransport],
        layout: Layout, monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations of 3 OS pages: the DMA ways cut each copy at the seams (the driver
    refuses one across two), the kernel needs no cut; every page round-trips exact."""
    way, transport = way_transport
    monkeypatch.setattr("hicached.core.memory.PIN_CHUNK", 3 * 4096)
    s = spec(KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 2, 128), page_size=4, layout=layout,
             size_tokens=4 * 40)
    pool = HostPool(s, SMALL, pinner=DriverPinner(driver))
    src, dst, a, b = attached_pair(driver, transport, s, 4 * 40, (5, 6))
    try:
        assert pool.registrations.seams.size > 1
        assert a.buffers is not None and b.buffers is not None
        host = pool.alloc(36 * 4)
        pages = np.arange(36)
        before = counts(fake)
        ENGINE.backup(pool, a.buffers, host, page_indices(pages, 4), runner=a.runner)
        for v in dst.all_views():
            v.zero_()
        ENGINE.load(pool, b.buffers, host, page_indices(pages, 4), runner=b.runner)
        assert_way(way, took(fake, before))
        for x, y in zip(rows(src, s, pages), rows(dst, s, pages), strict=True):
            assert torch.equal(x, y)
    finally:
        release_pair(driver, src, dst, a, b)
        pool.close()


@pytest.mark.parametrize("groups", [5, 2])
def test_a_kernel_load_records_each_layer_event_after_its_layers(
        driver: CudaDriver, fake: FakeCuda, binaries: KernelBinaries, groups: int) -> None:
    """One launch per layer group, each group's event recorded after it; the bytes of every
    layer land by the time its group's event has run."""
    transport = transport_for(driver, Path.KERNEL, binaries)
    s = spec(KVGeometry(PoolKind.MHA, DType.BFLOAT16, 5, 2, 8), page_size=4, size_tokens=64)
    pool = HostPool(s, SMALL, pinner=DriverPinner(driver))
    kv = make_gpu_kv(driver, s, 32)
    with driver.context(0):
        events = [driver.event_create(interprocess=True) for _ in range(groups)]
        handles = [driver.ipc_get_event_handle(e) for e in events]
    att = transport.attach(kv.descriptors.descriptors, layer_events=handles)
    try:
        assert att.buffers is not None and isinstance(att.runner, CudaRunner)
        host = pool.alloc(16)
        pages = np.array([0, 1, 2, 3])
        ENGINE.backup(pool, att.buffers, host, page_indices(pages, 4), runner=att.runner)
        saved = rows(kv, s, pages)
        for v in kv.all_views():
            v.zero_()
        launches, seq = fake.stat("launches"), fake.stat("seq")
        ENGINE.load(pool, att.buffers, host, page_indices(pages, 4), runner=att.runner)
        assert fake.stat("launches") - launches == groups
        seqs = [fake.event_seq(e) for e in att.runner.layer_events]
        # the stream ran (the timing event,) launch, record, launch, record ...: each group's
        # record right after its launch
        start = seq + 1  # the kernel's batches are timed: a record before the first launch
        assert seqs == [start + 2 * (g + 1) for g in range(groups)], (seq, seqs)
        for x, y in zip(saved, rows(kv, s, pages), strict=True):
            assert torch.equal(x, y)
    finally:
        att.release()
        with driver.context(0):
            for e in events:
                driver.event_destroy(e)
        free_gpu_kv(driver, kv)
        pool.close()
        transport.close()


ELASTIC = MemoryOptions(hugepages=False, prefault_threads=1, reserve_bytes=0,
                        pin_unit_bytes=4096)


def test_the_kernel_reaches_only_locked_memory_of_an_elastic_pool(
        driver: CudaDriver, fake: FakeCuda, binaries: KernelBinaries) -> None:
    """A pool locked in units that follow its share: the pages a batch names are locked (and
    mapped) before they are handed out, so the kernel never touches the rest."""
    transport = transport_for(driver, Path.KERNEL, binaries)
    s = spec(KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 8, 128), page_size=16,
             size_tokens=16 * 48)
    pool = HostPool(s, ELASTIC, pinner=DriverPinner(driver), resident_pages=8)
    src, dst, a, b = attached_pair(driver, transport, s, 16 * 16, (3, 4))
    try:
        assert pool.pinned_bytes < pool.nbytes
        assert pool.reserve_pages(8, 12)
        pool.allocator.set_limit(12)
        assert a.buffers is not None and b.buffers is not None
        host = pool.alloc(12 * 16)
        pages = np.arange(12)
        before = counts(fake)
        ENGINE.backup(pool, a.buffers, host, page_indices(pages, 16), runner=a.runner)
        for v in dst.all_views():
            v.zero_()
        ENGINE.load(pool, b.buffers, host, page_indices(pages, 16), runner=b.runner)
        assert_way(Path.KERNEL, took(fake, before))
        for x, y in zip(rows(src, s, pages), rows(dst, s, pages), strict=True):
            assert torch.equal(x, y)
    finally:
        release_pair(driver, src, dst, a, b)
        pool.close()
        transport.close()


# -- what a device lacks, and the choice ------------------------------------------------------

def test_a_device_that_cannot_map_host_memory_at_its_address_keeps_the_kernel_off(
        driver: CudaDriver, fake: FakeCuda, binaries: KernelBinaries,
        caplog: pytest.LogCaptureFixture) -> None:
    fake.set_attribute(DEV_ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, 0)
    try:
        kernel, why = load_page_kernel(driver, 0, binaries)
        assert kernel is None and "other addresses" in why
        t = transport_for(driver, Path.KERNEL, binaries)
        with caplog.at_level(logging.WARNING):
            copies = t.copies(0)
            assert t.copies(0) is copies  # made once per device: said once
        assert copies.usable == (Path.DMA, Path.BATCH)[:1 + copies.batch]
        assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
        assert "page kernel is off on device 0" in caplog.records[0].message
        t.close()
    finally:
        fake.set_attribute(DEV_ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, 1)


def test_without_nvrtc_the_kernel_is_off_and_says_why(driver: CudaDriver,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    t = CudaIpcTransport(driver, (Path.DMA, Path.KERNEL), None, "no NVRTC library (pip install "
                         "'hicached[cuda]')")
    with caplog.at_level(logging.WARNING):
        copies = t.copies(0)
    assert copies.kernel is None and Path.KERNEL not in copies.usable
    assert any("no NVRTC library" in r.message for r in caplog.records)
    t.close()


def test_the_choice_warms_up_takes_the_fastest_and_explores() -> None:
    paths = CopyPaths((Path.DMA, Path.BATCH, Path.KERNEL))
    usable = (Path.DMA, Path.BATCH, Path.KERNEL)
    frag = 2048
    seen = []
    for _ in range(3 * WARMUP):  # each way until measured WARMUP times
        way = paths.choose(False, frag, usable)
        seen.append(way)
        rate = {Path.DMA: 1e9, Path.BATCH: 5e9, Path.KERNEL: 20e9}[way]
        paths.record(way, False, frag, 1 << 20, (1 << 20) / rate)
    assert seen == [Path.DMA] * WARMUP + [Path.BATCH] * WARMUP + [Path.KERNEL] * WARMUP
    picks = [paths.choose(False, frag, usable) for _ in range(2 * EXPLORE)]
    assert picks.count(Path.BATCH) == 2 and picks.count(Path.KERNEL) == 2 * EXPLORE - 2
    # another size class, and the other direction, learn apart
    assert paths.choose(True, frag, usable) is Path.DMA
    assert paths.choose(False, 128 << 10, usable) is Path.DMA
    # a way this device lacks is never chosen; none allowed and usable: dma
    assert paths.choose(False, frag, (Path.DMA, Path.BATCH)) is Path.BATCH
    assert CopyPaths((Path.KERNEL,)).choose(False, frag, (Path.DMA,)) is Path.DMA
    assert size_class(2048) == size_class(4095) == 11 and size_class(4096) == 12


def test_a_rate_that_drops_moves_the_choice() -> None:
    paths = CopyPaths((Path.DMA, Path.KERNEL))
    usable = (Path.DMA, Path.KERNEL)
    for way, rate in [(Path.DMA, 1e9)] * WARMUP + [(Path.KERNEL, 4e9)] * WARMUP:
        assert paths.choose(False, 64, usable) is way
        paths.record(way, False, 64, 1000, 1000 / rate)
    assert paths.choose(False, 64, usable) is Path.KERNEL
    for _ in range(20):  # the kernel slows down (another tenant's kernels share the SMs)
        paths.record(Path.KERNEL, False, 64, 1000, 1000 / 0.2e9)
    assert paths.choose(False, 64, usable) is Path.DMA


def test_a_batch_whose_timing_fails_still_completes_and_its_bytes_land(
        driver: CudaDriver, binaries: KernelBinaries) -> None:
    """Reading a batch's two events fails (any error, not only the driver's): the failure
    is logged, the batch is not measured, and the copies complete with their bytes in
    place (into rows zeroed first)."""
    s = spec(geometry_for(PoolKind.MHA, DType.BFLOAT16), page_size=4, size_tokens=64)
    t = CudaIpcTransport(driver, (Path.DMA, Path.KERNEL), binaries)
    pool = HostPool(s, SMALL, pinner=DriverPinner(driver))
    src, dst, a, b = attached_pair(driver, t, s, 48, (1, 2))
    real = driver.event_elapsed_ms

    def broken(start: int, end: int) -> float:
        raise OverflowError("a clock that went backwards")

    driver.event_elapsed_ms = broken  # type: ignore[method-assign]
    try:
        assert a.buffers is not None and b.buffers is not None
        host = pool.alloc(16)
        pages = np.array([5, 1, 8, 3])
        ENGINE.backup(pool, a.buffers, host, page_indices(pages, 4), runner=a.runner)
        for v in dst.all_views():
            v.zero_()
        ENGINE.load(pool, b.buffers, host, page_indices(pages, 4), runner=b.runner)
        for x, y in zip(rows(src, s, pages), rows(dst, s, pages), strict=True):
            assert torch.equal(x, y)
        assert t.copies(0).paths.rates() == {}, "a failed timing was recorded"
    finally:
        driver.event_elapsed_ms = real  # type: ignore[method-assign]
        release_pair(driver, src, dst, a, b)
        pool.close()
        t.close()


def test_batches_are_timed_on_the_device_where_ways_compete(
        driver: CudaDriver, fake: FakeCuda, binaries: KernelBinaries) -> None:
    """With several ways allowed each batch is measured between two events and the rates
    feed the choice; the kernel alone is measured too (its SM time is a metric); dma alone
    spends no event."""
    s = spec(geometry_for(PoolKind.MHA, DType.BFLOAT16), page_size=4, size_tokens=64)
    for allowed, timed in (((Path.DMA, Path.BATCH, Path.KERNEL), True), ((Path.DMA,), False),
                           ((Path.KERNEL,), True)):
        t = CudaIpcTransport(driver, allowed, binaries)
        pool = HostPool(s, SMALL, pinner=DriverPinner(driver))
        kv = make_gpu_kv(driver, s, 48)
        att = t.attach(kv.descriptors.descriptors)
        try:
            assert att.buffers is not None
            host = pool.alloc(16)
            ways = []
            for _ in range(3 * WARMUP):
                before = counts(fake)
                ENGINE.backup(pool, att.buffers, host, page_indices(np.array([5, 1, 8, 3]), 4),
                              runner=att.runner)
                diff = took(fake, before)
                ways.append(Path.KERNEL if diff["launches"] else Path.BATCH if diff["batches"]
                            else Path.DMA)
            rates = t.copies(0).paths.rates()
            counts_by_way, _ = t.copy_stats()
            assert {w: n for (loading, w), (n, _) in counts_by_way.items()
                    if not loading} == {w: ways.count(w) for w in set(ways)}
            assert all(b == n * 4 * s.page_bytes for (_, _), (n, b) in counts_by_way.items())
            if timed:
                assert set(ways) == set(allowed)
                assert {w for (_, _, w) in rates} == set(allowed)
            else:
                assert set(ways) == {Path.DMA} and rates == {}
        finally:
            att.release()
            free_gpu_kv(driver, kv)
            pool.close()
            t.close()
