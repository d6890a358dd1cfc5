"""Worker side of the CUDA path: export device KV buffers as CUDA IPC handles or, for memory
of the virtual memory management (VMM) API, as POSIX fds of its physical allocations; events
as CUDA IPC handles.

Everything travels as protobuf bytes, never pickle. Memory from ``cudaMalloc`` (PyTorch's
default caching allocator) goes as ``cuda_ipc``: per layer buffer the 64-byte
``cuIpcGetMemHandle`` handle of the allocation that holds it, the byte offset inside that
allocation, size, shape, strides, dtype, and the GPU's UUID (the daemon may number GPUs
differently). Memory from ``cuMemCreate`` + ``cuMemMap`` (vLLM 0.34's KV cache) goes as
``cuda_vmm``: the physical allocations ("chunks") that cover a buffer, found as NCCL finds a
registered buffer's (``cuMemGetAddressRange`` on VMM memory gives the one mapping holding the
address), each exported once as a POSIX fd (``cuMemRetainAllocationHandle``, then
``cuMemExportToShareableHandle``; the retained handle released), and per buffer the region
they make (chunks mapped back to back, in the worker's address order; buffers in adjacent
chunks share one region), its offset in it, size, shape, strides, dtype and GPU UUID; the fds
travel with the session's identity request (``open_session(fds=...)``). A session's buffers are
all one or all the other: a mixture is refused. Memory neither can share is refused here,
before anything is sent, with ``BUFFER_NOT_SHAREABLE`` naming the cause: VMM memory not created
exportable as a POSIX fd (PyTorch's ``expandable_segments``; vLLM without a connector that
declares ``KVCacheAccess.EXPORTS_FD``), ``cudaMallocAsync`` pools, managed memory, host tensors.

Primitives:

- ``export_region(driver, address, nbytes)``: ``IpcRegion`` (handle, offset, device UUID) of
  memory CUDA IPC can share.
- ``VmmExport(driver)``: a session's VMM chunks: ``add(address, nbytes)`` each buffer,
  ``regions()`` exports each chunk once and says each buffer's ``VmmRegion`` (chunks' fd
  indices and sizes, offset, device UUID); ``fds``, ``close()``.
- ``CudaDeviceBuffers.from_tensors(buffers)``: descriptors for SGLang-style per-layer tensors
  ``buffers[member][role][layer]``; ``.from_regions(...)`` for raw device addresses; ``.fds``
  (the exported chunks of ``cuda_vmm`` buffers, empty for ``cuda_ipc``: pass them as
  ``open_session(..., fds=bufs.fds)``) and ``close()`` (closes them, once no session will be
  opened with them again).
- ``LayerEvents(count)``: worker-owned interprocess events (torch) and their handles, to pass to
  ``open_session(layer_events=...)``; ``wait(layer, stream)`` makes a stream wait for a layer.

The session must outlive every wait on its events, and the tensors must stay allocated while the
session is open: the daemon keeps their allocations mapped until the session ends (a VMM
chunk's memory stays allocated while the daemon maps it, even past the engine's free).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType

import torch

from hicache import layer_groups
from hicache.buffers import MAX_FDS, DeviceBufferSpec, layer_shapes, strided_span
from hicache.cuda_driver import (
    ATTR_DEVICE_ORDINAL,
    ATTR_IS_LEGACY_CUDA_IPC_CAPABLE,
    ATTR_IS_MANAGED,
    MEM_LOCATION_TYPE_DEVICE,
    CudaCallFailed,
    CudaDriver,
    driver_problem,
    load_driver,
)
from hicache.errors import BufferNotShareable
from hicache.specs import DType, PoolSpec, Role

NOT_SHAREABLE_HINT = (
    "allocate the KV buffers with the default CUDA caching allocator (unset "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and backend:cudaMallocAsync for the "
    "worker) or with cudaMalloc")
NOT_EXPORTABLE_HINT = (
    "create it exportable as a POSIX fd (cuMemCreate with requestedHandleTypes = "
    "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; vLLM: a KV connector that declares "
    "KVCacheAccess.EXPORTS_FD), or allocate the KV cache without the VMM API (vLLM: "
    "--no-enable-extensible-kv-cache; PyTorch: unset PYTORCH_CUDA_ALLOC_CONF="
    "expandable_segments:True)")


@dataclass(frozen=True)
class IpcRegion:
    handle: bytes
    """cuIpcGetMemHandle of the allocation that holds the region."""
    offset: int
    """Bytes from the allocation's base to the region."""
    device_uuid: str


def _refuse(address: int, why: str) -> BufferNotShareable:
    return BufferNotShareable(f"device memory at {address:#x} cannot be shared over CUDA IPC: "
                              f"{why}; {NOT_SHAREABLE_HINT}",
                              metadata={"address": hex(address), "why": why})


def _refuse_vmm(address: int, why: str) -> BufferNotShareable:
    return BufferNotShareable(f"device memory at {address:#x} cannot be shared as VMM chunks: "
                              f"{why}; {NOT_EXPORTABLE_HINT}",
                              metadata={"address": hex(address), "why": why})


def require_driver(driver: CudaDriver | None = None) -> CudaDriver:
    drv = driver or load_driver()
    if drv is None:
        raise BufferNotShareable(f"no CUDA driver: {driver_problem()}",
                                 metadata={"why": "no CUDA driver"})
    return drv


def export_region(driver: CudaDriver, address: int, nbytes: int,
                  _handles: dict[int, bytes] | None = None) -> IpcRegion:
    """Handle, offset and GPU UUID of ``nbytes`` at ``address`` (refused when unshareable)."""
    try:
        managed = driver.pointer_attribute(ATTR_IS_MANAGED, address)
        ordinal = driver.pointer_attribute(ATTR_DEVICE_ORDINAL, address)
    except CudaCallFailed as exc:
        raise _refuse(address, f"not CUDA device memory ({exc.name})") from None
    if managed:
        raise _refuse(address, "managed (unified) memory")
    try:
        capable = driver.pointer_attribute(ATTR_IS_LEGACY_CUDA_IPC_CAPABLE, address)
    except CudaCallFailed:
        capable = 1  # older drivers: cuIpcGetMemHandle below decides
    if not capable:
        raise _refuse(address, "it comes from the virtual memory management API "
                               "(cuMemCreate: PyTorch expandable_segments) or a stream-ordered "
                               "memory pool")
    with driver.context(int(ordinal)):
        base, size = driver.address_range(address)
        if address + nbytes > base + size:
            raise _refuse(address, f"{nbytes} bytes run past the end of its allocation "
                                   f"({base + size - address} bytes left)")
        cached = _handles.get(base) if _handles is not None else None
        if cached is None:
            try:
                cached = driver.ipc_get_mem_handle(base)
            except CudaCallFailed as exc:
                raise _refuse(address, f"cuIpcGetMemHandle refused it ({exc.name})") from None
            if _handles is not None:
                _handles[base] = cached
    return IpcRegion(cached, address - base, driver.devices[int(ordinal)].uuid)


def _device_of(driver: CudaDriver, address: int) -> tuple[int, bool]:
    """(device ordinal, whether CUDA IPC can share it) of device memory at ``address``;
    refused when it is not device memory or managed."""
    try:
        managed = driver.pointer_attribute(ATTR_IS_MANAGED, address)
        ordinal = driver.pointer_attribute(ATTR_DEVICE_ORDINAL, address)
    except CudaCallFailed as exc:
        raise _refuse(address, f"not CUDA device memory ({exc.name})") from None
    if managed:
        raise _refuse(address, "managed (unified) memory")
    try:
        capable = driver.pointer_attribute(ATTR_IS_LEGACY_CUDA_IPC_CAPABLE, address)
    except CudaCallFailed:
        capable = 1  # older drivers: cuIpcGetMemHandle decides
    return int(ordinal), bool(capable)


@dataclass(frozen=True)
class VmmRegion:
    """Where a buffer lies in VMM memory, as the wire names it."""

    fd_indices: tuple[int, ...]
    """Each chunk's fd (its position in ``VmmExport.fds``), in the region's order."""
    chunk_bytes: tuple[int, ...]
    """Each chunk's mapped size."""
    offset: int
    """Bytes from the region's start to the buffer."""
    device_uuid: str


class VmmExport:
    """The VMM chunks a session's buffers lie in, each exported once as a POSIX fd.

    ``add`` every buffer, then ``regions()``; ``fds`` are this object's until ``close()``
    (``CudaDeviceBuffers`` owns them after ``from_tensors``)."""

    def __init__(self, driver: CudaDriver) -> None:
        self.driver = driver
        self.fds: list[int] = []
        self._ordinal = -1
        self._chunks: dict[int, int] = {}  # mapping's base -> its size
        self._buffers: list[tuple[int, int]] = []  # (address, first chunk's base)

    def add(self, address: int, nbytes: int, ordinal: int) -> None:
        """A buffer of ``nbytes`` at ``address`` on device ``ordinal``: the mappings covering
        it, one after another with no gap (``cuMemGetAddressRange`` gives each)."""
        if self._ordinal not in (-1, ordinal):
            raise _refuse_vmm(address, f"on device {ordinal}, the session's other buffers on "
                                       f"{self._ordinal}")
        self._ordinal = ordinal
        drv = self.driver
        with drv.context(ordinal):
            at, end, first = address, address + nbytes, -1
            while at < end:
                try:
                    base, size = drv.address_range(at)
                except CudaCallFailed as exc:
                    raise _refuse_vmm(address, f"{end - at} of its {nbytes} bytes, from {at:#x}, "
                                               f"are not mapped ({exc.name})") from None
                if size <= 0 or not base <= at < base + size:
                    raise _refuse_vmm(address, f"cuMemGetAddressRange says [{base:#x}, +{size}) "
                                               f"holds {at:#x}")
                self._chunks[base] = size
                first = base if first < 0 else first
                at = base + size
        self._buffers.append((address, first))

    def regions(self) -> list[VmmRegion]:
        """Each chunk exported (once), and the region of every buffer added, in order. The
        region is the run of chunks that follow each other in this process's addresses, so
        buffers in adjacent chunks share one; refused (nothing kept open) when a chunk is not
        exportable or there are more than ``MAX_FDS``."""
        drv, ordinal = self.driver, self._ordinal
        if len(self._chunks) > MAX_FDS:
            first = min(self._chunks)
            raise _refuse_vmm(first, f"the buffers lie in {len(self._chunks)} physical "
                                     f"allocations; a session may hand over at most {MAX_FDS} "
                                     "fds (allocate fewer, larger chunks)")
        runs: list[list[int]] = []
        for base in sorted(self._chunks):
            if runs and runs[-1][-1] + self._chunks[runs[-1][-1]] == base:
                runs[-1].append(base)
            else:
                runs.append([base])
        index: dict[int, int] = {}
        try:
            with drv.context(ordinal):
                for run in runs:
                    for base in run:
                        index[base] = len(self.fds)
                        self.fds.append(self._export(base, ordinal))
        except BaseException:
            self.close()
            raise
        uuid = drv.devices[ordinal].uuid
        run_of = {base: run for run in runs for base in run}
        out = []
        for address, first in self._buffers:
            run = run_of[first]
            out.append(VmmRegion(tuple(index[b] for b in run),
                                 tuple(self._chunks[b] for b in run), address - run[0], uuid))
        return out

    def _export(self, base: int, ordinal: int) -> int:
        """The chunk mapped at ``base`` as a new POSIX fd (the caller holds the context)."""
        drv = self.driver
        try:
            handle = drv.mem_retain_handle(base)
        except CudaCallFailed as exc:
            raise _refuse(base, f"it is neither CUDA IPC memory nor mapped by cuMemMap "
                                f"(cuMemRetainAllocationHandle: {exc.name}): a stream-ordered "
                                "memory pool (cudaMallocAsync)?") from None
        try:
            try:
                props = drv.mem_properties(handle)
            except CudaCallFailed as exc:
                raise _refuse_vmm(base, f"its allocation's properties cannot be read "
                                        f"({exc.name})") from None
            if props.location_type != MEM_LOCATION_TYPE_DEVICE or props.device != ordinal:
                raise _refuse_vmm(base, f"its physical allocation is not on device {ordinal} "
                                        f"(location type {props.location_type}, id "
                                        f"{props.device})")
            if not props.exports_fd:
                raise _refuse_vmm(base, "its physical allocation was not created exportable "
                                        f"as a POSIX fd (handle types {props.handle_types})")
            try:
                fd = drv.mem_export_fd(handle)
            except CudaCallFailed as exc:
                raise _refuse_vmm(base, f"cuMemExportToShareableHandle refused it "
                                        f"({exc.name})") from None
            os.set_inheritable(fd, False)  # the engine's child processes get no reference
            return fd
        finally:
            drv.mem_release(handle)

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)


def _tensor_dtype(t: torch.Tensor) -> DType:
    for d in DType:
        if d.torch_dtype == t.dtype:
            return d
    raise BufferNotShareable(f"dtype {t.dtype} is not a pool dtype",
                             metadata={"why": f"dtype {t.dtype}"})


@dataclass(frozen=True)
class _Buffer:
    """One buffer to describe: where it is and what it holds."""

    member: str
    role: Role
    layer: int
    shape: tuple[int, ...]
    dtype: DType
    strides: tuple[int, ...]
    address: int
    nbytes: int


class CudaDeviceBuffers:
    """Descriptors of a worker's GPU KV buffers, ready for ``open_session``, and the fds of
    their VMM chunks (``cuda_vmm`` sessions), which this object owns until ``close()``."""

    def __init__(self, descriptors: list[DeviceBufferSpec], fds: Sequence[int] = ()) -> None:
        self.descriptors = descriptors
        self.fds: list[int] = list(fds)
        """One exported POSIX fd per VMM chunk (``cuda_vmm`` buffers' ``fd_indices`` index it);
        empty for ``cuda_ipc``. Pass as ``open_session(..., fds=...)`` (``Handover.fds``)."""

    @property
    def transport(self) -> str:
        """``cuda_ipc`` or ``cuda_vmm``: how every buffer of this session travels."""
        return self.descriptors[0].transport if self.descriptors else "cuda_ipc"

    def close(self) -> None:
        """Close the exported fds (the daemon holds what it imported). Call it once no session
        will be opened with them again: an integration that re-opens its session after a
        daemon restart (``DaemonLink``) keeps them until it closes. Idempotent."""
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> CudaDeviceBuffers:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @classmethod
    def from_tensors(cls, buffers: Mapping[str, Mapping[Role, Sequence[torch.Tensor]]],
                     driver: CudaDriver | None = None) -> CudaDeviceBuffers:
        """``buffers[member][role][layer]``: CUDA tensors, contiguous or with explicit
        strides (the daemon checks geometry against the pool), all in memory CUDA IPC can
        share or all in exportable VMM memory."""
        items: list[_Buffer] = []
        for member, roles in buffers.items():
            for role, layers in roles.items():
                for layer, t in enumerate(layers):
                    if not t.is_cuda:
                        raise _refuse(t.data_ptr(), f"the tensor is on {t.device}")
                    items.append(_Buffer(member, role, layer, tuple(t.shape), _tensor_dtype(t),
                                         tuple(t.stride()), t.data_ptr(), _extent_bytes(t)))
        return cls._describe(require_driver(driver), items)

    @classmethod
    def from_regions(cls, spec: PoolSpec, device_tokens: int,
                     layer_address: Mapping[tuple[str, Role, int], int],
                     driver: CudaDriver | None = None) -> CudaDeviceBuffers:
        """Buffers laid out as SGLang's device pool for ``spec`` at raw device addresses
        (``layer_address[(member, role, layer)]``); rows = tokens + page_size (pages + 1 for
        page-granular components)."""
        items: list[_Buffer] = []
        for name, geometry, comp, shape in layer_shapes(spec, device_tokens):
            nbytes = math.prod(shape) * comp.dtype.itemsize
            items.extend(_Buffer(name, comp.role, layer, shape, comp.dtype, (),
                                 layer_address[(name, comp.role, layer)], nbytes)
                         for layer in range(geometry.layer_num))
        return cls._describe(require_driver(driver), items)

    @classmethod
    def _describe(cls, drv: CudaDriver, items: Sequence[_Buffer]) -> CudaDeviceBuffers:
        """``cuda_ipc`` descriptors when CUDA IPC can share every buffer, ``cuda_vmm`` ones
        (and their fds) when none; a mixture is refused."""
        where = [_device_of(drv, b.address) for b in items]
        vmm = [b for b, (_, capable) in zip(items, where, strict=True) if not capable]
        if not vmm:
            handles: dict[int, bytes] = {}
            out = []
            for b in items:
                r = export_region(drv, b.address, b.nbytes, handles)
                out.append(DeviceBufferSpec(
                    member=b.member, role=b.role, layer=b.layer, shape=b.shape, dtype=b.dtype,
                    strides=b.strides, transport="cuda_ipc", ipc_handle=r.handle,
                    device_uuid=r.device_uuid, offset=r.offset, nbytes=b.nbytes))
            return cls(out)
        if len(vmm) < len(items):
            ipc = next(b for b, (_, capable) in zip(items, where, strict=True) if capable)
            raise _refuse_vmm(vmm[0].address, f"{vmm[0].member}.{vmm[0].role.value} layer "
                                              f"{vmm[0].layer} is VMM memory but "
                                              f"{ipc.member}.{ipc.role.value} layer {ipc.layer} "
                                              "is not: a session's buffers travel one way "
                                              "(all CUDA IPC or all VMM chunks)")
        export = VmmExport(drv)
        for b, (ordinal, _) in zip(items, where, strict=True):
            export.add(b.address, b.nbytes, ordinal)
        regions = export.regions()
        out = [DeviceBufferSpec(
            member=b.member, role=b.role, layer=b.layer, shape=b.shape, dtype=b.dtype,
            strides=b.strides, transport="cuda_vmm", fd_indices=r.fd_indices,
            chunk_bytes=r.chunk_bytes, device_uuid=r.device_uuid, offset=r.offset,
            nbytes=b.nbytes) for b, r in zip(items, regions, strict=True)]
        return cls(out, export.fds)


def _extent_bytes(t: torch.Tensor) -> int:
    return strided_span(t.shape, t.stride()) * t.element_size()


class LayerEvents:
    """Interprocess CUDA events owned by the worker, one per layer group of a load."""

    def __init__(self, count: int, device: torch.device | int | None = None) -> None:
        if count < 1:
            raise ValueError("at least one layer event")
        with torch.cuda.device(device):
            self.events = [torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
                           for _ in range(count)]
            for e in self.events:  # an event must be recorded once before it is shared
                e.record()
        self.handles: list[bytes] = [
            bytes(e.ipc_handle()) for e in self.events]  # type: ignore[no-untyped-call]

    def wait(self, group: int, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: current) wait until layer group ``group`` has landed
        (with one event per layer, the group is the layer)."""
        (stream or torch.cuda.current_stream()).wait_event(self.events[group])

    def group_of(self, layer: int, layer_num: int) -> int:
        """The event that covers ``layer``: groups of ceil(layer_num / events) layers."""
        return layer_groups.group_of(layer, layer_num, len(self.events))


class ReadyEvent:
    """An interprocess event the worker records before each backup/load; the daemon's streams
    wait on it, so a copy never reads KV the worker's kernels are still writing (and never
    overwrites pages they still read) without a host-side synchronize."""

    def __init__(self, device: torch.device | int | None = None) -> None:
        with torch.cuda.device(device):
            self.event = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
            self.event.record()
        self.handle = bytes(self.event.ipc_handle())  # type: ignore[no-untyped-call]

    def record(self, stream: torch.cuda.Stream | None = None) -> None:
        self.event.record(stream or torch.cuda.current_stream())
