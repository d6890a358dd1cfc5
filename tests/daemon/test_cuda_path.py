"""The CUDA path on the fake driver: export, attach, copy segmentation, events, lifecycle.

The fake driver (tests/fakecuda) implements the driver calls hicached makes with real memory:
device allocations are memfd mappings, IPC handles open them again, copies really move bytes
and check that the device side stays inside its allocation. What it cannot show (DMA speed,
real IPC semantics across processes, stream concurrency) is covered by the ``cuda`` tests.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.cuda_driver import CudaDriver, driver_problem, format_uuid, load_driver, normalize_uuid
from hicache.errors import BufferNotShareable, DeviceNotFound, IpcHandleInvalid, SpecInvalid
from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec, Role
from hicache_client.cuda import CudaDeviceBuffers, export_region
from hicached.cache.pool_cache import PoolCache
from hicached.copy.engine import Op, TransferEngine
from hicached.core.pool import HostPool, MemoryOptions
from hicached.core.registrations import Registrations
from hicached.cuda import segments
from hicached.cuda.pinner import DriverPinner
from hicached.cuda.runner import CudaRunner
from hicached.cuda.segments import plan_segments
from hicached.transport.cuda_ipc import CudaAttachment, CudaIpcTransport
from tests.cuda_fixtures import (
    attached_pair,
    free_gpu_kv,
    make_gpu_kv,
    page_indices,
    release_pair,
    rows,
)
from tests.fakecuda import UUID_A, UUID_B, FakeCuda
from tests.fakecuda import format_uuid as fmt
from tests.helpers import SMALL, geometry_for, native_kernel, spec

ENGINE = TransferEngine(threads=2)
pytestmark = pytest.mark.usefixtures("counters_settle", "deferred")


@pytest.fixture
def transport(driver: CudaDriver) -> Iterator[CudaIpcTransport]:
    t = CudaIpcTransport(driver)
    yield t
    t.close()


@pytest.fixture(params=["native", "python"])
def submitter(request: pytest.FixtureRequest) -> Iterator[str]:
    """Submit copies through the native batch call and through the ctypes loop."""
    with native_kernel(request.param == "native"):
        yield request.param


def pinned_pool(driver: CudaDriver, s: PoolSpec) -> HostPool:
    return HostPool(s, SMALL, pinner=DriverPinner(driver))


# -- driver -----------------------------------------------------------------------------------

def test_driver_enumerates_devices_by_uuid(driver: CudaDriver) -> None:
    assert [d.uuid for d in driver.devices] == [fmt(UUID_A), fmt(UUID_B)]
    assert driver.ordinal_of(fmt(UUID_B)) == 1
    assert driver.ordinal_of(fmt(UUID_B)[4:].upper()) == 1  # torch prints it bare
    assert driver.ordinal_of("GPU-00000000-0000-0000-0000-000000000000") is None
    assert normalize_uuid("ABC") == "GPU-abc"
    assert format_uuid(bytes(range(16))) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


def test_missing_driver_is_reported_not_raised(tmp_path: object) -> None:
    assert load_driver("/nonexistent/libcuda.so.1") is None
    assert "cannot load /nonexistent/libcuda.so.1" in driver_problem("/nonexistent/libcuda.so.1")


def test_driver_errors_carry_the_cuda_error_name(driver: CudaDriver) -> None:
    with driver.context(0), pytest.raises(Exception) as info:
        driver.ipc_open_mem_handle(b"\x00" * 64)
    assert "CUDA_ERROR_INVALID_VALUE" in str(info.value)


# -- worker-side export -----------------------------------------------------------------------

def test_export_gives_allocation_handle_offset_and_uuid(driver: CudaDriver) -> None:
    with driver.context(1):
        base = driver.mem_alloc(1 << 16)
    try:
        r = export_region(driver, base + 4096, 1024)
        assert len(r.handle) == 64 and r.offset == 4096 and r.device_uuid == fmt(UUID_B)
        assert export_region(driver, base, 1 << 16).handle == r.handle
        with pytest.raises(BufferNotShareable, match="run past the end"):
            export_region(driver, base + 4096, 1 << 16)
    finally:
        with driver.context(1):
            driver.mem_free(base)


@pytest.mark.parametrize("kind", ["vmm", "managed", "host"])
def test_unshareable_memory_is_refused_with_its_cause(driver: CudaDriver, fake: FakeCuda,
                                                      kind: str) -> None:
    host = torch.zeros(64, dtype=torch.uint8)
    with driver.context(0):
        address = {"vmm": fake.alloc_vmm, "managed": fake.alloc_managed,
                   "host": lambda n: host.data_ptr()}[kind](1 << 16)
    why = {"vmm": "expandable_segments", "managed": "managed", "host": "not CUDA device memory"}
    with pytest.raises(BufferNotShareable, match=why[kind]) as info:
        export_region(driver, address, 64)
    assert info.value.reason == "BUFFER_NOT_SHAREABLE"
    assert "PYTORCH_CUDA_ALLOC_CONF" in str(info.value)
    if kind == "vmm":
        fake.free_vmm(address)
    elif kind != "host":
        with driver.context(0):
            driver.mem_free(address)


def test_cpu_tensors_are_refused(driver: CudaDriver) -> None:
    with pytest.raises(BufferNotShareable, match="on cpu"):
        CudaDeviceBuffers.from_tensors({"kv": {Role.K: [torch.zeros(4)]}}, driver)


# -- daemon-side attach -----------------------------------------------------------------------

def test_attach_opens_each_allocation_once_and_release_closes_it(
        driver: CudaDriver, fake: FakeCuda, transport: CudaIpcTransport) -> None:
    s = spec(geometry_for(PoolKind.MHA, DType.BFLOAT16), page_size=4, size_tokens=64)
    kv = make_gpu_kv(driver, s, 32)
    before = fake.stat("open_handles")
    a = transport.attach(kv.descriptors.descriptors)
    b = transport.attach(kv.descriptors.descriptors)  # a second session on the same buffers
    try:
        assert fake.stat("open_handles") == before + 2  # K and V allocations, once each
        assert transport.cache.stats()[0] == 2
        assert a.buffers is not None and a.buffers.location == "cuda"
        assert a.buffers.check_against(s) == 32 + 4  # SGLang's padding page included
        k0 = a.buffers.buffers["kv"][Role.K][0]
        assert (k0.device.type, k0.device.index) == ("cuda", 0)
        a.release()
        a.release()  # idempotent
        assert fake.stat("open_handles") == before + 2  # b still uses them
    finally:
        a.release()
        b.release()
        free_gpu_kv(driver, kv)
    assert fake.stat("open_handles") == before


def test_attach_resolves_the_uuid_to_this_process_ordinal(
        driver: CudaDriver, transport: CudaIpcTransport) -> None:
    s = spec(geometry_for(PoolKind.MLA, DType.FLOAT16), page_size=2, size_tokens=16)
    kv = make_gpu_kv(driver, s, 8, ordinal=1)  # the fake refuses to open it on device 0
    try:
        att = transport.attach(kv.descriptors.descriptors)
        assert isinstance(att.runner, CudaRunner) and att.runner.ordinal == 1
        att.release()
    finally:
        free_gpu_kv(driver, kv, ordinal=1)


def test_unknown_gpu_is_device_not_found_listing_visible_ones(
        driver: CudaDriver, transport: CudaIpcTransport) -> None:
    s = spec(geometry_for(PoolKind.MHA, DType.BFLOAT16), page_size=4, size_tokens=64)
    kv = make_gpu_kv(driver, s, 16)
    try:
        bad = [b.__class__(**{**b.__dict__, "device_uuid": "GPU-deadbeef"})
               for b in kv.descriptors.descriptors]
        with pytest.raises(DeviceNotFound) as info:
            transport.attach(bad)
        assert info.value.metadata["device_uuid"] == "GPU-deadbeef"
        assert fmt(UUID_A) in info.value.metadata["visible"]
        mixed = [*kv.descriptors.descriptors[:1],
                 *(b.__class__(**{**b.__dict__, "device_uuid": fmt(UUID_B)})
                   for b in kv.descriptors.descriptors[1:])]
        with pytest.raises(SpecInvalid, match="one GPU"):
            transport.attach(mixed)
    finally:
        free_gpu_kv(driver, kv)


@pytest.mark.parametrize("damage", ["garbage", "short", "past_end", "event"])
def test_bad_handles_are_refused_and_nothing_stays_open(
        driver: CudaDriver, fake: FakeCuda, transport: CudaIpcTransport, damage: str) -> None:
    s = spec(geometry_for(PoolKind.MHA, DType.BFLOAT16), page_size=4, size_tokens=64)
    kv = make_gpu_kv(driver, s, 16)
    descs = list(kv.descriptors.descriptors)
    last = descs[-1]
    events: list[bytes] = []
    if damage == "garbage":
        descs[-1] = last.__class__(**{**last.__dict__, "ipc_handle": b"\x07" * 64})
    elif damage == "short":
        descs[-1] = last.__class__(**{**last.__dict__, "ipc_handle": last.ipc_handle[:10]})
    elif damage == "past_end":
        descs[-1] = last.__class__(**{**last.__dict__, "offset": last.offset + (1 << 20)})
    else:
        events = [b"\x01" * 64]
    before = fake.stat("open_handles"), fake.stat("streams"), fake.stat("events")
    try:
        with pytest.raises(IpcHandleInvalid) as info:
            transport.attach(descs, layer_events=events)
        assert info.value.reason == "IPC_HANDLE_INVALID"
        assert (fake.stat("open_handles"), fake.stat("streams"), fake.stat("events")) == before
    finally:
        free_gpu_kv(driver, kv)


# -- copies -----------------------------------------------------------------------------------

KIND_DTYPES = [(PoolKind.MHA, DType.BFLOAT16), (PoolKind.MHA, DType.FLOAT8_E4M3),
               (PoolKind.MHA, DType.FLOAT32), (PoolKind.MLA, DType.BFLOAT16),
               (PoolKind.MLA, DType.FLOAT16), (PoolKind.DSA_INDEXER, DType.UINT8)]


@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.value)
@pytest.mark.parametrize("kind,dtype", KIND_DTYPES, ids=lambda x: x.value)
@pytest.mark.parametrize("page_size", [1, 4])
def test_round_trip_through_ipc_is_exact(driver: CudaDriver, fake: FakeCuda,
                                         transport: CudaIpcTransport, layout: Layout,
                                         kind: PoolKind, dtype: DType, page_size: int,
                                         submitter: str) -> None:
    s = spec(geometry_for(kind, dtype), page_size=page_size, layout=layout,
             size_tokens=16 * page_size)
    pool = pinned_pool(driver, s)
    src, dst, a, b = attached_pair(driver, transport, s, 12 * page_size, (1, 2))
    try:
        assert pool.pinned_bytes == pool.nbytes and fake.stat("registered_bytes") >= pool.nbytes
        assert a.buffers is not None and b.buffers is not None
        host = pool.alloc(6 * page_size)
        dev_pages = np.array([9, 0, 3, 4, 5, 11])
        r = ENGINE.backup(pool, a.buffers, host, page_indices(dev_pages, page_size),
                          runner=a.runner)
        assert r.pages == 6 and r.bytes == 6 * s.page_bytes and not r.pending
        back_pages = np.array([1, 2, 3, 7, 6, 10])
        untouched = rows(dst, s, np.array([0, 4, 5, 8, 9, 11]))
        ENGINE.load(pool, b.buffers, host, page_indices(back_pages, page_size), runner=b.runner)
        for x, y in zip(rows(src, s, dev_pages), rows(dst, s, back_pages), strict=True):
            assert torch.equal(x, y)
        for x, y in zip(untouched, rows(dst, s, np.array([0, 4, 5, 8, 9, 11])), strict=True):
            assert torch.equal(x, y)
        pool.allocator.memcheck()
    finally:
        release_pair(driver, src, dst, a, b)
        pool.close()
    assert fake.stat("registered_bytes") == 0, "pool closed: host memory unregistered"


def _count_calls(driver: CudaDriver, fake: FakeCuda, transport: CudaIpcTransport,
                 layout: Layout, pages: list[int]) -> tuple[int, int]:
    s = spec(geometry_for(PoolKind.MHA, DType.BFLOAT16), page_size=4, layout=layout,
             size_tokens=64)
    pool = pinned_pool(driver, s)
    kv = make_gpu_kv(driver, s, 48)
    att = transport.attach(kv.descriptors.descriptors)
    try:
        assert att.buffers is not None
        host = pool.alloc(len(pages) * 4)
        before = fake.stat("calls")
        ENGINE.backup(pool, att.buffers, host, page_indices(pages, 4), runner=att.runner)
        return fake.stat("calls") - before, s.geometry.layer_num * 2
    finally:
        att.release()
        free_gpu_kv(driver, kv)
        pool.close()


def test_consecutive_pages_coalesce_into_one_copy_per_layer(
        driver: CudaDriver, fake: FakeCuda, transport: CudaIpcTransport) -> None:
    calls, layer_buffers = _count_calls(driver, fake, transport, Layout.LAYER_FIRST,
                                        [0, 1, 2, 3])
    assert calls == layer_buffers  # one run of 4 pages per (layer, K/V)


def test_page_first_pages_are_single_2d_copies_not_rows(
        driver: CudaDriver, fake: FakeCuda, transport: CudaIpcTransport) -> None:
    calls, layer_buffers = _count_calls(driver, fake, transport, Layout.PAGE_FIRST,
                                        [5, 1, 9])
    assert calls == 3 * layer_buffers  # a page of one layer: one 2-D copy of 4 strided rows


def test_plan_segments_split_pitches_over_the_2d_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from hicached.copy.plan import CopyPlan

    plan = CopyPlan(np.array([0, 10_000], dtype=np.int64), np.array([0, 50_000], dtype=np.int64),
                    np.array([3, 1]), np.array([2, 7]), unit_bytes=8, units=4, dst_pitch=64,
                    src_pitch=96, dst_stride=16, src_stride=24)
    segs = plan_segments(plan)
    assert segs.count == 4 and set(segs.height.tolist()) == {4} and segs.nbytes == plan.nbytes
    monkeypatch.setattr(segments, "MAX_PITCH", 20)
    rows_only = plan_segments(plan)
    assert rows_only.count == 16 and set(rows_only.height.tolist()) == {1}
    assert rows_only.nbytes == plan.nbytes
    assert sorted(rows_only.dst.tolist()) == sorted(
        (segs.dst[:, None] + np.arange(4) * segs.dpitch[:, None]).ravel().tolist())



def _bytes_moved(segs: segments.Segments, host_is_dst: bool) -> list[list[tuple[int, int]]]:
    """Each layer's (host byte, device byte) pairs in the order the copies move them."""
    out: list[list[tuple[int, int]]] = []
    for i in range(segs.layers):
        seg = segs.layer(i)
        pairs = []
        for d, s, dp, sp, w, h in zip(*(getattr(seg, f).tolist() for f in segments._FIELDS),
                                      strict=True):
            for r in range(h):
                for b in range(w):
                    dst, src = d + r * dp + b, s + r * sp + b
                    pairs.append((dst, src) if host_is_dst else (src, dst))
        out.append(pairs)
    return out


@st.composite
def _segments_and_cuts(draw: st.DrawFn) -> tuple[segments.Segments, Registrations, bool]:
    n = draw(st.integers(1, 6))
    cols: list[list[int]] = [[] for _ in range(6)]
    for i in range(n):
        w = draw(st.integers(1, 48))
        row = (draw(st.integers(0, 600)), 100_000 + 1_000 * i, w + draw(st.integers(0, 40)),
               w + draw(st.integers(0, 40)), w, draw(st.integers(1, 4)))
        for c, v in zip(cols, row, strict=True):
            c.append(v)
    host_is_dst = draw(st.booleans())
    host, dev, hp, dp, width, height = (np.asarray(c, dtype=np.int64) for c in cols)
    # layer ends, ascending; a layer may be empty (equal ends), the first one too
    ends = np.asarray(sorted([*draw(st.lists(st.integers(0, n), max_size=3)), n]),
                      dtype=np.int64)
    segs = (segments.Segments(host, dev, hp, dp, width, height, ends) if host_is_dst
            else segments.Segments(dev, host, dp, hp, width, height, ends))
    seams = np.asarray(sorted(set(draw(st.lists(st.integers(0, 1100), max_size=8)))),
                       dtype=np.int64)
    return segs, Registrations(seams, 0, 1024), host_is_dst


@settings(max_examples=300, deadline=None)
@given(_segments_and_cuts())
def test_split_at_moves_the_same_bytes_and_no_copy_crosses_a_cut(
        case: tuple[segments.Segments, Registrations, bool]) -> None:
    """The driver refuses a copy whose host side spans two registrations: every copy
    ``split_at`` returns stays between two cuts on its host side, and the copies move the
    same bytes to the same places in the same order, layer by layer."""
    segs, regs, host_is_dst = case
    cuts = regs.seams
    out = segments.split_at(segs, regs, host_is_dst)
    assert out.layers == segs.layers and out.nbytes == segs.nbytes
    assert _bytes_moved(out, host_is_dst) == _bytes_moved(segs, host_is_dst)
    host, pitch = (out.dst, out.dpitch) if host_is_dst else (out.src, out.spitch)
    last = host + (out.height - 1) * pitch + out.width - 1
    assert (np.searchsorted(cuts, host, "right") == np.searchsorted(cuts, last, "right")).all()
    assert (out.width > 0).all() and (out.height > 0).all()
    assert ((out.height == 1) | ((out.width <= out.dpitch) & (out.width <= out.spitch))).all()
    if not _crossing(segs, cuts, host_is_dst):
        assert out is segs, "nothing crosses: the same copies, no work"


def _crossing(segs: segments.Segments, cuts: np.ndarray, host_is_dst: bool) -> bool:
    host, pitch = (segs.dst, segs.dpitch) if host_is_dst else (segs.src, segs.spitch)
    last = host + (segs.height - 1) * pitch + segs.width - 1
    return bool((np.searchsorted(cuts, host, "right")
                 != np.searchsorted(cuts, last, "right")).any())


@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.value)
def test_copies_over_a_pool_locked_in_chunks_are_cut_at_each_chunk(
        driver: CudaDriver, fake: FakeCuda, transport: CudaIpcTransport, layout: Layout,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool larger than one registration (1 GiB chunks; 3 OS pages here) is locked in
    several, and the driver refuses a copy over two: runs of pages that cross a chunk are
    cut there, and every page round-trips exact into zeroed device rows."""
    monkeypatch.setattr("hicached.core.memory.PIN_CHUNK", 3 * 4096)
    s = spec(KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 2, 128), page_size=4, layout=layout,
             size_tokens=4 * 40)  # a page of one layer: 2 KiB, so a chunk ends inside pages
    pool = pinned_pool(driver, s)
    src, dst, a, b = attached_pair(driver, transport, s, 4 * 40, (5, 6))
    straddling = fake.stat("straddling_copies")
    try:
        assert pool.registrations.seams.size == pool.nbytes // (3 * 4096) > 1
        assert a.buffers is not None and b.buffers is not None
        host = pool.alloc(36 * 4)
        pages = np.arange(36)  # one run: every copy crosses chunks
        ENGINE.backup(pool, a.buffers, host, page_indices(pages, 4), runner=a.runner)
        for v in dst.all_views():
            v.zero_()
        ENGINE.load(pool, b.buffers, host, page_indices(pages, 4), runner=b.runner)
        for x, y in zip(rows(src, s, pages), rows(dst, s, pages), strict=True):
            assert torch.equal(x, y)
        assert fake.stat("straddling_copies") == straddling
    finally:
        release_pair(driver, src, dst, a, b)
        pool.close()


# -- per-layer events and asynchronous completion -----------------------------------------------

def _event_setup(driver: CudaDriver, n: int) -> tuple[list[int], list[bytes]]:
    with driver.context(0):
        evs = [driver.event_create(interprocess=True) for _ in range(n)]
        return evs, [driver.ipc_get_event_handle(e) for e in evs]


def _event_teardown(driver: CudaDriver, evs: list[int]) -> None:
    with driver.context(0):
        for e in evs:
            driver.event_destroy(e)


@pytest.mark.parametrize("groups", [5, 2])
def test_layer_events_are_recorded_after_their_layers_land(
        driver: CudaDriver, fake: FakeCuda, transport: CudaIpcTransport, groups: int) -> None:
    s = spec(geometry_for(PoolKind.MHA, DType.BFLOAT16).__class__(
        PoolKind.MHA, DType.BFLOAT16, 5, 2, 8), page_size=4, size_tokens=64)
    pool = pinned_pool(driver, s)
    kv = make_gpu_kv(driver, s, 32)
    worker_events, handles = _event_setup(driver, groups)
    att = transport.attach(kv.descriptors.descriptors, layer_events=handles)
    try:
        assert isinstance(att, CudaAttachment) and att.buffers is not None
        runner = att.runner
        assert isinstance(runner, CudaRunner)
        host = pool.alloc(16)
        ENGINE.backup(pool, att.buffers, host, page_indices([0, 1, 2, 3], 4), runner=runner)
        first = fake.stat("copies")
        ENGINE.load(pool, att.buffers, host, page_indices([4, 6, 5, 7], 4), runner=runner)
        copies = fake.copies(first)
        layer_of: dict[int, int] = {}
        for (_m, _r, layer), buf in zip(
                [(m, r, i) for m, roles in att.buffers.buffers.items() for r, ls in roles.items()
                 for i in range(len(ls))],
                [b for roles in att.buffers.buffers.values() for ls in roles.values()
                 for b in ls], strict=True):
            layer_of[buf.data_ptr()] = layer
        size = -(-5 // groups)
        seqs = [fake.event_seq(e) for e in runner.layer_events]
        assert all(x > 0 for x in seqs) and seqs == sorted(seqs)
        for seq, dst, _src, _n in copies:
            base = max(a for a in layer_of if a <= dst)
            g = layer_of[base] // size
            assert seq < seqs[g], "a layer's copies come before its event"
            if g > 0:
                assert seq > seqs[g - 1], "and after the previous group's event"
    finally:
        att.release()
        _event_teardown(driver, worker_events)
        free_gpu_kv(driver, kv)
        pool.close()


def test_async_load_completes_later_and_unpins(driver: CudaDriver, fake: FakeCuda,
                                               transport: CudaIpcTransport) -> None:
    s = spec(geometry_for(PoolKind.MHA, DType.BFLOAT16), page_size=4, size_tokens=64)
    pool = pinned_pool(driver, s)
    kv = make_gpu_kv(driver, s, 32)
    worker_events, handles = _event_setup(driver, 3)
    att = transport.attach(kv.descriptors.descriptors, layer_events=handles)
    done = threading.Event()
    try:
        assert att.buffers is not None
        host = pool.alloc(8)
        pages = np.array([1, 2])
        ENGINE.backup(pool, att.buffers, host, page_indices(pages, 4), runner=att.runner)
        saved = rows(kv, s, pages)
        for v in kv.views.values():
            v.zero_()
        r = ENGINE.load(pool, att.buffers, host, page_indices(pages, 4), runner=att.runner,
                        wait=False, on_complete=done.set)
        assert r.pending
        assert done.wait(10)
        assert fake.stat("queued") == 0
        for x, y in zip(saved, rows(kv, s, pages), strict=True):
            assert torch.equal(x, y), "completion ran before the bytes landed"
        pool.free(host)  # unpinned: the pages can be freed
        pool.allocator.memcheck()
    finally:
        att.release()
        _event_teardown(driver, worker_events)
        free_gpu_kv(driver, kv)
        pool.close()


def test_nothing_touches_cuda_at_import_time() -> None:
    """A CPU-only host imports every module without loading a driver or initialising CUDA."""
    import subprocess
    import sys

    code = ("import hicached.server.app, hicached.transport.cuda_ipc, hicached.cuda.runner\n"
            "import hicache_client.cuda, hicache.cuda_driver as d, torch\n"
            "assert d._drivers == {}, d._drivers\n"
            "assert not torch.cuda.is_initialized()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr


def test_lease_expiry_closes_the_mappings_but_not_under_a_running_copy(
        driver: CudaDriver, fake: FakeCuda, transport: CudaIpcTransport) -> None:
    from hicached.service.sessions import SessionManager

    now = [0.0]
    sessions = SessionManager(2.0, clock=lambda: now[0])
    s = spec(geometry_for(PoolKind.MHA, DType.BFLOAT16), page_size=4, size_tokens=64)
    pool = pinned_pool(driver, s)
    kv = make_gpu_kv(driver, s, 16)
    before = fake.stat("open_handles"), fake.stat("streams")
    try:
        a = transport.attach(kv.descriptors.descriptors)
        b = transport.attach(kv.descriptors.descriptors)
        quiet = sessions.open("p", pool, "quiet", a, 20)
        busy = sessions.open("p", pool, "busy", b, 20)
        sessions.begin_copy(busy)  # a load still running on the GPU after its RPC returned
        assert fake.stat("streams") == before[1] + 4
        now[0] = 10.0
        assert {x.session_id for x in sessions.reap()} == {quiet.session_id, busy.session_id}
        assert a.buffers is None and b.buffers is not None  # busy keeps its mappings
        assert fake.stat("open_handles") == before[0] + 2
        sessions.end_copy(busy)  # the copy landed
        assert b.buffers is None
        assert (fake.stat("open_handles"), fake.stat("streams")) == before
    finally:
        sessions.close_all()
        free_gpu_kv(driver, kv)
        pool.close()


def test_a_pool_that_cannot_be_pinned_is_refused_with_nothing_left_pinned(
        driver: CudaDriver, fake: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache.errors import PinFailed

    monkeypatch.setattr("hicached.core.memory.PIN_CHUNK", 1 << 20)
    s = spec(geometry_for(PoolKind.MHA, DType.BFLOAT16), page_size=4, size_tokens=16384)
    fake.set_pin_limit(1 << 20)  # the pool is 3 MiB
    try:
        with pytest.raises(PinFailed, match="CUDA_ERROR_OUT_OF_MEMORY") as info:
            pinned_pool(driver, s)
    finally:
        fake.set_pin_limit(-1)
    assert info.value.metadata["pinned_before_failure"] == str(1 << 20)
    assert fake.stat("registered_bytes") == 0


# -- a pool whose locked memory follows its share of the budget ------------------------------

ELASTIC = MemoryOptions(hugepages=False, prefault_threads=1, reserve_bytes=0,
                        pin_unit_bytes=4096)


@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.value)
def test_an_elastic_pinned_pool_copies_only_through_locked_memory(
        driver: CudaDriver, fake: FakeCuda, transport: CudaIpcTransport,
        layout: Layout) -> None:
    """The GPU copies of a pool whose share shrinks and grows reach locked memory only (the
    fake refuses any other: strict mode), a Store stopped between taking its page and
    copying into it while the pool shrinks keeps that page's memory locked, and every key
    loads back exact into zeroed device pages."""
    s = spec(KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 8, 128), page_size=16, layout=layout,
             size_tokens=16 * 48)  # a page's bytes of one layer: 8 OS pages, a unit each
    pool = HostPool(s, ELASTIC, pinner=DriverPinner(driver), resident_pages=8)
    cache = PoolCache(pool)
    src, dst, a, b = attached_pair(driver, transport, s, 16 * 64, (3, 4))
    layers = range(s.max_layers)
    unpinned = fake.stat("unpinned_copies")
    fake.set_strict_pinned(True)

    def backup(ticket_pages: np.ndarray, dev: list[int]) -> None:
        assert a.buffers is not None
        ENGINE.transfer_pages(Op.BACKUP, pool, a.buffers, ticket_pages,
                              np.asarray(dev, dtype=np.int64), layers, a.runner)

    def store(keys: list[bytes], dev: list[int]) -> None:
        ticket = cache.begin_store(keys)
        try:
            backup(ticket.pages, dev)
        finally:
            cache.finish_store(ticket, True)

    def load_all_exact(stored: dict[bytes, int]) -> None:
        assert b.buffers is not None
        for v in dst.all_views():
            v.zero_()
        keys = sorted(stored)
        held = cache.begin_load(keys)
        try:
            ENGINE.transfer_pages(Op.LOAD, pool, b.buffers, held,
                                  np.arange(len(keys), dtype=np.int64), layers, b.runner)
        finally:
            cache.finish_load(held)
        for x, y in zip(rows(src, s, np.asarray([stored[k] for k in keys])),
                        rows(dst, s, np.arange(len(keys))), strict=True):
            assert torch.equal(x, y)

    try:
        assert fake.stat("registered_bytes") == pool.pinned_bytes < pool.nbytes
        # the budget grants 40 pages: locked before they are handed out
        assert pool.reserve_pages(8, 40)
        pool.allocator.set_limit(40)
        stored = {b"k%02d" % i: i for i in range(40)}
        store(list(stored), list(range(40)))
        locked = pool.pinned_bytes
        top = max(cache.index.ready.values())
        (top_key,) = [k for k, p in cache.index.ready.items() if p == top]
        cache.remove([top_key])
        del stored[top_key]
        # a Store takes the freed top page, and stops there while the pool shrinks
        ticket = cache.begin_store([b"late"])
        assert ticket.pages.tolist() == [top]
        for k in [k for k, p in cache.index.ready.items() if p < 30][4:]:
            cache.remove([k])
            del stored[k]
        r = cache.sizing.resize(16)
        assert r.limit == top + 1 and pool.pinned_bytes == locked, \
            "the page being written keeps the pool's top, and its memory locked"
        backup(ticket.pages, [40])
        cache.finish_store(ticket, True)
        stored[b"late"] = 40
        r = cache.sizing.resize(16)
        assert r.limit == 16 and r.released_bytes > 0
        assert fake.stat("registered_bytes") == pool.pinned_bytes < locked
        fill = {b"f%02d" % i: 41 + i for i in range(16 - len(stored))}
        store(list(fill), list(fill.values()))  # every page below the share in use
        stored.update(fill)
        assert sorted(cache.index.ready.values()) == list(range(16))
        load_all_exact(stored)
        # and it grows again
        assert pool.reserve_pages(16, 48)
        pool.allocator.set_limit(48)
        more = {b"m%02d" % i: 41 + len(fill) + i for i in range(7)}
        store(list(more), list(more.values()))
        stored.update(more)
        load_all_exact(stored)
        assert fake.stat("unpinned_copies") == unpinned and fake.stat("deferred_errors") == 0
    finally:
        fake.set_strict_pinned(False)
        release_pair(driver, src, dst, a, b)
        pool.close()
    assert fake.stat("registered_bytes") == 0
