"""Attaching worker GPU buffers: the CUDA transport, over CUDA IPC handles or VMM chunk fds.

A worker sends, per layer buffer, the 64-byte ``cuIpcGetMemHandle`` handle of the allocation
holding it, the byte offset inside that allocation, its size, shape, dtype, strides and the GPU's
UUID (ordinals differ between processes with different ``CUDA_VISIBLE_DEVICES``). Many buffers
usually share one allocation (the caching allocator carves tensors out of large segments).
Memory of the virtual memory management API comes as ``cuda_vmm`` buffers instead, their
chunks as fds (``transport.cuda_vmm`` maps them); the session is the same either way.

Primitives:

- ``IpcMemoryCache``: each allocation is opened once per daemon process and closed when the last
  session using it lets go (CUDA refuses to open one handle twice in a process).
- ``CudaIpcTransport(driver, copy_paths, kernels)``: ``attach(buffers, layer_events,
  ready_event, fds)`` resolves the UUID to this process's device, checks every buffer, opens the
  handles (``cuda_ipc``) or maps the chunks of ``fds`` (``cuda_vmm``: ``cuda_vmm.VmmMapping``),
  imports the worker's interprocess events and creates the session's two streams (backup
  D2H, load H2D). Any failure closes whatever was opened and raises ``DEVICE_NOT_FOUND`` /
  ``IPC_HANDLE_INVALID`` / ``FD_REJECTED`` / ``GEOMETRY_MISMATCH`` naming the buffer and the
  CUDA error. ``vmm``: the chunks every session maps (``VmmStats``). ``copies(ordinal)``: the
  device's ``DeviceCopies`` (the ways allowed by ``copy_paths`` that it has: the page kernel
  loaded on its first session, from ``kernels``, the reason it is off logged once), shared by
  its sessions.
- ``CudaAttachment``: the session's ``WorkerBuffers`` (``RawBuffer``s on ``cuda``), its
  ``CudaRunner``, and ``release()``: drain both streams, destroy them, destroy the imported
  events, close the handles (unmap the chunks, free their ranges). Sessions call it when the
  worker closes the session or its lease runs out, after the last in-flight transfer, so a
  dead worker keeps no GPU memory mapped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from hicache.buffers import DeviceBufferSpec
from hicache.cuda_driver import IPC_HANDLE_SIZE, CudaCallFailed, CudaDriver, normalize_uuid
from hicache.errors import DeviceNotFound, IpcHandleInvalid, SpecInvalid
from hicache.locks import lock
from hicached.core.worker_buffers import Device, RawBuffer, WorkerBuffers
from hicached.cuda.kernels import KernelBinaries, load_page_kernel
from hicached.cuda.paths import CopyPaths, Path
from hicached.cuda.runner import Completer, CudaRunner, DeviceCopies
from hicached.transport.base import Attachment, assemble, check_extent, check_strides
from hicached.transport.cuda_vmm import VmmMapping, VmmStats, plan_regions

log = logging.getLogger(__name__)


class IpcMemoryCache:
    """Opened IPC allocations keyed by (device ordinal, handle), reference-counted."""

    def __init__(self, driver: CudaDriver) -> None:
        self._driver = driver
        self._open: dict[tuple[int, bytes], list[int]] = {}  # -> [address, size, refs]
        self._lock = lock("cuda_ipc.mappings")

    def acquire(self, ordinal: int, handle: bytes) -> tuple[int, int]:
        """(address, size) of the allocation; the caller holds the device's context."""
        key = (ordinal, handle)
        with self._lock:
            got = self._open.get(key)
            if got is None:
                address = self._driver.ipc_open_mem_handle(handle)
                try:
                    base, size = self._driver.address_range(address)
                except CudaCallFailed:
                    self._driver.ipc_close_mem_handle(address)
                    raise
                got = self._open[key] = [address, base + size - address, 0]
                log.debug("opened IPC allocation %#x (%d bytes) on device %d", address, size,
                          ordinal)
            got[2] += 1
            return got[0], got[1]

    def release(self, ordinal: int, handle: bytes) -> None:
        """Drop one reference; the last closes the mapping (caller holds the context)."""
        key = (ordinal, handle)
        with self._lock:
            got = self._open.get(key)
            if got is None:
                return
            got[2] -= 1
            if got[2] > 0:
                return
            del self._open[key]
        self._driver.ipc_close_mem_handle(got[0])

    def stats(self) -> tuple[int, int]:
        """(allocations open, their bytes)."""
        with self._lock:
            return len(self._open), sum(v[1] for v in self._open.values())


class CudaAttachment(Attachment):
    """GPU buffers of one session mapped over CUDA IPC."""

    def __init__(self, buffers: WorkerBuffers, nbytes: int, runner: CudaRunner,
                 close: Callable[[], None]) -> None:
        super().__init__(buffers, [], nbytes)
        self.runner = runner
        self._close = close
        self._released = False
        self._lock = lock("cuda_ipc.attachment")

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self.buffers = None
        self._close()


def _invalid(i: int, why: str, **meta: object) -> IpcHandleInvalid:
    return IpcHandleInvalid(f"buffers[{i}]: {why}", metadata={"buffer": i, **meta})


class CudaIpcTransport:
    def __init__(self, driver: CudaDriver, copy_paths: Sequence[Path] = (Path.DMA,),
                 kernels: KernelBinaries | None = None, kernels_off: str = "") -> None:
        """``kernels``: how the page kernel is compiled (None: it is off, ``kernels_off``
        says why)."""
        self.driver = driver
        self.cache = IpcMemoryCache(driver)
        self.vmm = VmmStats()
        self.completer = Completer(driver)
        self.copy_paths = tuple(copy_paths)
        self._kernels = kernels
        self._kernels_off = kernels_off
        self._copies: dict[int, DeviceCopies] = {}
        self._copies_lock = lock("cuda_ipc.copies")

    def copies(self, ordinal: int) -> DeviceCopies:
        """The ways ``ordinal`` moves batches (made on its first session)."""
        with self._copies_lock:
            got = self._copies.get(ordinal)
            if got is None:
                got = self._copies[ordinal] = self._device_copies(ordinal)
            return got

    def copy_stats(self) -> tuple[dict[tuple[bool, Path], tuple[int, int]],
                                  dict[tuple[bool, int, Path], float]]:
        """Over every device: (loading, way) -> (batches, bytes) enqueued, and (loading,
        size class, way) -> the mean rate measured (the best device's)."""
        with self._copies_lock:
            devices = list(self._copies.values())
        counts: dict[tuple[bool, Path], tuple[int, int]] = {}
        rates: dict[tuple[bool, int, Path], float] = {}
        for d in devices:
            for k, (n, b) in d.paths.counts().items():
                m, c = counts.get(k, (0, 0))
                counts[k] = (m + n, c + b)
            for key, r in d.paths.rates().items():
                rates[key] = max(rates.get(key, 0.0), r)
        return counts, rates

    def _device_copies(self, ordinal: int) -> DeviceCopies:
        uuid = self.driver.devices[ordinal].uuid
        kernel = None
        if Path.KERNEL in self.copy_paths:
            kernel, why = (load_page_kernel(self.driver, ordinal, self._kernels)
                           if self._kernels is not None else (None, self._kernels_off))
            if kernel is None:
                log.warning("the page kernel is off on device %d (%s): %s; its batches take "
                            "the other allowed ways", ordinal, uuid, why)
        batch = Path.BATCH in self.copy_paths and self.driver.batch_copy_abi() > 0
        if Path.BATCH in self.copy_paths and not batch:
            log.warning("cuMemcpyBatchAsync is not in the CUDA driver (%s, CUDA %d): device "
                        "%d's batches take the other allowed ways", self.driver.path,
                        self.driver.version(), ordinal)
        copies = DeviceCopies(CopyPaths(self.copy_paths), kernel, batch)
        log.info("device %d (%s) copies by %s", ordinal, uuid,
                 ", ".join(p.value for p in copies.paths.allowed if p in copies.usable))
        return copies

    def close(self) -> None:
        self.completer.close()

    def resolve(self, uuids: set[str]) -> int:
        if len(uuids) != 1:
            raise SpecInvalid("a session's buffers must all be on one GPU",
                              metadata={"device_uuids": ",".join(sorted(uuids))})
        uuid = next(iter(uuids))
        ordinal = self.driver.ordinal_of(uuid)
        if ordinal is None:
            visible = ",".join(d.uuid for d in self.driver.devices)
            raise DeviceNotFound(f"no GPU with UUID {uuid} is visible to the daemon "
                                 f"(it sees {visible or 'none'}); run it with that GPU visible",
                                 metadata={"device_uuid": uuid, "visible": visible})
        return ordinal

    def attach(self, buffers: Sequence[DeviceBufferSpec], layer_events: Sequence[bytes] = (),
               ready_event: bytes = b"", fds: Sequence[int] = ()) -> CudaAttachment:
        """``buffers``: all ``cuda_ipc``, or all ``cuda_vmm`` with their chunks' ``fds`` (which
        stay the caller's: the mappings hold the memory)."""
        if not buffers:
            raise SpecInvalid("a CUDA session needs its device buffers")
        kinds = {b.transport for b in buffers}
        if len(kinds) != 1 or not kinds <= {"cuda_ipc", "cuda_vmm"}:
            raise SpecInvalid("a CUDA session's buffers are all cuda_ipc or all cuda_vmm",
                              metadata={"transports": ",".join(sorted(kinds))})
        vmm = kinds == {"cuda_vmm"}
        ordinal = self.resolve({normalize_uuid(b.device_uuid) for b in buffers})
        for i, b in enumerate(buffers):
            if not vmm and len(b.ipc_handle) != IPC_HANDLE_SIZE:
                raise _invalid(i, f"a CUDA IPC handle is {IPC_HANDLE_SIZE} bytes, "
                                  f"got {len(b.ipc_handle)}", handle_bytes=len(b.ipc_handle))
            why = check_extent(b, i)
            if why:
                raise _invalid(i, why)
            check_strides(b, i)
        for j, h in enumerate([*layer_events, *([ready_event] if ready_event else [])]):
            if len(h) != IPC_HANDLE_SIZE:
                raise SpecInvalid(f"event handle {j} is {len(h)} bytes, not {IPC_HANDLE_SIZE}",
                                  metadata={"event": j})
        plan = plan_regions(buffers, len(fds)) if vmm else None  # before the driver is touched
        first_use: dict[bytes, int] = {}  # each allocation's handle -> first buffer naming it
        for i, b in enumerate(buffers):
            if not vmm:
                first_use.setdefault(b.ipc_handle, i)
        opened: dict[bytes, tuple[int, int]] = {}
        mapped: list[VmmMapping] = []
        streams: list[int] = []
        events: list[int] = []
        runners: list[CudaRunner] = []
        drv = self.driver

        def close() -> None:
            chunks = sum(m.chunks for m in mapped)
            with drv.context(ordinal):
                for s in streams:
                    _quietly(drv.stream_synchronize, s)
                for r in runners:
                    _quietly(r.close)
                for s in streams:
                    _quietly(drv.stream_destroy, s)
                for e in events:
                    _quietly(drv.event_destroy, e)
                for h in opened:
                    _quietly(self.cache.release, ordinal, h)
                for m in mapped:
                    _quietly(m.release)
            if vmm:
                log.info("released %d VMM chunk(s) on device %d", chunks, ordinal)
            else:
                log.info("released %d CUDA IPC allocation(s) on device %d", len(opened),
                         ordinal)

        try:
            with drv.context(ordinal):
                if plan is not None:
                    mapped.append(VmmMapping.map(drv, ordinal, plan, fds, self.vmm))
                for h, first in first_use.items():
                    try:
                        opened[h] = self.cache.acquire(ordinal, h)
                    except CudaCallFailed as exc:
                        raise _invalid(first, f"the CUDA IPC handle cannot be opened on "
                                              f"{drv.devices[ordinal].uuid}: {exc.name} (the "
                                              f"worker exited, or the handle is not from "
                                              f"cuIpcGetMemHandle)", cuda_error=exc.name
                                       ) from None
                for i, b in enumerate(buffers if not vmm else ()):  # VMM: planned
                    size = opened[b.ipc_handle][1]
                    if b.offset + b.nbytes > size:
                        raise _invalid(i, f"bytes [{b.offset}, {b.offset + b.nbytes}) leave "
                                          f"the {size}-byte allocation the handle names",
                                       allocation_bytes=size)
                for j, h in enumerate(layer_events):
                    events.append(self._open_event(h, f"layer_events[{j}]"))
                ready = self._open_event(ready_event, "ready_event") if ready_event else 0
                if ready:
                    events.append(ready)
                streams.extend([drv.stream_create(), drv.stream_create()])
            where = Device("cuda", ordinal)
            attached = assemble(buffers, lambda i, b: RawBuffer(
                mapped[0].address(i) if vmm else opened[b.ipc_handle][0] + b.offset, b.shape,
                b.dtype, b.strides, where), location="cuda")
        except BaseException:
            close()
            raise
        runner = CudaRunner(drv, ordinal, streams[0], streams[1], self.completer,
                            layer_events=events[: len(layer_events)], ready_event=ready,
                            device=self.copies(ordinal))
        runners.append(runner)
        if plan is not None:
            log.info("attached %d buffer(s) in %d VMM chunk(s) (%d region(s)) on device %d "
                     "(%s)", len(buffers), mapped[0].chunks, len(plan.regions), ordinal,
                     drv.devices[ordinal].uuid)
        else:
            log.info("attached %d buffer(s) in %d CUDA IPC allocation(s) on device %d (%s)",
                     len(buffers), len(opened), ordinal, drv.devices[ordinal].uuid)
        return CudaAttachment(attached, sum(b.nbytes for b in buffers), runner, close)

    def _open_event(self, handle: bytes, field: str) -> int:
        try:
            return self.driver.ipc_open_event_handle(handle)
        except CudaCallFailed as exc:
            raise IpcHandleInvalid(f"{field}: the CUDA IPC event handle cannot be opened: "
                                   f"{exc.name} (create it with interprocess=True)",
                                   metadata={"field": field, "cuda_error": exc.name}) from None


def _quietly(fn: Callable[..., None], *args: object) -> None:
    try:
        fn(*args)
    except Exception as exc:  # keep releasing the rest
        log.warning("releasing a CUDA resource failed: %s", exc)
