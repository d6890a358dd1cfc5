"""Attaching worker GPU buffers that live in CUDA virtual memory: chunks passed as POSIX fds.

Memory from the virtual memory management (VMM) API (``cuMemCreate`` + ``cuMemMap``: vLLM
0.34's KV cache) has no CUDA IPC handle. A worker exports each physical allocation ("chunk")
holding its buffers as a POSIX fd (``cuMemExportToShareableHandle``) and passes the fds over the
identity socket with the session's token, as memfds travel. Each buffer names its region: the
fds of its chunks (positions among those passed) and their sizes, in the order the worker maps
them back to back, and its offset in the region. Buffers naming the same chunks share the
region; a chunk belongs to one region and appears in it once, so a session maps at most one
chunk per fd it handed over.

Primitives:

- ``plan_regions(buffers, fd_count)``: the session's regions from its descriptors, checked
  before the driver is touched: at most ``MAX_FDS`` fds and chunks per region, every fd index
  among those passed and named once per region, no chunk in two regions (``FD_REJECTED``),
  chunk sizes positive and the same wherever a region is named again, every buffer inside its
  region (``IPC_HANDLE_INVALID``); the ``VmmPlan`` (regions, each buffer's region).
- ``VmmMapping.map(driver, ordinal, plan, fds, stats)`` (the caller holds the device's
  context): each chunk's size a multiple of the device's granularity, and all of them together
  no larger than its memory (checked before anything is imported); each fd imported once
  (``cuMemImportFromShareableHandle``) and its allocation found on ``ordinal``
  (``cuMemGetAllocationPropertiesFromHandle``); one address range reserved per region, its
  chunks mapped there back to back, read / write access for the device; the imported handles
  released once mapped (the mappings hold the memory). A failure part-way undoes what was done
  and raises ``IPC_HANDLE_INVALID`` naming the buffer, the chunk, its fd and the CUDA error
  (``FD_REJECTED`` for an fd the process cannot even stat). ``address(i)``: where buffer ``i``
  is in this process; ``release()``: every chunk unmapped, every range freed (idempotent; the
  attachment calls it after the session's last copy).
- ``VmmStats``: the chunks mapped and their bytes, over every session (the metrics).

The fds stay the caller's: the session closes them once this returns (the import holds the
memory, whatever the worker does next, so a copy never runs on memory that went away).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from hicache.buffers import MAX_FDS, DeviceBufferSpec
from hicache.cuda_driver import MEM_LOCATION_TYPE_DEVICE, CudaCallFailed, CudaDriver
from hicache.errors import FdRejected, IpcHandleInvalid
from hicache.locks import lock

log = logging.getLogger(__name__)


def _invalid(i: int, why: str, **meta: object) -> IpcHandleInvalid:
    return IpcHandleInvalid(f"buffers[{i}] (cuda_vmm): {why}",
                            metadata={"buffer": i, "transport": "cuda_vmm", **meta})


def _rejected(i: int, fd_index: int, why: str) -> FdRejected:
    return FdRejected(f"buffers[{i}] (cuda_vmm): fd {fd_index} rejected: {why}",
                      metadata={"buffer": i, "fd_index": fd_index, "why": why})


@dataclass(frozen=True)
class Region:
    """A run of chunks mapped back to back."""

    fd_indices: tuple[int, ...]
    chunk_bytes: tuple[int, ...]
    first_buffer: int
    """The first buffer naming it (errors name that one)."""

    @property
    def nbytes(self) -> int:
        return sum(self.chunk_bytes)


@dataclass(frozen=True)
class VmmPlan:
    regions: tuple[Region, ...]
    region_of: tuple[int, ...]
    """Each buffer's region (index into ``regions``)."""
    offsets: tuple[int, ...]
    """Each buffer's offset in its region."""


def plan_regions(buffers: Sequence[DeviceBufferSpec], fd_count: int) -> VmmPlan:
    """The regions ``buffers`` (all ``cuda_vmm``, extents checked) lie in, from the
    descriptors alone."""
    if fd_count > MAX_FDS:
        raise FdRejected(f"{fd_count} fds came with the session; at most {MAX_FDS}",
                         metadata={"fds": fd_count, "why": f"more than {MAX_FDS}"})
    regions: list[Region] = []
    by_chunks: dict[tuple[int, ...], int] = {}
    owner: dict[int, int] = {}  # fd index -> the region holding it
    region_of: list[int] = []
    for i, b in enumerate(buffers):
        chunks = tuple(b.fd_indices)
        if not chunks or len(b.chunk_bytes) != len(chunks):
            raise _invalid(i, f"names {len(chunks)} chunk fd(s) and {len(b.chunk_bytes)} "
                              "chunk size(s): one of each per chunk, at least one",
                           chunks=len(chunks))
        if len(chunks) > MAX_FDS:
            raise _rejected(i, chunks[MAX_FDS], f"its region names {len(chunks)} chunks; a "
                                                f"session hands over at most {MAX_FDS} fds")
        got = by_chunks.get(chunks)
        if got is None:
            for c, k in enumerate(chunks):
                if not 0 <= k < fd_count:
                    raise _rejected(i, k, f"chunk {c} names fd {k}, {fd_count} were handed "
                                          "over with the session's peer_token")
                if k in chunks[:c]:
                    raise _rejected(i, k, f"chunk {c} names fd {k} again: a region maps each "
                                          "chunk once")
                if k in owner:
                    raise _rejected(i, k, f"chunk {c} (fd {k}) is also in the region of "
                                          f"buffers[{regions[owner[k]].first_buffer}]: a chunk "
                                          "belongs to one region")
            for c, n in enumerate(b.chunk_bytes):
                if n <= 0:
                    raise _invalid(i, f"chunk {c} (fd {chunks[c]}) has {n} bytes", chunk=c,
                                   fd_index=chunks[c])
            got = by_chunks[chunks] = len(regions)
            regions.append(Region(chunks, tuple(b.chunk_bytes), i))
            owner.update((k, got) for k in chunks)
        elif tuple(b.chunk_bytes) != regions[got].chunk_bytes:
            raise _invalid(i, f"its chunks' sizes differ from those buffers["
                              f"{regions[got].first_buffer}] gives the same chunks")
        size = regions[got].nbytes
        if b.offset + b.nbytes > size:
            raise _invalid(i, f"bytes [{b.offset}, {b.offset + b.nbytes}) leave the {size}-byte "
                              "region its chunks make", region_bytes=size)
        region_of.append(got)
    return VmmPlan(tuple(regions), tuple(region_of), tuple(b.offset for b in buffers))


class VmmStats:
    """Chunks mapped by every session of the process, and their bytes."""

    def __init__(self) -> None:
        self._chunks = self._bytes = 0
        self._lock = lock("cuda_vmm.mappings")

    def add(self, chunks: int, nbytes: int) -> None:
        with self._lock:
            self._chunks += chunks
            self._bytes += nbytes

    def __call__(self) -> tuple[int, int]:
        """(chunks mapped, their bytes)."""
        with self._lock:
            return self._chunks, self._bytes


class VmmMapping:
    """One session's regions, mapped in this process."""

    def __init__(self, driver: CudaDriver, plan: VmmPlan, stats: VmmStats) -> None:
        self._driver = driver
        self._plan = plan
        self._stats = stats
        self._bases: list[int] = []  # each region's reserved range, as reserved so far
        self._mapped: list[tuple[int, int]] = []  # (address, bytes) of each chunk mapped
        self._counted = (0, 0)

    @classmethod
    def map(cls, driver: CudaDriver, ordinal: int, plan: VmmPlan, fds: Sequence[int],
            stats: VmmStats) -> VmmMapping:
        """Import, reserve, map and grant access (the caller holds ``ordinal``'s context)."""
        self = cls(driver, plan, stats)
        granularity = driver.mem_granularity(ordinal)
        memory = driver.devices[ordinal].total_bytes
        for r in plan.regions:  # sizes first: nothing imported for a plan that cannot map
            for c, (k, n) in enumerate(zip(r.fd_indices, r.chunk_bytes, strict=True)):
                if n % granularity or n > memory:
                    raise _invalid(r.first_buffer, f"chunk {c} (fd {k}) has {n} bytes, not a "
                                                   f"multiple of the device's {granularity}-byte "
                                                   f"granularity within its {memory} bytes",
                                   chunk=c, fd_index=k, chunk_bytes=n)
        total = sum(r.nbytes for r in plan.regions)
        if total > memory:  # every chunk is memory of this one GPU
            raise _invalid(plan.regions[-1].first_buffer, f"its session's chunks add up to "
                                                          f"{total} bytes, more than the GPU's "
                                                          f"{memory}", region_bytes=total)
        handles: dict[int, int] = {}  # fd index -> imported handle
        try:
            for r in plan.regions:
                for c, k in enumerate(r.fd_indices):
                    handles[k] = self._import(r.first_buffer, c, k, fds[k], ordinal)
            for r in plan.regions:
                self._map_region(r, handles, ordinal)
        except BaseException:
            self.release()
            raise
        finally:
            for h in handles.values():
                try:
                    driver.mem_release(h)  # the mappings hold the memory now
                except CudaCallFailed as exc:
                    log.warning("releasing an imported VMM handle failed: %s", exc)
        self._counted = (len(self._mapped), sum(n for _, n in self._mapped))
        stats.add(*self._counted)
        return self

    def _import(self, i: int, c: int, k: int, fd: int, ordinal: int) -> int:
        drv = self._driver
        try:
            os.fstat(fd)
        except OSError as exc:
            raise _rejected(i, k, f"cannot stat: {exc.strerror}") from None
        try:
            handle = drv.mem_import_fd(fd)
        except CudaCallFailed as exc:
            raise _invalid(i, f"chunk {c} (fd {k}) cannot be imported: {exc.name} (not a "
                              "cuMemExportToShareableHandle fd of a POSIX-fd-exportable "
                              "allocation)", chunk=c, fd_index=k, cuda_error=exc.name) from None
        try:
            props = drv.mem_properties(handle)
            if props.location_type != MEM_LOCATION_TYPE_DEVICE or props.device != ordinal:
                raise _invalid(i, f"chunk {c} (fd {k}) is memory of location type "
                                  f"{props.location_type} id {props.device}, not of the "
                                  f"session's GPU (device {ordinal} here)", chunk=c,
                               fd_index=k)
        except CudaCallFailed as exc:
            drv.mem_release(handle)
            raise _invalid(i, f"chunk {c} (fd {k}): its properties cannot be read: "
                              f"{exc.name}", chunk=c, fd_index=k, cuda_error=exc.name) from None
        except BaseException:
            drv.mem_release(handle)
            raise
        return handle

    def _map_region(self, r: Region, handles: dict[int, int], ordinal: int) -> None:
        drv, i = self._driver, r.first_buffer
        try:
            base = drv.mem_address_reserve(r.nbytes)
        except CudaCallFailed as exc:
            raise _invalid(i, f"{r.nbytes} bytes of addresses for its region cannot be "
                              f"reserved: {exc.name}", region_bytes=r.nbytes,
                           cuda_error=exc.name) from None
        self._bases.append(base)
        at = base
        for c, (k, n) in enumerate(zip(r.fd_indices, r.chunk_bytes, strict=True)):
            try:
                drv.mem_map(at, n, handles[k])
            except CudaCallFailed as exc:
                raise _invalid(i, f"chunk {c} (fd {k}) cannot be mapped ({n} bytes): "
                                  f"{exc.name} (is its allocation smaller?)", chunk=c,
                               fd_index=k, chunk_bytes=n, cuda_error=exc.name) from None
            self._mapped.append((at, n))
            try:
                drv.mem_set_access(at, n, ordinal)
            except CudaCallFailed as exc:
                raise _invalid(i, f"chunk {c} (fd {k}): read / write access for device "
                                  f"{ordinal} refused: {exc.name}", chunk=c, fd_index=k,
                               cuda_error=exc.name) from None
            at += n

    def address(self, i: int) -> int:
        """Where buffer ``i`` starts in this process."""
        return self._bases[self._plan.region_of[i]] + self._plan.offsets[i]

    @property
    def chunks(self) -> int:
        return len(self._mapped)

    def release(self) -> None:
        """Unmap every chunk and free every range (the caller holds the context; copies
        using them have ended). Idempotent; a failure is logged and the rest still go."""
        drv = self._driver
        mapped, self._mapped = self._mapped, []
        bases, self._bases = self._bases, []
        for address, n in mapped:
            try:
                drv.mem_unmap(address, n)
            except CudaCallFailed as exc:
                log.warning("unmapping a VMM chunk at %#x failed: %s", address, exc)
        for base, r in zip(bases, self._plan.regions, strict=False):
            try:
                drv.mem_address_free(base, r.nbytes)
            except CudaCallFailed as exc:
                log.warning("freeing a VMM address range at %#x failed: %s", base, exc)
        counted, self._counted = self._counted, (0, 0)
        if counted != (0, 0):
            self._stats.add(-counted[0], -counted[1])
