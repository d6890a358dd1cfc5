"""The CUDA driver API through ctypes: loaded on first use, never at import.

Nothing here needs a CUDA build of torch or CUDA headers: ``libcuda.so.1`` ships with the NVIDIA
driver, and its API is stable across driver versions. Both sides use this one wrapper: workers
to export their KV buffers and events as IPC handles (and to refuse memory that cannot be
shared), the daemon to open them. The daemon uses the driver directly so it controls exactly
when IPC mappings open and close (torch's own IPC path closes them whenever the garbage
collector drops the last storage). Importing this module loads no library.

Primitives:

- ``load_driver(path=None)``: the process-wide ``CudaDriver`` for a library path (argument, else
  ``$HICACHED_CUDA_DRIVER``, else ``libcuda.so.1``), or ``None`` when it cannot be loaded or
  initialised (hosts without a GPU). ``driver_problem(path)`` says why.
- ``CudaDriver``: devices (ordinal <-> UUID, attributes, ``arch``), ``context(ordinal)`` (pushes
  the device's primary context for the calling thread), IPC memory handles (get / open /
  close), pointer attributes, streams, events (interprocess handles too, timed ones),
  asynchronous 1-D and 2-D copies and batches of 1-D copies (``memcpy_batch_async``, where the
  driver has ``cuMemcpyBatchAsync``), host memory registration (mapped into the device's
  address space) and page-locked allocations, device allocation, modules and kernel
  launches; the virtual memory management (VMM) API: physical allocations (``mem_create``,
  ``mem_retain_handle``, ``mem_release``, ``mem_properties``, ``mem_granularity``) exported and
  imported as POSIX fds (``mem_export_fd`` / ``mem_import_fd``), address ranges reserved and
  freed, allocations mapped and unmapped in them and made accessible to a device
  (``mem_set_access``).
- ``VmmAllocation``: what ``mem_properties`` reads of a physical allocation: its device and
  the handle types it may be exported as.
- ``CudaCallFailed``: a driver call returned an error: the call, the ``CUresult`` and its name.
- ``format_uuid`` / ``normalize_uuid``: ``GPU-xxxxxxxx-xxxx-...`` as ``nvidia-smi`` prints it.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from hicache.locks import lock

DEFAULT_LIBRARY = "libcuda.so.1"
ENV_LIBRARY = "HICACHED_CUDA_DRIVER"
IPC_HANDLE_SIZE = 64

# CUpointer_attribute
ATTR_MEMORY_TYPE = 2
ATTR_IS_MANAGED = 8
ATTR_DEVICE_ORDINAL = 9
ATTR_IS_LEGACY_CUDA_IPC_CAPABLE = 10
ATTR_RANGE_START_ADDR = 11
ATTR_RANGE_SIZE = 12
# flags
# CUdevice_attribute
DEV_ATTR_MULTIPROCESSOR_COUNT = 16
DEV_ATTR_UNIFIED_ADDRESSING = 41
DEV_ATTR_COMPUTE_CAPABILITY_MAJOR = 75
DEV_ATTR_COMPUTE_CAPABILITY_MINOR = 76
DEV_ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91
EVENT_BLOCKING_SYNC = 0x1
EVENT_DISABLE_TIMING = 0x2
EVENT_INTERPROCESS = 0x4
STREAM_NON_BLOCKING = 0x1
IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
ERROR_NOT_READY = 600
MEMHOSTREGISTER_PORTABLE = 0x1
MEMHOSTREGISTER_DEVICEMAP = 0x2
MEMHOSTALLOC_PORTABLE = 0x1
MEMHOSTALLOC_DEVICEMAP = 0x2
MEMORYTYPE_UNIFIED = 4
# CUmemcpyAttributes of cuMemcpyBatchAsync
MEMCPY_SRC_ACCESS_ORDER_STREAM = 0x1
MEM_LOCATION_TYPE_DEVICE = 0x1
MEM_LOCATION_TYPE_HOST = 0x2
# the VMM API: CUmemAllocationType, CUmemAllocationHandleType, CUmemAccess_flags,
# CUmemAllocationGranularity_flags
MEM_ALLOCATION_TYPE_PINNED = 0x1
MEM_HANDLE_TYPE_NONE = 0x0
MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
MEM_ALLOC_GRANULARITY_MINIMUM = 0x0


class CudaCallFailed(RuntimeError):
    """A CUDA driver call returned an error."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.call = call
        self.code = code
        self.name = name


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_SIZE)]

    @classmethod
    def from_bytes(cls, raw: bytes) -> IpcHandle:
        if len(raw) != IPC_HANDLE_SIZE:
            raise ValueError(f"an IPC handle is {IPC_HANDLE_SIZE} bytes, got {len(raw)}")
        h = cls()
        ctypes.memmove(ctypes.addressof(h), raw, IPC_HANDLE_SIZE)
        return h

    def to_bytes(self) -> bytes:
        return bytes(self.reserved)


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class Memcpy2D(ctypes.Structure):
    """CUDA_MEMCPY2D (v2)."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int), ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]


class MemLocation(ctypes.Structure):
    """CUmemLocation."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class MemAllocationProp(ctypes.Structure):
    """CUmemAllocationProp (v1), as cuda.h of CUDA 12.x and 13.0 declare it (the 13.0.0
    cuda-python bindings, generated from that header, have the same fields): enum type, enum
    requestedHandleTypes, CUmemLocation location (enum type, int id), void*
    win32HandleMetaData, then allocFlags {uchar compressionType, uchar gpuDirectRDMACapable,
    ushort usage, uchar reserved[4]}: 32 bytes on x86-64 and aarch64 (4 + 4 + 8 + 8 + 8)."""

    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", MemLocation), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", _AllocFlags)]


class MemAccessDesc(ctypes.Structure):
    """CUmemAccessDesc (v1), same headers: CUmemLocation location, enum flags (12 bytes)."""

    _fields_ = [("location", MemLocation), ("flags", ctypes.c_int)]


assert ctypes.sizeof(MemAllocationProp) == 32 and ctypes.sizeof(MemAccessDesc) == 12


@dataclass(frozen=True)
class VmmAllocation:
    """A physical allocation of the VMM API, as ``cuMemGetAllocationPropertiesFromHandle``
    reads it."""

    location_type: int
    """``CU_MEM_LOCATION_TYPE_*``: 1 for device memory."""
    device: int
    """The device ordinal (this process's) when ``location_type`` is a device."""
    handle_types: int
    """The ``CU_MEM_HANDLE_TYPE_*`` bits it was created exportable as."""

    @property
    def exports_fd(self) -> bool:
        return bool(self.handle_types & MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)


class MemcpyAttributes(ctypes.Structure):
    """CUmemcpyAttributes (CUDA 12.8)."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", MemLocation),
                ("dstLocHint", MemLocation), ("flags", ctypes.c_uint)]


def format_uuid(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def normalize_uuid(text: str) -> str:
    """``GPU-`` prefixed, lower case; accepts the bare form torch prints."""
    t = text.strip().lower()
    if t.startswith("gpu-"):
        t = t[4:]
    return "GPU-" + t


@dataclass(frozen=True)
class DeviceInfo:
    ordinal: int
    uuid: str
    name: str
    total_bytes: int


class CudaDriver:
    """One loaded driver library. Thread-safe; every call that needs a context takes one
    through ``context(ordinal)``."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self._lib = lib
        self.path = path
        self._fns: dict[str, Any] = {}
        self._ctx: dict[int, ctypes.c_void_p] = {}
        self._lock = lock("cuda_driver")
        self._call("cuInit", ctypes.c_uint(0))
        self.devices = self._enumerate()

    # -- plumbing ----------------------------------------------------------------------------

    def fn(self, name: str, exact: bool = False) -> Any:
        """The driver entry point for ``name``: its ``_v2`` export when there is one, as
        ``cuda.h`` maps the name (``exact``: that symbol only, for the calls ``cuda.h`` maps to
        themselves, as it does the VMM API's)."""
        got = self._fns.get(name)
        if got is None:
            for symbol in (name,) if exact else (name + "_v2", name):
                try:
                    got = getattr(self._lib, symbol)
                    break
                except AttributeError:
                    continue
            else:
                raise CudaCallFailed(name, -1, "not exported by " + self.path)
            got.restype = ctypes.c_int
            self._fns[name] = got
        return got

    def fn_address(self, name: str) -> int:
        return int(ctypes.cast(self.fn(name), ctypes.c_void_p).value or 0)

    def error_name(self, code: int) -> str:
        out = ctypes.c_char_p()
        try:
            if self.fn("cuGetErrorName")(ctypes.c_int(code), ctypes.byref(out)) == 0 \
                    and out.value:
                return out.value.decode()
        except CudaCallFailed:
            pass
        return f"CUDA_ERROR_{code}"

    def _call(self, name: str, *args: object) -> None:
        rc = int(self.fn(name)(*args))
        if rc != 0:
            raise CudaCallFailed(name, rc, self.error_name(rc))

    def _call_exact(self, name: str, *args: object) -> None:
        rc = int(self.fn(name, exact=True)(*args))
        if rc != 0:
            raise CudaCallFailed(name, rc, self.error_name(rc))

    # -- devices and contexts ----------------------------------------------------------------

    def _enumerate(self) -> tuple[DeviceInfo, ...]:
        count = ctypes.c_int()
        self._call("cuDeviceGetCount", ctypes.byref(count))
        out = []
        for i in range(count.value):
            dev = ctypes.c_int()
            self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(i))
            uuid = _Uuid()
            self._call("cuDeviceGetUuid", ctypes.byref(uuid), dev)
            name = ctypes.create_string_buffer(256)
            self._call("cuDeviceGetName", name, ctypes.c_int(256), dev)
            total = ctypes.c_size_t()
            self._call("cuDeviceTotalMem", ctypes.byref(total), dev)
            out.append(DeviceInfo(i, format_uuid(bytes(uuid.bytes)), name.value.decode(),
                                  total.value))
        return tuple(out)

    def attribute(self, attribute: int, ordinal: int) -> int:
        """A ``CUdevice_attribute`` of a device."""
        dev, out = ctypes.c_int(), ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
        self._call("cuDeviceGetAttribute", ctypes.byref(out), ctypes.c_int(attribute), dev)
        return out.value

    def arch(self, ordinal: int) -> str:
        """The device's architecture as compilers name it: ``sm_90`` for compute 9.0."""
        return (f"sm_{self.attribute(DEV_ATTR_COMPUTE_CAPABILITY_MAJOR, ordinal)}"
                f"{self.attribute(DEV_ATTR_COMPUTE_CAPABILITY_MINOR, ordinal)}")

    def version(self) -> int:
        """The driver's CUDA version (12080 for 12.8)."""
        out = ctypes.c_int()
        self._call("cuDriverGetVersion", ctypes.byref(out))
        return out.value

    def ordinal_of(self, uuid: str) -> int | None:
        want = normalize_uuid(uuid)
        for d in self.devices:
            if d.uuid == want:
                return d.ordinal
        return None

    def _primary(self, ordinal: int) -> ctypes.c_void_p:
        with self._lock:
            ctx = self._ctx.get(ordinal)
            if ctx is None:
                dev = ctypes.c_int()
                self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
                ctx = ctypes.c_void_p()
                self._call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
                self._ctx[ordinal] = ctx
            return ctx

    @contextmanager
    def context(self, ordinal: int) -> Iterator[None]:
        """Make the device's primary context current on this thread for the block."""
        self._call("cuCtxPushCurrent", self._primary(ordinal))
        try:
            yield
        finally:
            popped = ctypes.c_void_p()
            self._call("cuCtxPopCurrent", ctypes.byref(popped))

    # -- memory ------------------------------------------------------------------------------

    def pointer_attribute(self, attribute: int, address: int) -> int:
        out = ctypes.c_uint64(0)
        self._call("cuPointerGetAttribute", ctypes.byref(out), ctypes.c_int(attribute),
                   ctypes.c_uint64(address))
        return out.value

    def address_range(self, address: int) -> tuple[int, int]:
        """(base, size) of the allocation that contains ``address``."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._call("cuMemGetAddressRange", ctypes.byref(base), ctypes.byref(size),
                   ctypes.c_uint64(address))
        return base.value, size.value

    def ipc_get_mem_handle(self, base: int) -> bytes:
        h = IpcHandle()
        self._call("cuIpcGetMemHandle", ctypes.byref(h), ctypes.c_uint64(base))
        return h.to_bytes()

    def ipc_open_mem_handle(self, handle: bytes) -> int:
        """Map another process's allocation into the current context; returns its address."""
        ptr = ctypes.c_uint64()
        self._call("cuIpcOpenMemHandle", ctypes.byref(ptr), IpcHandle.from_bytes(handle),
                   ctypes.c_uint(IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
        return ptr.value

    def ipc_close_mem_handle(self, address: int) -> None:
        self._call("cuIpcCloseMemHandle", ctypes.c_uint64(address))

    def mem_alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self._call("cuMemAlloc", ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        return ptr.value

    def mem_free(self, address: int) -> None:
        self._call("cuMemFree", ctypes.c_uint64(address))

    def host_register(self, address: int, nbytes: int) -> None:
        """Page-lock ``[address, address + nbytes)`` for every context, mapped into the
        devices' address space (kernels may read and write it)."""
        self._call("cuMemHostRegister", ctypes.c_void_p(address), ctypes.c_size_t(nbytes),
                   ctypes.c_uint(MEMHOSTREGISTER_PORTABLE | MEMHOSTREGISTER_DEVICEMAP))

    def host_unregister(self, address: int) -> None:
        self._call("cuMemHostUnregister", ctypes.c_void_p(address))

    def host_alloc(self, nbytes: int) -> int:
        """Page-locked host memory, portable and mapped (``host_free`` gives it back)."""
        p = ctypes.c_void_p()
        self._call("cuMemHostAlloc", ctypes.byref(p), ctypes.c_size_t(nbytes),
                   ctypes.c_uint(MEMHOSTALLOC_PORTABLE | MEMHOSTALLOC_DEVICEMAP))
        return int(p.value or 0)

    def host_free(self, address: int) -> None:
        self._call("cuMemFreeHost", ctypes.c_void_p(address))

    def host_device_pointer(self, address: int) -> int:
        """The device's address of mapped page-locked host memory (the current context's)."""
        out = ctypes.c_uint64()
        self._call("cuMemHostGetDevicePointer", ctypes.byref(out), ctypes.c_void_p(address),
                   ctypes.c_uint(0))
        return out.value

    # -- virtual memory management (cuMemCreate / cuMemMap) ----------------------------------
    # Every call but mem_properties and mem_granularity runs in the caller's current context.

    @staticmethod
    def _prop(ordinal: int, exportable: bool) -> MemAllocationProp:
        return MemAllocationProp(
            type=MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes=(MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR if exportable
                                  else MEM_HANDLE_TYPE_NONE),
            location=MemLocation(MEM_LOCATION_TYPE_DEVICE, ordinal))

    def mem_granularity(self, ordinal: int, exportable: bool = True) -> int:
        """The minimum granularity of physical allocations on ``ordinal`` (2 MiB on current
        GPUs): their sizes, mapping sizes and reserved ranges are multiples of it."""
        out = ctypes.c_size_t()
        self._call_exact("cuMemGetAllocationGranularity", ctypes.byref(out),
                         ctypes.byref(self._prop(ordinal, exportable)),
                         ctypes.c_int(MEM_ALLOC_GRANULARITY_MINIMUM))
        return out.value

    def mem_create(self, nbytes: int, ordinal: int, exportable: bool = True) -> int:
        """A physical allocation of ``nbytes`` on ``ordinal`` (``exportable``: as a POSIX
        fd); its handle, for ``mem_map`` and ``mem_release``."""
        h = ctypes.c_uint64()
        self._call_exact("cuMemCreate", ctypes.byref(h), ctypes.c_size_t(nbytes),
                         ctypes.byref(self._prop(ordinal, exportable)), ctypes.c_uint64(0))
        return h.value

    def mem_release(self, handle: int) -> None:
        """Drop one reference to a physical allocation (freed once no handle nor mapping
        holds it)."""
        self._call_exact("cuMemRelease", ctypes.c_uint64(handle))

    def mem_retain_handle(self, address: int) -> int:
        """The handle of the physical allocation mapped at ``address`` (VMM memory only), one
        more reference to it: ``mem_release`` it."""
        h = ctypes.c_uint64()
        self._call_exact("cuMemRetainAllocationHandle", ctypes.byref(h),
                         ctypes.c_void_p(address))
        return h.value

    def mem_properties(self, handle: int) -> VmmAllocation:
        prop = MemAllocationProp()
        self._call_exact("cuMemGetAllocationPropertiesFromHandle", ctypes.byref(prop),
                         ctypes.c_uint64(handle))
        return VmmAllocation(prop.location.type, prop.location.id, prop.requestedHandleTypes)

    def mem_export_fd(self, handle: int) -> int:
        """A new POSIX fd naming the allocation (the caller closes it); refused unless it was
        created exportable as one."""
        fd = ctypes.c_int(-1)
        self._call_exact("cuMemExportToShareableHandle", ctypes.byref(fd),
                         ctypes.c_uint64(handle),
                         ctypes.c_int(MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), ctypes.c_uint64(0))
        return fd.value

    def mem_import_fd(self, fd: int) -> int:
        """A handle of the allocation an exported fd names (the fd stays the caller's)."""
        h = ctypes.c_uint64()
        self._call_exact("cuMemImportFromShareableHandle", ctypes.byref(h),
                         ctypes.c_void_p(fd),  # the fd itself, cast to void*
                         ctypes.c_int(MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        return h.value

    def mem_address_reserve(self, nbytes: int) -> int:
        """A range of ``nbytes`` of virtual addresses (nothing mapped), anywhere."""
        ptr = ctypes.c_uint64()
        self._call_exact("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(nbytes),
                         ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_uint64(0))
        return ptr.value

    def mem_address_free(self, address: int, nbytes: int) -> None:
        self._call_exact("cuMemAddressFree", ctypes.c_uint64(address), ctypes.c_size_t(nbytes))

    def mem_map(self, address: int, nbytes: int, handle: int) -> None:
        """Map the first ``nbytes`` of an allocation at ``address`` (inside a reserved range);
        nothing may access it before ``mem_set_access``."""
        self._call_exact("cuMemMap", ctypes.c_uint64(address), ctypes.c_size_t(nbytes),
                         ctypes.c_size_t(0), ctypes.c_uint64(handle), ctypes.c_uint64(0))

    def mem_unmap(self, address: int, nbytes: int) -> None:
        self._call_exact("cuMemUnmap", ctypes.c_uint64(address), ctypes.c_size_t(nbytes))

    def mem_set_access(self, address: int, nbytes: int, ordinal: int) -> None:
        """Let device ``ordinal`` read and write the mapped ``[address, address + nbytes)``."""
        desc = MemAccessDesc(MemLocation(MEM_LOCATION_TYPE_DEVICE, ordinal),
                             MEM_ACCESS_FLAGS_PROT_READWRITE)
        self._call_exact("cuMemSetAccess", ctypes.c_uint64(address), ctypes.c_size_t(nbytes),
                         ctypes.byref(desc), ctypes.c_size_t(1))

    # -- modules and launches ----------------------------------------------------------------

    def module_load(self, image: bytes) -> int:
        """A module from a cubin, in the current context."""
        m = ctypes.c_void_p()
        self._call("cuModuleLoadData", ctypes.byref(m), ctypes.c_char_p(image))
        return int(m.value or 0)

    def module_unload(self, module: int) -> None:
        self._call("cuModuleUnload", ctypes.c_void_p(module))

    def module_function(self, module: int, name: str) -> int:
        f = ctypes.c_void_p()
        self._call("cuModuleGetFunction", ctypes.byref(f), ctypes.c_void_p(module),
                   name.encode())
        return int(f.value or 0)

    def launch(self, function: int, grid: int, block: int, stream: int,
               params: ctypes.Array[ctypes.c_void_p]) -> None:
        """A 1-D launch; ``params`` holds a pointer to each argument (kept alive by the
        caller until this returns: the driver copies them)."""
        self._call("cuLaunchKernel", ctypes.c_void_p(function), ctypes.c_uint(grid),
                   ctypes.c_uint(1), ctypes.c_uint(1), ctypes.c_uint(block), ctypes.c_uint(1),
                   ctypes.c_uint(1), ctypes.c_uint(0), ctypes.c_void_p(stream), params, None)

    # -- streams and events ------------------------------------------------------------------

    def stream_create(self) -> int:
        s = ctypes.c_void_p()
        self._call("cuStreamCreate", ctypes.byref(s), ctypes.c_uint(STREAM_NON_BLOCKING))
        return int(s.value or 0)

    def stream_synchronize(self, stream: int) -> None:
        self._call("cuStreamSynchronize", ctypes.c_void_p(stream))

    def stream_destroy(self, stream: int) -> None:
        self._call("cuStreamDestroy", ctypes.c_void_p(stream))

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._call("cuStreamWaitEvent", ctypes.c_void_p(stream), ctypes.c_void_p(event),
                   ctypes.c_uint(0))

    def event_create(self, interprocess: bool = False, blocking: bool = False,
                     timed: bool = False) -> int:
        """``blocking``: a thread synchronizing on it sleeps instead of spinning; ``timed``:
        ``event_elapsed_ms`` can read it (not with ``interprocess``)."""
        e = ctypes.c_void_p()
        flags = ((0 if timed else EVENT_DISABLE_TIMING)
                 | (EVENT_INTERPROCESS if interprocess else 0)
                 | (EVENT_BLOCKING_SYNC if blocking else 0))
        self._call("cuEventCreate", ctypes.byref(e), ctypes.c_uint(flags))
        return int(e.value or 0)

    def event_record(self, event: int, stream: int) -> None:
        self._call("cuEventRecord", ctypes.c_void_p(event), ctypes.c_void_p(stream))

    def event_synchronize(self, event: int) -> None:
        self._call("cuEventSynchronize", ctypes.c_void_p(event))

    def event_destroy(self, event: int) -> None:
        self._call("cuEventDestroy", ctypes.c_void_p(event))

    def event_query(self, event: int) -> bool:
        """Whether the work before the event's record has completed."""
        rc = int(self.fn("cuEventQuery")(ctypes.c_void_p(event)))
        if rc == ERROR_NOT_READY:
            return False
        if rc != 0:
            raise CudaCallFailed("cuEventQuery", rc, self.error_name(rc))
        return True

    def event_elapsed_ms(self, start: int, end: int) -> float:
        """Milliseconds between two completed records of ``timed`` events."""
        out = ctypes.c_float()
        self._call("cuEventElapsedTime", ctypes.byref(out), ctypes.c_void_p(start),
                   ctypes.c_void_p(end))
        return float(out.value)

    def ipc_get_event_handle(self, event: int) -> bytes:
        h = IpcHandle()
        self._call("cuIpcGetEventHandle", ctypes.byref(h), ctypes.c_void_p(event))
        return h.to_bytes()

    def ipc_open_event_handle(self, handle: bytes) -> int:
        e = ctypes.c_void_p()
        self._call("cuIpcOpenEventHandle", ctypes.byref(e), IpcHandle.from_bytes(handle))
        return int(e.value or 0)

    # -- copies ------------------------------------------------------------------------------

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._call("cuMemcpyAsync", ctypes.c_uint64(dst), ctypes.c_uint64(src),
                   ctypes.c_size_t(nbytes), ctypes.c_void_p(stream))

    def memcpy_2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                        height: int, stream: int) -> None:
        c = Memcpy2D(srcMemoryType=MEMORYTYPE_UNIFIED, srcDevice=src, srcPitch=spitch,
                     dstMemoryType=MEMORYTYPE_UNIFIED, dstDevice=dst, dstPitch=dpitch,
                     WidthInBytes=width, Height=height)
        self._call("cuMemcpy2DAsync", ctypes.byref(c), ctypes.c_void_p(stream))

    def batch_copy_abi(self) -> int:
        """Which ``cuMemcpyBatchAsync`` the driver has: 13 (CUDA 13's, exported as
        ``cuMemcpyBatchAsync_v2``: no failure index), 12 (CUDA 12.8's, with one), 0 (none)."""
        for symbol, abi in (("cuMemcpyBatchAsync_v2", 13), ("cuMemcpyBatchAsync", 12)):
            if hasattr(self._lib, symbol):
                return abi
        return 0

    def memcpy_batch_async(self, dsts: int, srcs: int, sizes: int, count: int,
                           stream: int) -> None:
        """``count`` 1-D copies in one call: ``dsts``, ``srcs`` and ``sizes`` are addresses of
        arrays of that many 64-bit values (kept alive by the caller until this returns). The
        copies of one batch run in no particular order among themselves, in stream order as
        a whole; each source is read in stream order."""
        abi = self.batch_copy_abi()
        if not abi:
            raise CudaCallFailed("cuMemcpyBatchAsync", -1, "not exported by " + self.path)
        attrs = MemcpyAttributes(srcAccessOrder=MEMCPY_SRC_ACCESS_ORDER_STREAM)
        index = ctypes.c_size_t(0)
        fn = getattr(self._lib, "cuMemcpyBatchAsync_v2" if abi == 13 else "cuMemcpyBatchAsync")
        fn.restype = ctypes.c_int
        head = (ctypes.c_void_p(dsts), ctypes.c_void_p(srcs), ctypes.c_void_p(sizes),
                ctypes.c_size_t(count), ctypes.byref(attrs), ctypes.byref(index),
                ctypes.c_size_t(1))
        failed = ctypes.c_size_t(0)
        rc = int(fn(*head, ctypes.c_void_p(stream)) if abi == 13
                 else fn(*head, ctypes.byref(failed), ctypes.c_void_p(stream)))
        if rc != 0:
            raise CudaCallFailed("cuMemcpyBatchAsync", rc, self.error_name(rc))


_drivers: dict[str, CudaDriver | None] = {}
_problems: dict[str, str] = {}
_load_lock = lock("cuda_driver.load")


def _resolve(path: str | None) -> str:
    return path or os.environ.get(ENV_LIBRARY) or DEFAULT_LIBRARY


def load_driver(path: str | None = None) -> CudaDriver | None:
    """The driver at ``path`` (default: ``$HICACHED_CUDA_DRIVER`` or ``libcuda.so.1``), loaded
    and initialised once per process; ``None`` where there is none or it has no device."""
    lib_path = _resolve(path)
    with _load_lock:
        if lib_path in _drivers:
            return _drivers[lib_path]
        driver: CudaDriver | None = None
        try:
            driver = CudaDriver(ctypes.CDLL(lib_path), lib_path)
            if not driver.devices:
                _problems[lib_path] = "the CUDA driver reports no device"
                driver = None
        except OSError as exc:
            _problems[lib_path] = f"cannot load {lib_path}: {exc}"
        except CudaCallFailed as exc:
            _problems[lib_path] = f"the CUDA driver did not initialise: {exc}"
        _drivers[lib_path] = driver
        return driver


def driver_problem(path: str | None = None) -> str:
    """Why ``load_driver(path)`` returned ``None`` (empty when it did not)."""
    load_driver(path)
    return _problems.get(_resolve(path), "")
