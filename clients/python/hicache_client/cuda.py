"""Worker side of the CUDA path: export device KV buffers and events as CUDA IPC handles.

Everything travels as protobuf bytes, never pickle: per layer buffer the 64-byte
``cuIpcGetMemHandle`` handle of the allocation that holds it, the byte offset inside that
allocation, size, shape, strides, dtype, and the GPU's UUID (the daemon may number GPUs
differently). Memory CUDA IPC cannot share is refused here, before anything is sent, with
``BUFFER_NOT_SHAREABLE`` naming the cause: PyTorch's ``expandable_segments`` allocator and other
``cuMemCreate`` (VMM) memory, ``cudaMallocAsync`` pools, managed memory, host tensors.

Primitives:

- ``export_region(driver, address, nbytes)``: ``IpcRegion`` (handle, offset, device UUID).
- ``CudaDeviceBuffers.from_tensors(spec, buffers)``: descriptors for SGLang-style per-layer
  tensors ``buffers[member][role][layer]``; ``.from_regions(...)`` for raw device addresses.
- ``LayerEvents(count)``: worker-owned interprocess events (torch) and their handles, to pass to
  ``open_session(layer_events=...)``; ``wait(layer, stream)`` makes a stream wait for a layer.

The session must outlive every wait on its events, and the tensors must stay allocated while the
session is open: the daemon keeps their allocations mapped until the session ends.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hicache import layer_groups
from hicache.buffers import DeviceBufferSpec, layer_shapes, strided_span
from hicache.cuda_driver import (
    ATTR_DEVICE_ORDINAL,
    ATTR_IS_LEGACY_CUDA_IPC_CAPABLE,
    ATTR_IS_MANAGED,
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


def _tensor_dtype(t: torch.Tensor) -> DType:
    for d in DType:
        if d.torch_dtype == t.dtype:
            return d
    raise BufferNotShareable(f"dtype {t.dtype} is not a pool dtype",
                             metadata={"why": f"dtype {t.dtype}"})


class CudaDeviceBuffers:
    """Descriptors of a worker's GPU KV buffers, ready for ``open_session``."""

    def __init__(self, descriptors: list[DeviceBufferSpec]) -> None:
        self.descriptors = descriptors

    @classmethod
    def from_tensors(cls, buffers: Mapping[str, Mapping[Role, Sequence[torch.Tensor]]],
                     driver: CudaDriver | None = None) -> CudaDeviceBuffers:
        """``buffers[member][role][layer]``: CUDA tensors, contiguous or with explicit
        strides (the daemon checks geometry against the pool)."""
        drv = require_driver(driver)
        handles: dict[int, bytes] = {}
        out: list[DeviceBufferSpec] = []
        for member, roles in buffers.items():
            for role, layers in roles.items():
                for layer, t in enumerate(layers):
                    if not t.is_cuda:
                        raise _refuse(t.data_ptr(), f"the tensor is on {t.device}")
                    nbytes = _extent_bytes(t)
                    r = export_region(drv, t.data_ptr(), nbytes, handles)
                    out.append(DeviceBufferSpec(
                        member=member, role=role, layer=layer, shape=tuple(t.shape),
                        dtype=_tensor_dtype(t), strides=tuple(t.stride()),
                        transport="cuda_ipc", ipc_handle=r.handle, device_uuid=r.device_uuid,
                        offset=r.offset, nbytes=nbytes))
        return cls(out)

    @classmethod
    def from_regions(cls, spec: PoolSpec, device_tokens: int,
                     layer_address: Mapping[tuple[str, Role, int], int],
                     driver: CudaDriver | None = None) -> CudaDeviceBuffers:
        """Buffers laid out as SGLang's device pool for ``spec`` at raw device addresses
        (``layer_address[(member, role, layer)]``); rows = tokens + page_size (pages + 1 for
        page-granular components)."""
        drv = require_driver(driver)
        handles: dict[int, bytes] = {}
        out: list[DeviceBufferSpec] = []
        for name, geometry, comp, shape in layer_shapes(spec, device_tokens):
            nbytes = math.prod(shape) * comp.dtype.itemsize
            for layer in range(geometry.layer_num):
                r = export_region(drv, layer_address[(name, comp.role, layer)], nbytes, handles)
                out.append(DeviceBufferSpec(
                    member=name, role=comp.role, layer=layer, shape=shape, dtype=comp.dtype,
                    strides=(), transport="cuda_ipc", ipc_handle=r.handle,
                    device_uuid=r.device_uuid, offset=r.offset, nbytes=nbytes))
        return cls(out)


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
