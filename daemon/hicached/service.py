"""The gRPC servicer of ``hicache.v1.HostCache``: decode, call the core, encode, map errors.

Primitives:

- ``Daemon``: the state one process serves (pool registry, sessions, transports, copy engine,
  metrics, draining flag). Nothing in it imports gRPC.
- ``HostCacheServicer(daemon)``: subclasses the generated servicer, one method per RPC. Domain
  errors leave through ``status.abort_status`` (rich ``google.rpc.Status``); anything else is
  logged and becomes INTERNAL. While draining, work-creating RPCs get UNAVAILABLE / DRAINING.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

import hicached
from hicache.v1 import hicache_pb2 as pb
from hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicached.cudacopy import CudaRunner, layer_group_size
from hicached.cudadriver import driver_problem
from hicached.cudaipc import CudaIpcTransport
from hicached.errors import Draining, HiCacheError, SpecInvalid, TransportUnavailable
from hicached.memory import available_bytes
from hicached.metrics import Metrics
from hicached.pool import HostPool
from hicached.registry import PoolRegistry
from hicached.sessions import Session, SessionManager
from hicached.status import abort_status, grpc_code
from hicached.transfer import TransferEngine
from hicached.transport import Attachment, DeviceBufferSpec, ShmTransport
from hicached.wire import (
    buffer_from_proto,
    indices_from_bytes,
    indices_to_bytes,
    spec_from_proto,
    spec_to_proto,
)

log = logging.getLogger(__name__)

R = TypeVar("R")


@dataclass
class Daemon:
    registry: PoolRegistry
    sessions: SessionManager
    transport: ShmTransport
    engine: TransferEngine
    metrics: Metrics
    cuda: CudaIpcTransport | None = None
    """The CUDA IPC transport; None on hosts without a usable CUDA driver."""
    draining: threading.Event = field(default_factory=threading.Event)
    metrics_port: int = 0
    cuda_driver: str = ""
    """The driver library the daemon was configured with ('' = the default)."""
    in_flight: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def enter(self, creates_work: bool) -> None:
        with self._lock:
            if creates_work and self.draining.is_set():
                raise Draining("the daemon is shutting down; retry on its successor")
            self.in_flight += 1

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self.in_flight == 0:
                    return True
            time.sleep(0.01)
        return False


def rpc(creates_work: bool = True) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Wrap a servicer method: drain gate, metrics, domain error -> rich status."""

    def wrap(fn: Callable[..., R]) -> Callable[..., R]:
        method = fn.__name__

        @functools.wraps(fn)
        def handler(self: HostCacheServicer, request: Any, context: grpc.ServicerContext) -> R:
            d = self.daemon
            t0 = time.perf_counter()
            code = "OK"
            try:
                d.enter(creates_work)
                try:
                    return fn(self, request, context)
                finally:
                    d.leave()
            except HiCacheError as exc:
                code = grpc_code(exc).name
                d.metrics.rejected.labels(exc.reason).inc()
                log.info("%s rejected: %s", method, exc)
                context.abort_with_status(abort_status(exc))
                raise  # unreachable: abort raises
            except Exception:
                code = "INTERNAL"
                log.exception("%s failed", method)
                context.abort(grpc.StatusCode.INTERNAL, f"{method} failed; see the daemon log")
                raise
            finally:
                d.metrics.requests.labels(method, code).inc()
                d.metrics.rpc_seconds.labels(method).observe(time.perf_counter() - t0)

        return handler

    return wrap


def pool_message(pool: HostPool, sessions: int) -> pb.Pool:
    used = pool.allocator.used_pages
    return pb.Pool(spec=spec_to_proto(pool.spec), size_tokens=pool.size_tokens,
                   page_num=pool.page_num, page_bytes=pool.spec.page_bytes, used_pages=used,
                   free_pages=pool.page_num - used, capacity_bytes=pool.nbytes,
                   used_bytes=used * pool.spec.page_bytes, pinned_bytes=pool.pinned_bytes,
                   sessions=sessions)


def session_message(s: Session) -> pb.Session:
    runner = s.attachment.runner
    uuid, events = "", 0
    if isinstance(runner, CudaRunner):
        uuid, events = runner.driver.devices[runner.ordinal].uuid, len(runner.layer_events)
    return pb.Session(session_id=s.session_id, pool=s.pool_name, worker_id=s.worker_id,
                      lease_ms=int(s.lease_seconds * 1000),
                      expires_in_ms=int(s.expires_in(time.monotonic()) * 1000),
                      attached_bytes=s.attachment.nbytes, device_tokens=s.device_tokens,
                      transfers=s.transfers,
                      device_uuid=uuid, layer_events=events)


def check_layer_events(events: int, layers: int) -> None:
    """Every event must cover a layer group: groups of ceil(layers / events) layers."""
    if not events:
        return
    if events > layers or -(-layers // layer_group_size(layers, events)) != events:
        fits = sorted({-(-layers // g) for g in range(1, layers + 1)})
        raise SpecInvalid(f"{events} layer events cannot each cover a group of the pool's "
                          f"{layers} layers (groups of ceil(layers / events)); use one of "
                          f"{fits}", metadata={"layer_events": events, "layers": layers})


class HostCacheServicer(pb_grpc.HostCacheServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    @rpc(creates_work=False)
    def GetInfo(self, request: pb.GetInfoRequest, context: grpc.ServicerContext
                ) -> pb.GetInfoResponse:
        d = self.daemon
        devices = d.cuda.driver.devices if d.cuda is not None else ()
        return pb.GetInfoResponse(
            version=hicached.__version__,
            transports=["shm", "cuda_ipc"] if d.cuda is not None else ["shm"],
            memory_budget_bytes=d.registry.budget_bytes,
            memory_used_bytes=d.registry.used_bytes, memory_available_bytes=available_bytes(),
            shm_dir=d.transport.shm_dir, cuda_available=d.cuda is not None,
            serving=not d.draining.is_set(), pools=len(d.registry.list()),
            sessions=d.sessions.count(), metrics_port=d.metrics_port,
            cuda_devices=[pb.CudaDevice(uuid=x.uuid, ordinal=x.ordinal, name=x.name,
                                        total_bytes=x.total_bytes) for x in devices])

    @rpc(creates_work=False)
    def Ping(self, request: pb.PingRequest, context: grpc.ServicerContext) -> pb.PingResponse:
        return pb.PingResponse()

    @rpc()
    def CreatePool(self, request: pb.CreatePoolRequest, context: grpc.ServicerContext
                   ) -> pb.Pool:
        spec = spec_from_proto(request.spec)
        pool, created = self.daemon.registry.create(spec)
        if created:
            log.info("pool %s created: %d bytes", spec.name, pool.nbytes)
        return pool_message(pool, self.daemon.sessions.count(spec.name))

    @rpc(creates_work=False)
    def GetPool(self, request: pb.GetPoolRequest, context: grpc.ServicerContext) -> pb.Pool:
        pool = self.daemon.registry.get(request.name)
        return pool_message(pool, self.daemon.sessions.count(request.name))

    @rpc(creates_work=False)
    def ListPools(self, request: pb.ListPoolsRequest, context: grpc.ServicerContext
                  ) -> pb.ListPoolsResponse:
        d = self.daemon
        return pb.ListPoolsResponse(pools=[pool_message(p, d.sessions.count(p.spec.name))
                                           for p in d.registry.list()])

    @rpc()
    def DeletePool(self, request: pb.DeletePoolRequest, context: grpc.ServicerContext
                   ) -> pb.DeletePoolResponse:
        self.daemon.registry.delete(request.name)
        log.info("pool %s deleted", request.name)
        return pb.DeletePoolResponse()

    @rpc()
    def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.ServicerContext
                    ) -> pb.Session:
        d = self.daemon
        pool = d.registry.get(request.pool)
        check_layer_events(len(request.layer_events), pool.spec.max_layers)
        buffers = [buffer_from_proto(b, i) for i, b in enumerate(request.buffers)]
        attachment = self._attach(buffers, list(request.layer_events),
                                  bytes(request.ready_event))
        try:
            assert attachment.device is not None
            tokens = attachment.device.check_against(pool.spec)
            session = d.sessions.open(request.pool, pool, request.worker_id, attachment, tokens,
                                      request.lease_ms / 1000.0)
        except BaseException:
            attachment.release()
            raise
        return session_message(session)

    def _attach(self, buffers: list[DeviceBufferSpec], layer_events: list[bytes],
                ready_event: bytes) -> Attachment:
        d = self.daemon
        kinds = {b.transport for b in buffers}
        if kinds == {"cuda_ipc"}:
            if d.cuda is None:
                raise TransportUnavailable(
                    f"cuda_ipc buffers cannot be attached: {driver_problem(d.cuda_driver)}",
                    metadata={"transport": "cuda_ipc", "buffers": len(buffers)})
            return d.cuda.attach(buffers, layer_events, ready_event)
        if len(kinds) > 1:
            raise SpecInvalid("a session's buffers use one transport, shm or cuda_ipc",
                              metadata={"transports": ",".join(sorted(kinds))})
        if layer_events or ready_event:
            raise SpecInvalid("layer_events and ready_event are CUDA events; shm sessions "
                              "complete every transfer before replying",
                              metadata={"layer_events": len(layer_events)})
        return d.transport.attach(buffers)

    @rpc(creates_work=False)
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
                  ) -> pb.Session:
        return session_message(self.daemon.sessions.heartbeat(request.session_id))

    @rpc(creates_work=False)
    def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.ServicerContext
                     ) -> pb.CloseSessionResponse:
        self.daemon.sessions.close(request.session_id)
        return pb.CloseSessionResponse()

    @rpc(creates_work=False)
    def ListSessions(self, request: pb.ListSessionsRequest, context: grpc.ServicerContext
                     ) -> pb.ListSessionsResponse:
        return pb.ListSessionsResponse(
            sessions=[session_message(s) for s in self.daemon.sessions.list(request.pool)])

    @rpc()
    def Alloc(self, request: pb.AllocRequest, context: grpc.ServicerContext
              ) -> pb.AllocResponse:
        pool = self.daemon.registry.get(request.pool)
        return pb.AllocResponse(host_indices=indices_to_bytes(pool.alloc(request.num_tokens)))

    @rpc(creates_work=False)
    def Free(self, request: pb.FreeRequest, context: grpc.ServicerContext) -> pb.FreeResponse:
        pool = self.daemon.registry.get(request.pool)
        idx = indices_from_bytes(request.host_indices, "host_indices")
        return pb.FreeResponse(pages_freed=pool.free(idx))

    @rpc()
    def Backup(self, request: pb.TransferRequest, context: grpc.ServicerContext
               ) -> pb.TransferResponse:
        return self._transfer("backup", request)

    @rpc()
    def Load(self, request: pb.TransferRequest, context: grpc.ServicerContext
             ) -> pb.TransferResponse:
        return self._transfer("load", request)

    def _transfer(self, op: str, request: pb.TransferRequest) -> pb.TransferResponse:
        d = self.daemon
        host = indices_from_bytes(request.host_indices, "host_indices")
        dev = indices_from_bytes(request.device_indices, "device_indices")
        events = request.completion == pb.COMPLETION_LAYER_EVENTS
        if op == "backup" and events:
            raise SpecInvalid("backups always complete before the reply; "
                              "COMPLETION_LAYER_EVENTS is for loads",
                              metadata={"completion": "COMPLETION_LAYER_EVENTS"})
        with d.sessions.transfer(request.session_id) as s:
            device = s.attachment.device
            runner = s.attachment.runner
            assert device is not None, "a session in use keeps its mappings"
            layers = (int(request.layer_begin), int(request.layer_end))
            if op == "backup":
                r = d.engine.backup(s.pool, device, host, dev, *layers, runner=runner)
            else:
                if events and not (isinstance(runner, CudaRunner) and runner.layer_events):
                    raise SpecInvalid("COMPLETION_LAYER_EVENTS needs a CUDA session opened "
                                      "with layer_events",
                                      metadata={"completion": "COMPLETION_LAYER_EVENTS"})
                d.sessions.hold(s)  # released when the GPU copies land
                try:
                    r = d.engine.load(s.pool, device, host, dev, *layers, runner=runner,
                                      wait=not events,
                                      on_complete=functools.partial(d.sessions.unhold, s))
                except BaseException:
                    d.sessions.unhold(s)
                    raise
                if not r.pending:
                    d.sessions.unhold(s)
        d.metrics.transfer(s.pool_name, op, r.bytes, r.pages, r.seconds)
        return pb.TransferResponse(bytes_moved=r.bytes, pages=r.pages,
                                   duration_seconds=r.seconds, pending=r.pending)
