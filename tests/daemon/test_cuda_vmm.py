"""The CUDA path over VMM memory on the fake driver: the worker's code exports the chunks under
its buffers as fds, the daemon's imports them, maps each region's chunks back to back and
releases everything; copies are exact; bad descriptors and fds are refused with a structured
error and nothing left imported, mapped or reserved.

The fake driver's VMM API is real memory (memfds mapped where cuMemMap says), so a copy that
lands in the wrong chunk, or a region mapped out of order, shows as wrong bytes; its counters
(``vmm_*``) show what is still held. What it cannot show (the driver's own checks of fds, sizes
and devices, VMM copies' speed) is the GPU check's (tests/procs/test_cuda_gpu.py).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache.buffers import MAX_FDS, DeviceBufferSpec, layer_shapes
from hicache.cuda_driver import CudaDriver
from hicache.errors import BufferNotShareable, FdRejected, IpcHandleInvalid
from hicache.specs import DType, Layout, PoolKind, PoolSpec, Role
from hicache_client.cuda import CudaDeviceBuffers, VmmExport
from hicached.copy.engine import TransferEngine
from hicached.core.pool import HostPool
from hicached.cuda.pinner import DriverPinner
from hicached.cuda.runner import CudaRunner
from hicached.transport.cuda_ipc import CudaAttachment, CudaIpcTransport
from tests.cuda_fixtures import (
    VmmKV,
    alloc_vmm,
    free_gpu_kv,
    free_vmm,
    host_view,
    make_gpu_kv,
    make_vmm_kv,
    page_indices,
    rows,
)
from tests.fakecuda import UUID_B, VMM_STATS, FakeCuda
from tests.fakecuda import format_uuid as fmt
from tests.helpers import SMALL, geometry_for, spec

ENGINE = TransferEngine(threads=2)
GRANULE = 2 << 20
pytestmark = pytest.mark.usefixtures("counters_settle", "vmm_settle", "deferred")


@pytest.fixture
def transport(driver: CudaDriver) -> Iterator[CudaIpcTransport]:
    t = CudaIpcTransport(driver)
    yield t
    t.close()


def held(fake: FakeCuda) -> dict[str, int]:
    return {k: fake.stat(k) for k in VMM_STATS}


def mha(layout: Layout = Layout.LAYER_FIRST, page_size: int = 4) -> PoolSpec:
    return spec(geometry_for(PoolKind.MHA, DType.BFLOAT16), page_size=page_size, layout=layout,
                size_tokens=16 * page_size)


def laid_out(s: PoolSpec, tokens: int, base: dict[Role, int]
             ) -> dict[tuple[str, Role, int], int]:
    """Each layer's address: a role's layers back to back from ``base[role]``."""
    out: dict[tuple[str, Role, int], int] = {}
    for name, geometry, comp, shape in layer_shapes(s, tokens):
        nbytes = math.prod(shape) * comp.dtype.itemsize
        out |= {(name, comp.role, i): base[comp.role] + i * nbytes
                for i in range(geometry.layer_num)}
    return out


@dataclass
class Views:
    views: dict[tuple[str, Role, int], torch.Tensor]


def daemon_views(att: CudaAttachment) -> Views:
    """The daemon's own mapping of each buffer (host views: a fake device pointer is a host
    address)."""
    assert att.buffers is not None
    return Views({(m, r, i): host_view(b.data_ptr(), b.numel() * b.element_size())
                  for m, roles in att.buffers.buffers.items() for r, ls in roles.items()
                  for i, b in enumerate(ls)})


# -- worker-side export -----------------------------------------------------------------------

def test_each_chunk_is_exported_once_and_a_layer_spans_two(driver: CudaDriver,
                                                           fake: FakeCuda) -> None:
    s = mha()
    kv = make_vmm_kv(driver, s, 64)
    try:
        bufs = kv.descriptors
        assert bufs.transport == "cuda_vmm" and {b.transport for b in bufs.descriptors} == {
            "cuda_vmm"}
        chunks = [c for seg in kv.segments for c in seg.chunks]
        assert len(bufs.fds) == len(chunks) <= MAX_FDS  # one fd per chunk, never two
        for fd in bufs.fds:
            assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:fakecuda-vmm-")
        assert fake.stat("vmm_handles") == 0, "the retained handles were released"
        named = sorted({k for b in bufs.descriptors for k in b.fd_indices})
        assert named == list(range(len(chunks)))
        spanning = [b for b in bufs.descriptors
                    if b.offset < b.chunk_bytes[0] < b.offset + b.nbytes]
        assert spanning, "some layer lies across two chunks"
        for b in bufs.descriptors:
            assert b.device_uuid == driver.devices[0].uuid
            assert b.offset + b.nbytes <= sum(b.chunk_bytes)
    finally:
        kv.free()
    assert kv.descriptors.fds == []


def test_chunks_that_follow_each_other_make_one_region(driver: CudaDriver) -> None:
    seg = alloc_vmm(driver, [GRANULE, 2 * GRANULE, GRANULE])
    export = VmmExport(driver)
    try:
        base = seg.base
        for address in (base + 100, base + GRANULE - 50, base + 3 * GRANULE + 8):
            export.add(address, 64, 0)
        regions = export.regions()
        assert len(export.fds) == 3
        assert {r.fd_indices for r in regions} == {(0, 1, 2)}
        assert [r.chunk_bytes for r in regions] == [(GRANULE, 2 * GRANULE, GRANULE)] * 3
        assert [r.offset for r in regions] == [100, GRANULE - 50, 3 * GRANULE + 8]
    finally:
        export.close()
        free_vmm(driver, seg)


def test_vmm_memory_not_created_exportable_is_refused_saying_how(
        driver: CudaDriver, fake: FakeCuda) -> None:
    seg = alloc_vmm(driver, [GRANULE], exportable=False)
    try:
        with pytest.raises(BufferNotShareable) as info:
            CudaDeviceBuffers.from_regions(
                mha(), 16, laid_out(mha(), 16, {Role.K: seg.base, Role.V: seg.base + GRANULE // 2}),
                driver)
        text = str(info.value)
        assert "not created exportable" in text and "KVCacheAccess.EXPORTS_FD" in text
        assert "--no-enable-extensible-kv-cache" in text
        assert info.value.reason == "BUFFER_NOT_SHAREABLE"
        assert fake.stat("vmm_handles") == 0
    finally:
        free_vmm(driver, seg)


def test_a_session_mixing_ipc_and_vmm_memory_is_refused(driver: CudaDriver) -> None:
    s = mha()
    ipc = make_gpu_kv(driver, s, 16)
    seg = alloc_vmm(driver, [GRANULE])
    try:
        addresses = laid_out(s, 16, {Role.K: ipc.allocations[0] + 4096, Role.V: seg.base})
        with pytest.raises(BufferNotShareable, match="travel one way"):
            CudaDeviceBuffers.from_regions(s, 16, addresses, driver)
    finally:
        free_vmm(driver, seg)
        free_gpu_kv(driver, ipc)


def test_more_chunks_than_a_session_may_hand_over_are_refused(driver: CudaDriver) -> None:
    seg = alloc_vmm(driver, [GRANULE] * (MAX_FDS + 1))  # memfds: no memory is touched
    export = VmmExport(driver)
    try:
        export.add(seg.base, seg.nbytes, 0)
        with pytest.raises(BufferNotShareable, match=f"at most {MAX_FDS}"):
            export.regions()
        assert export.fds == []
    finally:
        free_vmm(driver, seg)


# -- daemon-side attach, copies ---------------------------------------------------------------

KIND_DTYPES = [(PoolKind.MHA, DType.BFLOAT16), (PoolKind.MHA, DType.FLOAT8_E4M3),
               (PoolKind.MLA, DType.BFLOAT16), (PoolKind.DSA_INDEXER, DType.UINT8)]


def attach(transport: CudaIpcTransport, kv: VmmKV, layer_events: list[bytes] | None = None
           ) -> CudaAttachment:
    """The session's attach, then the worker's fds closed (the imports hold the memory)."""
    att = transport.attach(kv.descriptors.descriptors, layer_events or [],
                           fds=kv.descriptors.fds)
    kv.descriptors.close()
    return att


@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.value)
@pytest.mark.parametrize("kind,dtype", KIND_DTYPES, ids=lambda x: x.value)
def test_round_trip_through_vmm_chunks_is_exact(driver: CudaDriver, fake: FakeCuda,
                                                transport: CudaIpcTransport, layout: Layout,
                                                kind: PoolKind, dtype: DType) -> None:
    s = spec(geometry_for(kind, dtype), page_size=4, layout=layout, size_tokens=64)
    pool = HostPool(s, SMALL, pinner=DriverPinner(driver))
    before = held(fake)
    src, dst = make_vmm_kv(driver, s, 48, seed=1), make_vmm_kv(driver, s, 48, seed=2)
    chunks = sum(len(seg.chunks) for seg in (*src.segments, *dst.segments))
    a, b = attach(transport, src), attach(transport, dst)
    try:
        assert fake.stat("vmm_imported") == before["vmm_imported"] + chunks
        assert fake.stat("vmm_mappings") == before["vmm_mappings"] + 2 * chunks
        assert transport.vmm() == (chunks, sum(n for seg in (*src.segments, *dst.segments)
                                               for _, n in seg.chunks))
        assert a.buffers is not None and b.buffers is not None
        assert isinstance(a.runner, CudaRunner) and a.buffers.location == "cuda"
        host = pool.alloc(6 * 4)
        dev_pages = np.array([9, 0, 3, 4, 5, 11])
        r = ENGINE.backup(pool, a.buffers, host, page_indices(dev_pages, 4),
                          runner=a.runner)
        assert r.pages == 6 and not r.pending
        for v in dst.all_views():
            v.zero_()
        back_pages = np.array([1, 2, 3, 7, 6, 10])
        ENGINE.load(pool, b.buffers, host, page_indices(back_pages, 4),
                    runner=b.runner)
        for x, y in zip(rows(src, s, dev_pages), rows(dst, s, back_pages), strict=True):
            assert torch.equal(x, y)
        for y in rows(dst, s, np.array([0, 4, 5, 8, 9, 11])):
            assert not y.any(), "a load wrote outside its pages"
        assert fake.stat("deferred_errors") == 0
    finally:
        a.release()
        b.release()
        src.free()
        dst.free()
        pool.close()
    assert held(fake) == before and transport.vmm() == (0, 0)


def test_release_gives_back_every_import_mapping_and_reservation(
        driver: CudaDriver, fake: FakeCuda, transport: CudaIpcTransport) -> None:
    kv = make_vmm_kv(driver, mha(), 32)
    mine = held(fake)  # the worker's own allocations, mappings and reservations
    regions = {d.fd_indices for d in kv.descriptors.descriptors}
    chunks = len(kv.descriptors.fds)
    att = attach(transport, kv)
    try:
        assert fake.stat("vmm_imported") == chunks > 0  # one import per chunk
        assert fake.stat("vmm_mappings") == mine["vmm_mappings"] + chunks
        assert fake.stat("vmm_handles") == 0, "the imported handles went once mapped"
        assert fake.stat("vmm_reservations") == mine["vmm_reservations"] + len(regions)
        att.release()
        att.release()  # idempotent
        assert held(fake) == mine
    finally:
        att.release()
        kv.free()


def test_the_imports_hold_the_memory_after_the_worker_freed_its_own(
        driver: CudaDriver, fake: FakeCuda, transport: CudaIpcTransport) -> None:
    """The worker unmaps and releases everything (as a process that exits does): the daemon's
    mappings still hold the chunks, so a copy never lands in memory that went away. The load
    is read back through the daemon's mapping into rows zeroed first, against copies taken
    from the worker's before it let go."""
    s = mha()
    pool = HostPool(s, SMALL, pinner=DriverPinner(driver))
    kv = make_vmm_kv(driver, s, 32, seed=3)
    regions = {d.fd_indices for d in kv.descriptors.descriptors}
    att = attach(transport, kv)
    try:
        assert att.buffers is not None
        host = pool.alloc(8)
        pages, back = np.array([2, 5]), np.array([0, 7])
        saved = rows(kv, s, pages)
        ENGINE.backup(pool, att.buffers, host, page_indices(pages, 4), runner=att.runner)
        kv.free()
        assert fake.stat("vmm_allocations") == fake.stat("vmm_imported") > 0
        assert fake.stat("vmm_reservations") == len(regions)
        mine = daemon_views(att)
        for v in mine.views.values():
            v.zero_()
        ENGINE.load(pool, att.buffers, host, page_indices(back, 4), runner=att.runner)
        for x, y in zip(saved, rows(mine, s, back), strict=True):
            assert torch.equal(x, y)
        assert fake.stat("deferred_errors") == 0
        mine.views.clear()
    finally:
        att.release()
        pool.close()
    assert held(fake) == {k: 0 for k in VMM_STATS}


# -- bad descriptors and fds ------------------------------------------------------------------

DAMAGES = {  # how each is broken -> what its refusal says
    "fd_out_of_range": "were handed over", "plain_memfd": "cannot be imported",
    "regular_file": "cannot be imported", "pipe": "cannot be imported",
    "not_granular": "granularity", "chunk_too_big": "cannot be mapped",
    "leaves_region": "leave the", "sizes_disagree": "sizes differ", "fd_twice": "again",
    "two_regions": "belongs to one region", "too_many_chunks": f"names {MAX_FDS + 1} chunks",
    "too_many_fds": f"at most {MAX_FDS}", "more_than_the_gpu": "more than the GPU's",
    "other_gpu": "not of the session's GPU", "bad_event": "event handle cannot be opened"}


def _damaged(kv: VmmKV, damage: str, tmp_path: Path) -> tuple[list[DeviceBufferSpec], list[int],
                                                                list[bytes], list[int]]:
    """The session's descriptors and fds, broken one way; and fds of ours to close."""
    descs, fds = list(kv.descriptors.descriptors), list(kv.descriptors.fds)
    last = descs[-1]
    region = last.fd_indices
    same = [i for i, d in enumerate(descs) if d.fd_indices == region]
    ours: list[int] = []
    events: list[bytes] = []

    def each(**change: object) -> None:
        for i in same:
            descs[i] = replace(descs[i], **change)  # type: ignore[arg-type]

    if damage == "fd_out_of_range":
        each(fd_indices=(*region[:-1], len(fds)))
    elif damage in ("plain_memfd", "regular_file", "pipe"):
        if damage == "plain_memfd":
            fd = os.memfd_create("kv")
            os.ftruncate(fd, last.chunk_bytes[-1])
        elif damage == "regular_file":
            path = tmp_path / "kv.bin"
            path.write_bytes(b"\0" * 4096)
            fd = os.open(path, os.O_RDWR)
        else:
            fd, w = os.pipe()
            ours.append(w)
        ours.append(fd)
        fds[region[-1]] = fd
    elif damage == "not_granular":
        each(chunk_bytes=(*last.chunk_bytes[:-1], last.chunk_bytes[-1] - 4096))
    elif damage == "more_than_the_gpu":  # each chunk fits the GPU; all of them do not
        each(chunk_bytes=(*last.chunk_bytes[:-1], 80 << 30))
    elif damage == "chunk_too_big":  # the allocation is smaller than the worker says
        each(chunk_bytes=(*last.chunk_bytes[:-1], last.chunk_bytes[-1] + GRANULE))
    elif damage == "leaves_region":
        descs[-1] = replace(last, offset=sum(last.chunk_bytes) - last.nbytes + 1)
    elif damage == "sizes_disagree":
        descs[-1] = replace(last, chunk_bytes=(*last.chunk_bytes[:-1],
                                               last.chunk_bytes[-1] + GRANULE))
    elif damage == "fd_twice":
        each(fd_indices=(*region, region[0]), chunk_bytes=(*last.chunk_bytes,
                                                           last.chunk_bytes[0]))
    elif damage == "two_regions":  # its last chunk alone, while a region holds it already
        descs[-1] = replace(last, fd_indices=region[-1:], chunk_bytes=last.chunk_bytes[-1:],
                            offset=0, nbytes=min(last.nbytes, last.chunk_bytes[-1]))
    elif damage == "too_many_chunks":  # one region naming more chunks than fds may come
        fds = (fds * MAX_FDS)[:MAX_FDS]
        descs = [replace(d, fd_indices=tuple(range(MAX_FDS + 1)),
                         chunk_bytes=(GRANULE,) * (MAX_FDS + 1)) for d in descs]
    elif damage == "too_many_fds":
        fds = fds + [fds[0]] * MAX_FDS
    elif damage == "other_gpu":  # device 1's chunks, named as device 0's
        descs = [replace(d, device_uuid=fmt("fa4ec0da000000000000000000000001"))
                 for d in descs]
    else:
        events = [b"\x01" * 64]
    return descs, fds, events, ours


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_bad_vmm_handles_are_refused_and_nothing_stays_mapped(
        driver: CudaDriver, fake: FakeCuda, transport: CudaIpcTransport, damage: str,
        tmp_path: Path) -> None:
    ordinal = 1 if damage == "other_gpu" else 0
    kv = make_vmm_kv(driver, mha(), 32, ordinal=ordinal)
    descs, fds, events, ours = _damaged(kv, damage, tmp_path)
    before = held(fake), fake.stat("streams"), fake.stat("events")
    try:
        with pytest.raises((IpcHandleInvalid, FdRejected)) as info:
            transport.attach(descs, events, fds=fds)
        err = info.value
        want = ("FD_REJECTED" if damage in ("fd_out_of_range", "fd_twice", "two_regions",
                                            "too_many_chunks", "too_many_fds")
                else "IPC_HANDLE_INVALID")
        assert err.reason == want, err
        assert DAMAGES[damage] in str(err), err
        assert len(str(err)) < 400 and len(str(err.metadata)) < 400
        if damage not in ("bad_event", "too_many_fds"):
            assert "cuda_vmm" in str(err) and "buffer" in err.metadata
        if damage in ("plain_memfd", "regular_file", "pipe", "chunk_too_big", "other_gpu"):
            assert "chunk" in str(err) and "fd_index" in err.metadata
        if damage in ("plain_memfd", "regular_file", "pipe", "chunk_too_big"):
            assert err.metadata["cuda_error"] == "CUDA_ERROR_INVALID_VALUE"
        assert (held(fake), fake.stat("streams"), fake.stat("events")) == before
        assert transport.vmm() == (0, 0)
    finally:
        for fd in ours:
            os.close(fd)
        kv.free()


def test_a_worker_on_the_other_gpu_is_attached_there(driver: CudaDriver, fake: FakeCuda,
                                                     transport: CudaIpcTransport) -> None:
    kv = make_vmm_kv(driver, mha(), 16, ordinal=1)
    att = attach(transport, kv)
    try:
        assert kv.segments and all(s.ordinal == 1 for s in kv.segments)
        assert isinstance(att.runner, CudaRunner) and att.runner.ordinal == 1
        assert {d.device_uuid for d in kv.descriptors.descriptors} == {fmt(UUID_B)}
    finally:
        att.release()
        kv.free()
