"""A host pool: storage of every member in one mapped region, a page allocator, a canary table.

Primitives:

- ``MemoryOptions``: how pool memory is mapped (backing, huge pages, prefault threads,
  reserve).
- ``ComponentStorage``: one component's bytes inside the region (``raw``), its SGLang host
  shape, its addressing and the absolute base address of each layer; ``tensor``, the typed
  torch view in that shape, is made on first use (tests, in-process callers: the daemon never
  asks, and never loads torch).
- ``HostPool``: ``alloc`` / ``free`` whole pages, ``buffer(member, role)``, ``page_segments`` /
  ``page_views`` (where one page's bytes lie, for tiers below host memory), ``copy_page(src,
  dst)`` (one page's bytes onto another, within the pool), ``release_pages(first, end)`` (the
  memory of a run of pages given back to the system) and ``reserve_pages`` (their backing
  taken again, and page-locked where the pool's locked part follows its share: ``pin_units``),
  ``registrations`` (where its locked memory's registrations meet), ``fingerprints``
  (the kv-canary hash of host pages), occupancy figures, ``begin_copy`` / ``end_copy`` (copies
  in flight: ``close(wait_seconds)`` waits for them and never unmaps under one). Pinning is done
  by the
  ``Pinner`` the caller injects. Copies live in ``hicached.copy``; this module never moves KV
  bytes.

- ``region_layout(spec, size_tokens)``: where each component lies in the region, and the
  region's bytes (what ``HostPool.nbytes`` will be), without mapping anything.

Members are laid out one after another, components in order: a symmetric MHA pool's K and V are
therefore exactly SGLang's (2, ...) host buffer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from hicache.errors import PinFailed, PoolClosed, SpecInvalid
from hicache.locks import condition, lock
from hicache.specs import Component, KVGeometry, Layout, PoolSpec, Role
from hicached.core.allocator import PageAllocator, table_specs
from hicached.core.canary import CanaryTable, fingerprints
from hicached.core.host_layout import HostAddressing, host_shape
from hicached.core.memory import OS_PAGE, Backing, HostMemory, Pinner
from hicached.core.pin_units import PinUnits
from hicached.core.registrations import Registrations
from hicached.core.state_file import Outcome, StateFiles, TableSpec
from hicached.core.system import check_budget

if TYPE_CHECKING:
    import torch

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
    pin_unit_bytes: int = 2 << 20
    """Page-locked pools whose share follows the memory budget are locked in units of about
    this many bytes or more (``core.pin_units``; at most 4,096 units a pool)."""
    reserve_bytes: int = 1 << 30
    """Memory left to the rest of the host: a pool may not exceed MemAvailable minus this."""
    state_dir: str = ""
    """Directory of pool files that outlive the daemon (``core.state_file``: memory and
    tables, re-attached by the next daemon); "" = ``backing``, lost when the daemon exits."""

    def __post_init__(self) -> None:
        if self.prefault_threads < 0 or self.reserve_bytes < 0:
            raise SpecInvalid("prefault_threads and reserve_bytes must be >= 0")
        if self.pin_unit_bytes < OS_PAGE:
            raise SpecInvalid(f"pin_unit_bytes must be at least an OS page ({OS_PAGE})",
                              metadata={"field": "pin_unit_bytes"})


@dataclass
class ComponentStorage:
    member: str
    comp: Component
    layer_num: int
    offset: int
    nbytes: int
    addressing: HostAddressing
    raw: np.ndarray
    """The component's bytes (uint8) in the pool's mapping."""
    shape: tuple[int, ...]
    """SGLang's host shape for this component and layout."""
    layer_bases: np.ndarray
    """Absolute address of each layer's first row (int64, indexed by layer)."""
    layer_limits: np.ndarray
    """One past the last byte each layer's rows may reach: the component's end (int64)."""

    @cached_property
    def tensor(self) -> torch.Tensor:
        """Typed torch view in ``shape`` (imports torch on first use)."""
        import torch

        return torch.from_numpy(self.raw).view(self.comp.dtype.torch_dtype).reshape(self.shape)

    def clip(self, layers: range) -> range:
        """The part of ``layers`` this component has (side pools may have fewer layers)."""
        return range(layers.start, min(layers.stop, self.layer_num))


def region_layout(spec: PoolSpec, size_tokens: int
                  ) -> tuple[list[tuple[str, KVGeometry, Component, int, int]], int]:
    """Each component's (member, geometry, component, offset, bytes) in the pool's region, and
    the region's size: members one after another, each component ``ALIGN``-aligned."""
    layout: list[tuple[str, KVGeometry, Component, int, int]] = []
    offset = 0
    for name, geometry in spec.members():
        for comp in geometry.components(spec.page_size):
            shape = host_shape(comp, spec.layout, geometry.layer_num, size_tokens,
                               spec.page_size)
            nbytes = int(np.prod(shape)) * comp.dtype.itemsize
            layout.append((name, geometry, comp, offset, nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
    return layout, offset


class HostPool:
    def __init__(self, spec: PoolSpec, options: MemoryOptions | None = None,
                 *, pinner: Pinner | None = None,
                 on_progress: Callable[[int], None] | None = None,
                 extra_tables: Sequence[TableSpec] = (),
                 resident_pages: int | None = None) -> None:
        """Map, prefault and (with a ``pinner``) page-lock the pool's memory;
        ``on_progress(nbytes)`` follows the prefault. ``resident_pages``: only the memory of
        that many first pages is faulted in (and checked against the host's), the rest as it
        is written (a pool whose share of the memory budget grows with its demand); with a
        ``pinner`` only they are page-locked, the rest as ``reserve_pages`` hands them out
        (``core.pin_units``; a re-attached pool is locked whole until its share shrinks). With
        ``options.state_dir`` the memory and the tables (the allocator's, the canary's,
        ``extra_tables`` of the layers above) live in its files: saved ones that match are
        re-attached as they are (``outcome`` REATTACHED: the caller recovers the allocator
        next), others are replaced."""
        options = options or MemoryOptions()
        self.spec = spec
        self.page_size = spec.page_size
        self.size_tokens = spec.resolved_size_tokens()
        self.page_num = self.size_tokens // spec.page_size
        layers = max(spec.max_layers, 1)
        self._lock = lock("pool")
        self._idle = condition(self._lock)
        self._closed = False
        self._copies = 0
        layout, self.nbytes = region_layout(spec, self.size_tokens)
        self.memory: HostMemory | None = None
        self.components: list[ComponentStorage] = []
        self.state: StateFiles | None = None
        tables: dict[str, np.ndarray] = {}
        if self.nbytes and options.state_dir:
            own = [*table_specs(self.page_num, layers),
                   *(CanaryTable.table_specs(self.page_num, layers) if spec.canary else [])]
            self.state = StateFiles(options.state_dir, spec, self.nbytes,
                                    [*own, *extra_tables])
            self.state.open()
            tables = {t.name: self.state.table(t.name) for t in own}
        self.outcome = self.state.outcome if self.state is not None else None
        """How the state files were found (None without a state directory)."""
        reuse = self.outcome is Outcome.REATTACHED
        self.allocator = PageAllocator(self.page_num, spec.page_size, layers, tables)
        self._pin_units: PinUnits | None = None
        """Where the pool is page-locked by units that follow its share (elastic, pinned)."""
        partial = resident_pages is not None and not reuse
        if self.nbytes:
            if not reuse:  # re-attached memory is in use already: nothing new to fit
                check_budget(self.nbytes if not partial else
                             min(resident_pages or 0, self.page_num) * spec.page_bytes,
                             options.reserve_bytes)
            backing, path = options.backing, None
            if self.state is not None:
                backing, path = Backing.FILE, self.state.data_path
            elif options.backing is Backing.FILE:
                path = f"{options.file_dir.rstrip('/')}/hicached-pool-{spec.name}"
            try:
                self.memory = HostMemory(
                    self.nbytes, backing=backing, path=path, hugepages=options.hugepages,
                    prefault_threads=options.prefault_threads,
                    pinner=pinner if resident_pages is None else None, name=spec.name,
                    on_progress=on_progress, reuse=reuse, keep=self.state is not None,
                    prefault=not partial,
                )
            except BaseException:
                if self.state is not None:
                    self.state.remove()  # half-made or unmappable: the next start is cold
                raise
            raw = self.memory.array()
            for name, geometry, comp, off, nbytes in layout:
                shape = host_shape(comp, spec.layout, geometry.layer_num, self.size_tokens,
                                   spec.page_size)
                addressing = HostAddressing.of(comp, spec.layout, geometry.layer_num,
                                               self.size_tokens, spec.page_size)
                base = self.memory.address + off
                layer_ids = np.arange(geometry.layer_num, dtype=np.int64)
                self.components.append(ComponentStorage(
                    member=name, comp=comp, layer_num=geometry.layer_num, offset=off,
                    nbytes=nbytes, addressing=addressing, raw=raw[off:off + nbytes],
                    shape=tuple(shape),
                    layer_bases=base + layer_ids * addressing.layer_stride,
                    layer_limits=np.full(geometry.layer_num, base + nbytes, np.int64)))
        if self.memory is not None and partial:
            self.memory.populate(self.page_run_ranges(0, min(resident_pages or 0,
                                                             self.page_num)))
        if partial and resident_pages is not None:  # nothing above it before the budget says
            self.allocator.set_limit(resident_pages)
        if self.memory is not None and pinner is not None and resident_pages is not None:
            self._pin_units = PinUnits(self.memory, pinner, self.page_run_ranges(0, self.page_num),
                                       self.page_num, options.pin_unit_bytes)
            # re-attached memory holds keys anywhere: all of it, until the budget's shrink
            locked = self.page_num if reuse else min(resident_pages, self.page_num)
            if not self._pin_units.pin_below(locked):
                self.close(0, remove_state=not reuse)
                raise PinFailed(f"page-locking the first {locked} pages of pool {spec.name} "
                                f"for DMA failed (see the log for the cause)",
                                metadata={"pool": spec.name, "pages": locked})
        seams = (self._pin_units.seams if self._pin_units is not None
                 else self.memory.pin_seams if self.memory is not None else np.zeros(0, np.int64))
        self.registrations = (Registrations(seams, self.memory.address, self.memory.nbytes)
                              if self.memory is not None and seams.size
                              else Registrations.none())
        """Where the region's page-locked registrations may meet: the driver refuses a copy
        over two, so copies to and from a GPU are cut there (``cuda.segments.split_at``)."""
        self.canary: CanaryTable | None = None
        if spec.canary is not None and self.components:
            self.canary = CanaryTable(self.page_num, spec.max_layers, spec.canary.read_bytes,
                                      tables)
        log.info(
            "pool %s: %d tokens in %d pages of %d, %d bytes, layout %s, prefault %.3f s",
            spec.name, self.size_tokens, self.page_num, spec.page_size, self.nbytes,
            spec.layout.value, self.memory.prefault_seconds if self.memory else 0.0,
        )

    # -- pages -----------------------------------------------------------------------------

    def alloc(self, num_tokens: int) -> torch.Tensor:
        """Page-aligned token indices of ``num_tokens // page_size`` fresh pages, as a torch
        tensor (in-process callers; the daemon allocates through its cache)."""
        import torch

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

    @staticmethod
    def metadata_bytes_per_page(spec: PoolSpec) -> int:
        """Host bytes of a pool's own tables per page (allocator, kv-canary), for budgets."""
        layers = max(spec.max_layers, 1)
        canary = CanaryTable.bytes_per_page(layers) if spec.canary is not None else 0
        return PageAllocator.bytes_per_page(layers) + canary

    @property
    def metadata_bytes(self) -> int:
        """Host bytes of this pool's tables (beside its page memory)."""
        canary = self.canary.nbytes if self.canary is not None else 0
        return self.allocator.metadata_bytes + canary

    def fingerprints(self, pages: np.ndarray, layers: range) -> np.ndarray:
        """kv-canary fingerprints (len(pages), len(layers)) of host pages, over every
        component (the pool must have a canary)."""
        assert self.canary is not None
        words = self.raw_bytes().view(np.uint64)
        read_words = self.canary.read_bytes // 8
        out = np.zeros((pages.size, len(layers)), dtype=np.uint64)
        for salt, cs in enumerate(self.components):
            lays = cs.clip(layers)
            if not len(lays):
                continue
            a = cs.addressing
            units = cs.comp.units_per_page(self.page_size)
            offs = (cs.offset
                    + pages[:, None, None] * a.page_pitch
                    + np.arange(lays.start, lays.stop, dtype=np.int64)[None, :, None]
                    * a.layer_stride
                    + np.arange(units, dtype=np.int64)[None, None, :] * a.unit_stride) // 8
            with np.errstate(over="ignore"):
                out[:, : len(lays)] += fingerprints(words, offs, read_words, salt)
        return out

    def page_segments(self, page: int) -> list[tuple[int, int]]:
        """Where one page's bytes lie in the region, as (offset, length) runs in a fixed
        order (component by component, layer by layer); they add up to ``spec.page_bytes``."""
        out: list[tuple[int, int]] = []
        for c in self.components:
            a = c.addressing
            run = c.comp.units_per_page(self.page_size) * c.comp.unit_bytes
            if self.spec.layout is Layout.LAYER_FIRST:  # one run per layer
                starts = [c.offset + layer * a.layer_stride + page * a.page_pitch
                          for layer in range(c.layer_num)]
            else:  # the page's rows of every layer are one run
                starts, run = [c.offset + page * a.page_pitch], run * c.layer_num
            for start in starts:
                if out and out[-1][0] + out[-1][1] == start:
                    out[-1] = (out[-1][0], out[-1][1] + run)
                else:
                    out.append((start, run))
        return out

    def copy_page(self, src: int, dst: int) -> None:
        """Page ``src``'s bytes onto page ``dst`` (every component, every layer); the caller
        holds both pages (no copy reads or writes either meanwhile)."""
        raw = self.raw_bytes()
        for (s_off, n), (d_off, _) in zip(self.page_segments(src), self.page_segments(dst),
                                          strict=True):
            raw[d_off:d_off + n] = raw[s_off:s_off + n]

    def page_run_ranges(self, first: int, end: int) -> list[tuple[int, int]]:
        """Where the bytes of pages ``first .. end - 1`` lie, as (offset, length) runs: one per
        component and layer (LAYER_FIRST), one per component otherwise."""
        out: list[tuple[int, int]] = []
        if end <= first:
            return out
        for c in self.components:
            a = c.addressing
            if self.spec.layout is Layout.LAYER_FIRST:
                out += [(c.offset + layer * a.layer_stride + first * a.page_pitch,
                         (end - first) * a.page_pitch) for layer in range(c.layer_num)]
            else:
                out.append((c.offset + first * a.page_pitch, (end - first) * a.page_pitch))
        return out

    def reserve_pages(self, first: int, end: int) -> bool:
        """Reserve the backing of pages ``first .. end - 1`` before they are handed out (a
        file-backed pool whose memory was given back, or never faulted in), and page-lock
        them where the pool is locked by units; False: the file system is full, or the
        locked-memory limit reached (nothing more is locked then)."""
        if self.memory is None or end <= first:
            return True
        if self._pin_units is not None:
            return self._pin_units.pin_below(end)
        return self.memory.reserve(self.page_run_ranges(first, end))

    def release_pages(self, first: int, end: int) -> int:
        """Give the memory of pages ``first .. end - 1`` back to the system (none of them may
        be in use: the allocator's limit is at or below ``first``); returns the bytes
        released (0 for a pool locked whole, or without a region). A pool locked by units
        unlocks and gives back every unit all of whose pages are at or above ``first``."""
        if self.memory is None:
            return 0
        if self._pin_units is not None:
            return self._pin_units.unpin_from(first)
        return self.memory.release(self.page_run_ranges(first, end))

    @property
    def pin_units(self) -> PinUnits | None:
        """The units locking the pool where its share follows the budget on a GPU host."""
        return self._pin_units

    def page_views(self, page: int) -> list[memoryview]:
        """The page's bytes as writable views of the pool's memory (``page_segments``)."""
        raw = self.raw_bytes()
        return [raw[o:o + n].data for o, n in self.page_segments(page)]

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

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosed(f"pool {self.spec.name} is closed", metadata={"pool": self.spec.name})

    def begin_copy(self) -> None:
        """A copy touches the pool's memory until ``end_copy``; refused once it is closing."""
        with self._lock:
            self._check_open()
            self._copies += 1

    def end_copy(self) -> None:
        with self._lock:
            self._copies -= 1
            if not self._copies:
                self._idle.notify_all()

    @property
    def copies_in_flight(self) -> int:
        return self._copies

    def close(self, wait_seconds: float = 10.0, remove_state: bool = False) -> bool:
        """Refuse new copies, wait up to ``wait_seconds`` for those in flight, then release
        the memory. Never unmaps under a copy: if one is still running the memory stays mapped
        (logged) and False is returned. Idempotent. State files stay for the next daemon
        unless ``remove_state`` (DeletePool)."""
        with self._lock:
            if self._closed and not self.components:
                return True
            self._closed = True
            if not self._idle.wait_for(lambda: self._copies == 0, timeout=wait_seconds):
                log.error("pool %s: %d copies still running after %.1fs; its memory stays "
                          "mapped", self.spec.name, self._copies, wait_seconds)
                return False
            self.components = []
        if self.memory is not None:
            self.memory.close()
        if self.state is not None:
            if remove_state:
                self.state.remove()
            else:
                self.state.close()
        return True
