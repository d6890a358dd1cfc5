"""Shared builders for the tests: small specs, random device contents, byte snapshots."""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from hicached import (
    CanarySpec,
    DType,
    HostPool,
    KVGeometry,
    Layout,
    MemberSpec,
    MemoryOptions,
    PoolKind,
    PoolSpec,
    WorkerBuffers,
)
from hicached.copy import native

if TYPE_CHECKING:
    from hicached.server.app import HiCacheServer

SMALL = MemoryOptions(hugepages=False, prefault_threads=1, reserve_bytes=0)

TOKEN_DTYPES = [DType.BFLOAT16, DType.FLOAT16, DType.FLOAT32, DType.FLOAT8_E4M3,
                DType.FLOAT8_E5M2, DType.UINT8]


def mha(dtype: DType = DType.BFLOAT16, layers: int = 3, heads: int = 2, dim: int = 8,
        v_dim: int = 0) -> KVGeometry:
    return KVGeometry(PoolKind.MHA, dtype, layers, heads, dim, v_head_dim=v_dim)


def mla(dtype: DType = DType.BFLOAT16, layers: int = 3, rank: int = 16, rope: int = 8
        ) -> KVGeometry:
    return KVGeometry(PoolKind.MLA, dtype, layers, kv_lora_rank=rank, qk_rope_head_dim=rope)


def dsa(layers: int = 3, index_dim: int = 16, block: int = 8) -> KVGeometry:
    return KVGeometry(PoolKind.DSA_INDEXER, DType.UINT8, layers, index_head_dim=index_dim,
                      quant_block_size=block)


def opaque(layers: int = 3, row: int = 40) -> KVGeometry:
    return KVGeometry(PoolKind.OPAQUE, DType.UINT8, layers, row_bytes=row)


def geometry_for(kind: PoolKind, dtype: DType) -> KVGeometry:
    if kind is PoolKind.MHA:
        return mha(dtype)
    if kind is PoolKind.MLA:
        return mla(dtype)
    if kind is PoolKind.OPAQUE:
        return opaque()
    return dsa()


def spec(geometry: KVGeometry, *, page_size: int = 4, layout: Layout = Layout.LAYER_FIRST,
         size_tokens: int = 64, side_pools: tuple[MemberSpec, ...] = (),
         canary: CanarySpec | None = None, name: str = "p") -> PoolSpec:
    return PoolSpec(name, geometry, page_size, layout, size_tokens=size_tokens,
                    side_pools=side_pools, canary=canary)


def make_pool(s: PoolSpec) -> HostPool:
    return HostPool(s, SMALL)


def random_device(s: PoolSpec, tokens: int, seed: int = 0) -> WorkerBuffers:
    gen = torch.Generator().manual_seed(seed)
    dev = WorkerBuffers.allocate(s, tokens)
    for t in dev.all_tensors():
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    return dev


def device_bytes(dev: WorkerBuffers) -> list[torch.Tensor]:
    return [t.view(torch.uint8).clone() for t in dev.all_tensors()]


def pool_bytes(pool: HostPool) -> torch.Tensor:
    return torch.from_numpy(pool.raw_bytes().copy())


@contextmanager
def native_kernel(enabled: bool) -> Iterator[None]:
    """Run with the native module (asserting it is built) or with the pure-Python fallbacks
    of the CPU kernel and of the CUDA batch submission."""
    if enabled:
        assert native.native_available(), "the native module must be built"
        yield
        return
    saved = native.KERNEL
    native.KERNEL = None
    try:
        yield
    finally:
        native.KERNEL = saved


def require_binary(name: str, package: str) -> str:
    """The path of a server or tool the tests run. Missing, the test fails under CI (``CI`` is
    set by .ci/run; scripts/test.sh installs it) and is skipped elsewhere, saying how to get
    it."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing under CI: scripts/test.sh installs {package}")
        pytest.skip(f"{name} not installed (apt-get install {package})")
    return path


def require_module(name: str, package: str) -> str:
    """The directory of an installed package the tests read (never imported), failing under
    CI and skipping elsewhere when it is missing."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing under CI: scripts/test.sh installs {package}")
        pytest.skip(f"{name} not installed (pip install {package})")
    return str(spec.submodule_search_locations[0])


def free_port() -> int:
    """A loopback TCP port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def served_in_process(tmp_path: Path, spec: PoolSpec) -> Iterator[tuple[HiCacheServer, str, str]]:
    """A daemon in this process on a temp socket, declaring ``spec``, without a state
    directory or metrics: (server, its target, its shm directory); drained when done."""
    from hicached.server.app import create_server
    from hicached.server.config import ServerConfig

    shm = tmp_path / "shm"
    shm.mkdir()
    config = ServerConfig(listen=(f"unix:{tmp_path}/s.sock",), shm_dir=str(shm), state_dir="",
                          metrics_listen="", memory_budget_bytes=64 << 20, reserve_bytes=0,
                          pools=(spec,), grace_seconds=1)
    server, bound = create_server(config)
    try:
        yield server, bound[0], str(shm)
    finally:
        server.drain_and_stop(1.0)


def sample(server: HiCacheServer, name: str, **labels: str) -> float:
    """An in-process server's metric sample (0 where it has none yet)."""
    v = server.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


class StrictPinner:
    """Host registration by cuMemHostRegister's rules, on plain memory: a range overlapping
    one registered is refused, only a registration's base unregisters it, and an optional
    byte limit refuses what would exceed it (the locked-memory limit)."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.ranges: dict[int, int] = {}

    def register(self, address: int, nbytes: int) -> None:
        if any(a < address + nbytes and address < a + n for a, n in self.ranges.items()):
            raise RuntimeError("CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED")
        if self.limit is not None and sum(self.ranges.values()) + nbytes > self.limit:
            raise RuntimeError("CUDA_ERROR_OUT_OF_MEMORY")
        self.ranges[address] = nbytes

    def unregister(self, address: int) -> None:
        if address not in self.ranges:
            raise RuntimeError("CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED")
        del self.ranges[address]

    def covers(self, address: int, nbytes: int) -> bool:
        """Whether every byte of ``[address, address + nbytes)`` is registered."""
        end = address + nbytes
        for a, n in sorted(self.ranges.items()):
            if a <= address < a + n:
                address = a + n
            if address >= end:
                return True
        return address >= end

    @property
    def nbytes(self) -> int:
        return sum(self.ranges.values())
