"""``HiCacheClient``: typed calls to a hicached daemon.

Every failure is raised as the daemon's domain error class (``hicache.errors``): ``reason``,
``metadata``, ``violations``, ``grpc_code`` and ``from_daemon`` attached. Idempotent calls
(info, pool queries, CreatePool, Heartbeat, Backup, Load, Ping) are retried with exponential
backoff while the daemon is unreachable or draining (its successor may be starting), up to
``reconnect_seconds``. After that an unreachable daemon is ``UNAVAILABLE`` saying so, and a
draining one is ``DRAINING``, as the daemon said it.

Primitives: ``HiCacheClient`` (one method per RPC), ``WorkerSession`` (an open session with its
heartbeat thread), ``PoolInfo`` and ``TransferStats`` (replies as dataclasses).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from hicache.buffers import DeviceBufferSpec
from hicache.codec import buffer_to_proto, spec_from_proto, spec_to_proto
from hicache.error_mapping import from_rpc_error
from hicache.errors import Draining, HiCacheError, Unavailable
from hicache.indices import indices_to_bytes, to_index_array
from hicache.paths import default_target
from hicache.specs import PoolSpec
from hicache.v1 import hicache_pb2 as pb
from hicache.v1 import hicache_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class PoolInfo:
    spec: PoolSpec
    size_tokens: int
    page_num: int
    page_bytes: int
    used_pages: int
    free_pages: int
    capacity_bytes: int
    used_bytes: int
    pinned_bytes: int
    sessions: int

    @classmethod
    def from_proto(cls, p: pb.Pool) -> PoolInfo:
        return cls(spec_from_proto(p.spec), p.size_tokens, p.page_num, p.page_bytes,
                   p.used_pages, p.free_pages, p.capacity_bytes, p.used_bytes, p.pinned_bytes,
                   p.sessions)


@dataclass(frozen=True)
class TransferStats:
    bytes_moved: int
    pages: int
    duration_seconds: float
    pending: bool = False
    """The copies may still be running on the GPU (a load with layer events)."""


class HiCacheClient:
    def __init__(self, target: str | None = None, *, timeout: float = 60.0,
                 reconnect_seconds: float = 10.0, max_message_bytes: int = 64 << 20) -> None:
        self.target = target or default_target()
        self.timeout = timeout
        self.reconnect_seconds = reconnect_seconds
        self._channel = grpc.insecure_channel(self.target, options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 50),
            ("grpc.max_reconnect_backoff_ms", 250),  # a local sidecar: retry connects often
        ])
        self._stub = pb_grpc.HostCacheStub(self._channel)  # type: ignore[no-untyped-call]
        self._sessions: weakref.WeakSet[WorkerSession] = weakref.WeakSet()

    # -- plumbing --------------------------------------------------------------------------

    def _call(self, method: Callable[..., T], request: Any, *, retry: bool) -> T:
        deadline = time.monotonic() + self.reconnect_seconds
        delay = 0.05
        while True:
            try:
                return method(request, timeout=self.timeout)
            except grpc.RpcError as err:
                exc = from_rpc_error(err)
                # the daemon is away, or draining with a successor likely on its way
                unreachable = exc.grpc_code == grpc.StatusCode.UNAVAILABLE \
                    and not exc.from_daemon
                retryable = unreachable or isinstance(exc, Draining)
                remaining = deadline - time.monotonic()
                if not (retry and retryable) or remaining <= 0:
                    if unreachable and retry:
                        raise Unavailable(
                            f"daemon at {self.target} unreachable for "
                            f"{self.reconnect_seconds:.0f}s: {exc.message}",
                            metadata={"target": self.target}) from None
                    raise exc from None
                log.debug("daemon %s, retrying in %.2fs",
                          "unreachable" if unreachable else "draining", delay)
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, 1.0)

    def close(self) -> None:
        """Close the channel; heartbeats of sessions opened through it stop."""
        for s in list(self._sessions):
            s.stop_heartbeat()
        self._channel.close()

    def __enter__(self) -> HiCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- RPCs ------------------------------------------------------------------------------

    def ping(self) -> None:
        self._call(self._stub.Ping, pb.PingRequest(), retry=True)

    def get_info(self) -> pb.GetInfoResponse:
        info: pb.GetInfoResponse = self._call(self._stub.GetInfo, pb.GetInfoRequest(),
                                              retry=True)
        return info

    def create_pool(self, spec: PoolSpec | pb.PoolSpec) -> PoolInfo:
        msg = spec if isinstance(spec, pb.PoolSpec) else spec_to_proto(spec)
        return PoolInfo.from_proto(self._call(self._stub.CreatePool,
                                              pb.CreatePoolRequest(spec=msg), retry=True))

    def get_pool(self, name: str) -> PoolInfo:
        return PoolInfo.from_proto(self._call(self._stub.GetPool, pb.GetPoolRequest(name=name),
                                              retry=True))

    def list_pools(self) -> list[PoolInfo]:
        return [PoolInfo.from_proto(p) for p in self.list_pools_raw().pools]

    def list_pools_raw(self) -> pb.ListPoolsResponse:
        """The wire response, for tools that print it as is."""
        resp: pb.ListPoolsResponse = self._call(self._stub.ListPools, pb.ListPoolsRequest(),
                                                retry=True)
        return resp

    def delete_pool(self, name: str) -> None:
        self._call(self._stub.DeletePool, pb.DeletePoolRequest(name=name), retry=False)

    def drain(self, grace_seconds: float = 0.0) -> pb.DrainResponse:
        """Begin the daemon's graceful shutdown (as SIGTERM); 0 = its configured grace."""
        resp: pb.DrainResponse = self._call(
            self._stub.Drain, pb.DrainRequest(grace_seconds=grace_seconds), retry=False)
        return resp

    def open_session(self, pool: str, worker_id: str,
                     buffers: Sequence[DeviceBufferSpec | pb.DeviceBuffer], *,
                     lease_ms: int = 0, heartbeat: bool = True,
                     layer_events: Sequence[bytes] = (), ready_event: bytes = b""
                     ) -> WorkerSession:
        """Attach ``buffers`` (shm or cuda_ipc). CUDA sessions may pass the IPC handles of
        interprocess events the worker owns: ``layer_events`` are recorded by the daemon as
        layer groups of a load land, ``ready_event`` is waited on before each copy."""
        msgs = [b if isinstance(b, pb.DeviceBuffer) else buffer_to_proto(b) for b in buffers]
        s = self._call(self._stub.OpenSession, pb.OpenSessionRequest(
            pool=pool, worker_id=worker_id, buffers=msgs, lease_ms=lease_ms,
            layer_events=list(layer_events), ready_event=ready_event), retry=False)
        session = WorkerSession(self, s, heartbeat)
        self._sessions.add(session)
        return session

    def heartbeat(self, session_id: str) -> pb.Session:
        s: pb.Session = self._call(self._stub.Heartbeat,
                                   pb.HeartbeatRequest(session_id=session_id), retry=True)
        return s

    def close_session(self, session_id: str) -> None:
        self._call(self._stub.CloseSession, pb.CloseSessionRequest(session_id=session_id),
                   retry=False)

    def list_sessions(self, pool: str = "") -> list[pb.Session]:
        return list(self._call(self._stub.ListSessions, pb.ListSessionsRequest(pool=pool),
                               retry=True).sessions)

    def alloc(self, pool: str, num_tokens: int) -> torch.Tensor:
        """Token indices of fresh host pages, as an int64 tensor."""
        import torch

        resp = self._call(self._stub.Alloc, pb.AllocRequest(pool=pool, num_tokens=num_tokens),
                          retry=False)
        return torch.from_numpy(to_index_array(resp.host_indices, "host_indices").copy())

    def free(self, pool: str, host_indices: object) -> int:
        resp = self._call(self._stub.Free, pb.FreeRequest(
            pool=pool, host_indices=indices_to_bytes(host_indices)), retry=False)
        return int(resp.pages_freed)

    def backup(self, session_id: str, host_indices: object, device_indices: object,
               layer_begin: int = 0, layer_end: int = 0) -> TransferStats:
        return self._transfer(self._stub.Backup, session_id, host_indices, device_indices,
                              layer_begin, layer_end)

    def load(self, session_id: str, host_indices: object, device_indices: object,
             layer_begin: int = 0, layer_end: int = 0, *, layer_events: bool = False
             ) -> TransferStats:
        """Copy host pages to the device. ``layer_events=True`` (CUDA sessions opened with
        layer events) returns once the copies are enqueued: wait on the session's events
        before reading each layer."""
        completion = pb.COMPLETION_LAYER_EVENTS if layer_events else pb.COMPLETION_WAIT
        return self._transfer(self._stub.Load, session_id, host_indices, device_indices,
                              layer_begin, layer_end, completion)

    def _transfer(self, method: Callable[..., pb.TransferResponse], session_id: str,
                  host: object, dev: object, begin: int, end: int,
                  completion: int = pb.COMPLETION_WAIT) -> TransferStats:
        resp = self._call(method, pb.TransferRequest(
            session_id=session_id, host_indices=indices_to_bytes(host),
            device_indices=indices_to_bytes(dev), layer_begin=begin, layer_end=end,
            completion=completion), retry=True)  # type: ignore[arg-type]
        return TransferStats(resp.bytes_moved, resp.pages, resp.duration_seconds, resp.pending)


class WorkerSession:
    """An open session; heartbeats in a background thread at a third of the lease."""

    def __init__(self, client: HiCacheClient, msg: pb.Session, heartbeat: bool) -> None:
        self.client = client
        self.session_id: str = msg.session_id
        self.pool: str = msg.pool
        self.lease_ms: int = msg.lease_ms
        self.device_tokens: int = msg.device_tokens
        self.device_uuid: str = msg.device_uuid
        self.layer_events: int = msg.layer_events
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.heartbeat_error: HiCacheError | None = None
        if heartbeat:
            self._thread = threading.Thread(target=self._beat, daemon=True,
                                            name=f"heartbeat-{self.session_id[:8]}")
            self._thread.start()

    def _beat(self) -> None:
        period = max(self.lease_ms / 3000.0, 0.05)
        while not self._stop.wait(period):
            try:
                self.client.heartbeat(self.session_id)
                self.heartbeat_error = None
            except HiCacheError as exc:  # kept for the caller; the next transfer will raise
                self.heartbeat_error = exc
            except ValueError:  # the client's channel was closed under us
                return

    def backup(self, host_indices: object, device_indices: object, layer_begin: int = 0,
               layer_end: int = 0) -> TransferStats:
        return self.client.backup(self.session_id, host_indices, device_indices, layer_begin,
                                  layer_end)

    def load(self, host_indices: object, device_indices: object, layer_begin: int = 0,
             layer_end: int = 0, *, layer_events: bool = False) -> TransferStats:
        return self.client.load(self.session_id, host_indices, device_indices, layer_begin,
                                layer_end, layer_events=layer_events)

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def close(self) -> None:
        self.stop_heartbeat()
        self.client.close_session(self.session_id)

    def __enter__(self) -> WorkerSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
