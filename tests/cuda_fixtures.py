"""Fixtures for the CUDA path on the fake driver: a loaded driver with two GPUs, fake device
buffers laid out like SGLang's device pool (in ``cuMemAlloc`` memory, or in VMM memory whose
layers straddle chunks: ``make_vmm_kv``, which also runs on a real GPU), exported and attached
through the real code, and the rows of given pages read back from them."""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import pytest
import torch

from hicache.buffers import layer_shapes
from hicache.cuda_driver import CudaDriver, load_driver
from hicache.specs import PoolSpec, Role
from hicache_client.cuda import CudaDeviceBuffers
from tests.fakecuda import UUID_A, UUID_B, VMM_STATS, FakeCuda, library

if TYPE_CHECKING:
    from hicached.transport.cuda_ipc import CudaAttachment, CudaIpcTransport


@pytest.fixture(scope="session")
def fake_lib() -> str:
    os.environ.setdefault("FAKECUDA_DEVICES", f"{UUID_A},{UUID_B}")
    return library()


@pytest.fixture(scope="session")
def driver(fake_lib: str) -> CudaDriver:
    drv = load_driver(fake_lib)
    assert drv is not None
    return drv


@pytest.fixture(scope="session")
def fake(fake_lib: str) -> FakeCuda:
    return FakeCuda(fake_lib)


def host_view(address: int, nbytes: int) -> torch.Tensor:
    """A CPU uint8 tensor over fake device memory (a fake device pointer is a host address)."""
    return torch.frombuffer((ctypes.c_ubyte * nbytes).from_address(address), dtype=torch.uint8)


@dataclass
class FakeGpuKV:
    """SGLang-style per-layer device buffers in fake GPU memory: one allocation per
    (member, role), layers carved out of it as the caching allocator would."""

    descriptors: CudaDeviceBuffers
    views: dict[tuple[str, Role, int], torch.Tensor]
    """uint8 view of each layer buffer, for filling and checking from the test."""
    allocations: list[int]

    def all_views(self) -> list[torch.Tensor]:
        return [self.views[k] for k in sorted(self.views, key=lambda k: (k[0], k[1].value,
                                                                          k[2]))]


def make_gpu_kv(driver: CudaDriver, spec: PoolSpec, device_tokens: int, ordinal: int = 0,
                seed: int = 0) -> FakeGpuKV:
    gen = torch.Generator().manual_seed(seed)
    views: dict[tuple[str, Role, int], torch.Tensor] = {}
    addresses: dict[tuple[str, Role, int], int] = {}
    allocations: list[int] = []
    with driver.context(ordinal):
        for name, geometry, comp, shape in layer_shapes(spec, device_tokens):
            nbytes = math.prod(shape) * comp.dtype.itemsize
            pitch = -(-nbytes // 512) * 512
            base = driver.mem_alloc(pitch * geometry.layer_num + 4096)
            allocations.append(base)
            for layer in range(geometry.layer_num):
                addr = base + 4096 + layer * pitch  # interior offsets, as torch's allocator
                addresses[(name, comp.role, layer)] = addr
                v = host_view(addr, nbytes)
                v.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))
                views[(name, comp.role, layer)] = v
    bufs = CudaDeviceBuffers.from_regions(spec, device_tokens, addresses, driver)
    return FakeGpuKV(bufs, views, allocations)


def free_gpu_kv(driver: CudaDriver, kv: FakeGpuKV, ordinal: int = 0) -> None:
    kv.views.clear()
    with driver.context(ordinal):
        for a in kv.allocations:
            driver.mem_free(a)


def page_indices(pages: list[int] | np.ndarray, ps: int) -> torch.Tensor:
    p = np.asarray(pages, dtype=np.int64)
    return torch.from_numpy((p[:, None] * ps + np.arange(ps)).reshape(-1))


class HasViews(Protocol):
    """Device KV as the tests read it: a uint8 view of each (member, role, layer) buffer."""

    @property
    def views(self) -> dict[tuple[str, Role, int], torch.Tensor]: ...


def rows(kv: HasViews, s: PoolSpec, pages: np.ndarray, layers: range | None = None
         ) -> list[torch.Tensor]:
    out = []
    for name, geometry in s.members():
        for comp in geometry.components(s.page_size):
            for layer in layers if layers is not None else range(geometry.layer_num):
                if layer >= geometry.layer_num:
                    continue
                v = kv.views[(name, comp.role, layer)].view(-1, comp.unit_bytes)
                if comp.page_granular:
                    out.append(v[torch.from_numpy(pages)].clone())
                else:
                    out.append(v[page_indices(pages, s.page_size)].clone())
    return out


def attached_pair(driver: CudaDriver, transport: CudaIpcTransport, s: PoolSpec, tokens: int,
                  seeds: tuple[int, int]
                  ) -> tuple[FakeGpuKV, FakeGpuKV, CudaAttachment, CudaAttachment]:
    """Two device KV buffers (random bytes by ``seeds``), each attached as a session."""
    src = make_gpu_kv(driver, s, tokens, seed=seeds[0])
    dst = make_gpu_kv(driver, s, tokens, seed=seeds[1])
    return src, dst, transport.attach(src.descriptors.descriptors), \
        transport.attach(dst.descriptors.descriptors)


def release_pair(driver: CudaDriver, src: FakeGpuKV, dst: FakeGpuKV, a: CudaAttachment,
                 b: CudaAttachment) -> None:
    """``attached_pair`` undone: both sessions released, both buffers freed."""
    a.release()
    b.release()
    free_gpu_kv(driver, src)
    free_gpu_kv(driver, dst)


@pytest.fixture
def deferred(fake: FakeCuda) -> Iterator[None]:
    """Stream work runs only when synchronized with, as on a GPU that is slow to get to it."""
    fake.set_defer(True)
    yield
    fake.set_defer(False)


@pytest.fixture
def counters_settle(fake: FakeCuda) -> Iterator[None]:
    """Every test leaves open handles, streams and events where it found them."""
    before = {k: fake.stat(k) for k in ("open_handles", "streams", "events", "queued",
                                         "deferred_errors")}
    yield
    after = {k: fake.stat(k) for k in before}
    assert after == before, f"CUDA resources leaked: {before} -> {after}"


# -- VMM memory (cuMemCreate + cuMemMap), as vLLM 0.34 allocates its KV cache -----------------

@dataclass
class VmmSegment:
    """Physical allocations ("chunks") mapped back to back in one reserved range, each
    readable and writable by the device; the handles released (the mappings hold them)."""

    base: int
    chunks: list[tuple[int, int]]
    """(address, bytes) of each chunk, in address order."""
    ordinal: int

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.chunks)


def alloc_vmm(driver: CudaDriver, chunk_bytes: list[int], ordinal: int = 0,
              exportable: bool = True) -> VmmSegment:
    with driver.context(ordinal):
        handles = [driver.mem_create(n, ordinal, exportable) for n in chunk_bytes]
        try:
            base = driver.mem_address_reserve(sum(chunk_bytes))
            at, chunks = base, []
            for h, n in zip(handles, chunk_bytes, strict=True):
                driver.mem_map(at, n, h)
                driver.mem_set_access(at, n, ordinal)
                chunks.append((at, n))
                at += n
        finally:
            for h in handles:
                driver.mem_release(h)
    return VmmSegment(base, chunks, ordinal)


def free_vmm(driver: CudaDriver, seg: VmmSegment) -> None:
    with driver.context(seg.ordinal):
        for address, n in seg.chunks:
            driver.mem_unmap(address, n)
        driver.mem_address_free(seg.base, seg.nbytes)


@dataclass
class VmmKV:
    """SGLang-style per-layer device buffers in VMM memory: per (member, role) a segment whose
    layers lie back to back, the first across the end of the segment's first chunk (so a
    layer spans two chunks), in chunks of one and two granules."""

    descriptors: CudaDeviceBuffers
    views: dict[tuple[str, Role, int], torch.Tensor]
    """uint8 view of each layer buffer (host views on the fake driver, CUDA tensors on a
    GPU)."""
    segments: list[VmmSegment]
    driver: CudaDriver

    def all_views(self) -> list[torch.Tensor]:
        return [self.views[k] for k in sorted(self.views, key=lambda k: (k[0], k[1].value,
                                                                          k[2]))]

    def free(self) -> None:
        self.descriptors.close()
        self.views.clear()
        for seg in self.segments:
            free_vmm(self.driver, seg)


class _CudaArray:
    """``nbytes`` of device memory at ``address`` as torch takes it
    (``__cuda_array_interface__``)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (address, False), "version": 3}


def device_view(address: int, nbytes: int) -> torch.Tensor:
    """A uint8 CUDA tensor over real device memory the caller keeps allocated."""
    return torch.as_tensor(_CudaArray(address, nbytes), device="cuda")


def make_vmm_kv(driver: CudaDriver, spec: PoolSpec, device_tokens: int, ordinal: int = 0,
                seed: int = 0, real: bool = False) -> VmmKV:
    gen = torch.Generator().manual_seed(seed)
    granule = driver.mem_granularity(ordinal)
    views: dict[tuple[str, Role, int], torch.Tensor] = {}
    addresses: dict[tuple[str, Role, int], int] = {}
    segments: list[VmmSegment] = []
    try:
        for name, geometry, comp, shape in layer_shapes(spec, device_tokens):
            nbytes = math.prod(shape) * comp.dtype.itemsize
            pitch = -(-nbytes // 512) * 512
            start = granule - pitch // 2 if pitch // 2 < granule else 0
            chunks = [granule]
            while sum(chunks) < start + pitch * geometry.layer_num:
                chunks.append(2 * granule)
            seg = alloc_vmm(driver, chunks, ordinal)
            segments.append(seg)
            for layer in range(geometry.layer_num):
                addr = seg.base + start + layer * pitch
                key = (name, comp.role, layer)
                addresses[key] = addr
                fill = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
                v = device_view(addr, nbytes) if real else host_view(addr, nbytes)
                v.copy_(fill.to(v.device))
                views[key] = v
        bufs = CudaDeviceBuffers.from_regions(spec, device_tokens, addresses, driver)
    except BaseException:
        for seg in segments:
            free_vmm(driver, seg)
        raise
    return VmmKV(bufs, views, segments, driver)


@pytest.fixture
def vmm_settle(fake: FakeCuda) -> Iterator[None]:
    """Every test leaves the VMM API's handles, allocations, mappings and reservations where
    it found them."""
    before = {k: fake.stat(k) for k in VMM_STATS}
    yield
    after = {k: fake.stat(k) for k in VMM_STATS}
    assert after == before, f"VMM resources leaked: {before} -> {after}"
