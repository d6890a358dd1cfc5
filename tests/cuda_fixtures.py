"""Fixtures for the CUDA path on the fake driver: a loaded driver with two GPUs, fake device
buffers laid out like SGLang's device pool, exported and attached through the real code, and
the rows of given pages read back from them."""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from hicache.buffers import layer_shapes
from hicache.cuda_driver import CudaDriver, load_driver
from hicache.specs import PoolSpec, Role
from hicache_client.cuda import CudaDeviceBuffers
from tests.fakecuda import UUID_A, UUID_B, FakeCuda, library

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


def rows(kv: FakeGpuKV, s: PoolSpec, pages: np.ndarray, layers: range | None = None
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
