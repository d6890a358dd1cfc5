"""A host pool: storage of every member in one mapped region, a page allocator, a canary table.

Primitives:

- ``MemoryOptions``: how pool memory is mapped (backing, huge pages, prefault threads, reserve,
  pinning).
- ``HostAddressing``: where byte row (layer, page, unit) of a component lives, for any layout.
- ``ComponentStorage``: one component's bytes inside the region, with its SGLang-shaped typed
  tensor view (``tensor``) and its addressing.
- ``HostPool``: ``alloc`` / ``free`` whole pages, ``buffer(member, role)``, occupancy figures,
  ``close()``. Transfers live in ``transfer``; this module never copies KV bytes.

Members are laid out one after another, components in order: a symmetric MHA pool's K and V are
therefore exactly SGLang's (2, ...) host buffer.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import numpy as np
import torch

from hicached.allocator import PageAllocator
from hicached.canary import CanaryTable
from hicached.copyplan import Side
from hicached.errors import PoolClosed
from hicached.geometry import Component, KVGeometry, Layout, PoolSpec, Role, host_shape
from hicached.memory import Backing, HostMemory, Pinner, check_budget, default_pinner

log = logging.getLogger(__name__)

ALIGN = 64
"""Component alignment in the region: one cache line, so symmetric K and V stay adjacent."""


@dataclass(frozen=True)
class MemoryOptions:
    """How a pool's host memory is obtained."""

    backing: Backing = Backing.ANONYMOUS
    """ANONYMOUS (huge-page friendly), MEMFD or FILE (shareable)."""
    file_dir: str = "/dev/shm"
    """Directory of FILE-backed pools."""
    hugepages: bool = True
    """Ask for transparent huge pages (MADV_HUGEPAGE)."""
    prefault_threads: int = 0
    """Threads that fault the pool in at creation (0 = one per usable CPU)."""
    reserve_bytes: int = 1 << 30
    """Memory left to the rest of the host: a pool may not exceed MemAvailable minus this."""
    pin: bool | None = None
    """Page-lock for DMA: None = when the CUDA driver has a device, False = never."""
    cuda_driver: str = ""
    """CUDA driver library that pins ('' = $HICACHED_CUDA_DRIVER or libcuda.so.1)."""

    def __post_init__(self) -> None:
        if self.prefault_threads < 0 or self.reserve_bytes < 0:
            from hicached.errors import SpecInvalid

            raise SpecInvalid("prefault_threads and reserve_bytes must be >= 0")


@dataclass(frozen=True)
class HostAddressing:
    """Byte offsets of unit rows in a host component buffer.

    Row (layer ``l``, page ``p``, unit ``u``) starts at
    ``l * layer_stride + p * page_pitch + u * unit_stride``.
    """

    layer_stride: int
    page_pitch: int
    unit_stride: int

    @staticmethod
    def of(comp: Component, layout: Layout, layer_num: int, size_tokens: int,
           page_size: int) -> HostAddressing:
        ub = comp.unit_bytes
        upp = comp.units_per_page(page_size)
        units_total = size_tokens // page_size * upp
        if layout is Layout.LAYER_FIRST:
            return HostAddressing(units_total * ub, upp * ub, ub)
        if layout is Layout.PAGE_FIRST and not comp.page_granular:
            return HostAddressing(ub, upp * layer_num * ub, layer_num * ub)
        return HostAddressing(upp * ub, layer_num * upp * ub, ub)


@dataclass
class ComponentStorage:
    member: str
    comp: Component
    layer_num: int
    offset: int
    nbytes: int
    addressing: HostAddressing
    tensor: torch.Tensor
    """Typed view in SGLang's host shape for this component and layout."""
    side: Side
    """Absolute addressing of this component for the copy planner."""


class HostPool:
    def __init__(self, spec: PoolSpec, options: MemoryOptions | None = None,
                 *, pinner: Pinner | None = None) -> None:
        options = options or MemoryOptions()
        self.spec = spec
        self.page_size = spec.page_size
        self.size_tokens = spec.resolved_size_tokens()
        self.page_num = self.size_tokens // spec.page_size
        self.allocator = PageAllocator(self.page_num, spec.page_size)
        self._lock = threading.Lock()
        self._closed = False
        layout: list[tuple[str, KVGeometry, Component, int, int]] = []
        offset = 0
        for name, geometry in spec.members():
            for comp in geometry.components(spec.page_size):
                shape = host_shape(comp, spec.layout, geometry.layer_num, self.size_tokens,
                                   spec.page_size)
                nbytes = int(np.prod(shape)) * comp.dtype.itemsize
                layout.append((name, geometry, comp, offset, nbytes))
                offset += -(-nbytes // ALIGN) * ALIGN
        self.nbytes = offset
        self.memory: HostMemory | None = None
        self.components: list[ComponentStorage] = []
        if self.nbytes:
            check_budget(self.nbytes, options.reserve_bytes)
            if pinner is None and options.pin is not False:
                pinner = default_pinner(options.cuda_driver or None)
            path = None
            if options.backing is Backing.FILE:
                path = f"{options.file_dir.rstrip('/')}/hicached-pool-{spec.name}"
            self.memory = HostMemory(
                self.nbytes, backing=options.backing, path=path, hugepages=options.hugepages,
                prefault_threads=options.prefault_threads, pinner=pinner, name=spec.name,
            )
            raw = self.memory.array()
            for name, geometry, comp, off, nbytes in layout:
                shape = host_shape(comp, spec.layout, geometry.layer_num, self.size_tokens,
                                   spec.page_size)
                view = torch.from_numpy(raw[off:off + nbytes]).view(comp.dtype.torch_dtype)
                addressing = HostAddressing.of(comp, spec.layout, geometry.layer_num,
                                               self.size_tokens, spec.page_size)
                base = self.memory.address + off
                layers = np.arange(geometry.layer_num, dtype=np.int64)
                self.components.append(ComponentStorage(
                    member=name, comp=comp, layer_num=geometry.layer_num, offset=off,
                    nbytes=nbytes, addressing=addressing, tensor=view.reshape(shape),
                    side=Side(
                        layer_bases=base + layers * addressing.layer_stride,
                        layer_limits=np.full(geometry.layer_num, base + nbytes, np.int64),
                        page_pitch=addressing.page_pitch, unit_stride=addressing.unit_stride),
                ))
        self.canary: CanaryTable | None = None
        if spec.canary is not None and self.components:
            self.canary = CanaryTable(self.page_num, spec.max_layers, spec.canary.read_bytes)
        log.info(
            "pool %s: %d tokens in %d pages of %d, %d bytes, layout %s, prefault %.3f s",
            spec.name, self.size_tokens, self.page_num, spec.page_size, self.nbytes,
            spec.layout.value, self.memory.prefault_seconds if self.memory else 0.0,
        )

    # -- pages -----------------------------------------------------------------------------

    def alloc(self, num_tokens: int) -> torch.Tensor:
        """Page-aligned token indices of ``num_tokens // page_size`` fresh pages."""
        self._check_open()
        return torch.from_numpy(self.allocator.alloc(num_tokens))

    def free(self, indices: object) -> int:
        """Return whole pages; their canary fingerprints are forgotten. Returns pages freed."""
        self._check_open()
        pages = self.allocator.free(indices)
        if self.canary is not None:
            self.canary.forget(pages)
        return int(pages.size)

    # -- storage ---------------------------------------------------------------------------

    def buffer(self, member: str, role: Role) -> torch.Tensor:
        """The typed host tensor of one component (SGLang's host shape, no leading 2)."""
        for c in self.components:
            if c.member == member and c.comp.role is role:
                return c.tensor
        raise KeyError((member, role))

    def raw_bytes(self) -> np.ndarray:
        """The whole pool region as uint8 (for fingerprints and tests)."""
        self._check_open()
        return self.memory.array() if self.memory else np.zeros(0, np.uint8)

    @property
    def address(self) -> int:
        return self.memory.address if self.memory else 0

    @property
    def pinned_bytes(self) -> int:
        return self.memory.pinned_bytes if self.memory else 0

    @property
    def pin_seconds(self) -> float:
        return self.memory.pin_seconds if self.memory else 0.0

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosed(f"pool {self.spec.name} is closed", metadata={"pool": self.spec.name})

    def close(self) -> None:
        """Release the pool's memory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.components = []
        if self.memory is not None:
            self.memory.close()
