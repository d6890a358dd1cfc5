"""``HiCacheClient``: typed calls to a hicached daemon.

Every failure is raised as the daemon's domain error class (``hicache.errors``): ``reason``,
``metadata``, ``violations``, ``grpc_code`` and ``from_daemon`` attached. Idempotent calls
(info, pool queries, CreatePool, Heartbeat, Backup, Load, Ping) are retried with exponential
backoff while the daemon is unreachable or draining (its successor may be starting), up to
``reconnect_seconds``. After that an unreachable daemon is ``UNAVAILABLE`` saying so, and a
draining one is ``DRAINING``, as the daemon said it.

Primitives: ``HiCacheClient`` (one method per RPC, the cache's included: ``lookup``, ``store``,
``store_async``, ``load_keys``, ``remove_keys``, ``clear_pool``, ``watch_events``; the data
calls are ``data_calls.DataCalls``, which take the daemon's fast path where it is offered and
say so in ``data_path``), and ``EventStream``. Sessions are ``session.WorkerSession``; replies
are the dataclasses of ``results``. Keys are bytes, or hex strings (SGLang's ``hash_value``).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from hicache.buffers import DeviceBufferSpec
from hicache.codec import buffer_to_proto, spec_to_proto
from hicache.error_mapping import from_rpc_error
from hicache.errors import (
    Draining,
    Overloaded,
    PeerNotAllowed,
    PoolNotReady,
    TransportUnavailable,
    Unavailable,
    error_class_for,
)
from hicache.identity import PEER_TOKEN_HEADER, SESSION_HEADER, is_public_id
from hicache.indices import indices_to_bytes, to_index_array
from hicache.keys import encode_keys
from hicache.paths import default_target
from hicache.polling import DEFAULT_MAX_US
from hicache.specs import PoolSpec
from hicache.v1 import hicache_pb2 as pb
from hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache_client.data_calls import DataCalls
from hicache_client.identity import request_token, trusted_uids
from hicache_client.results import (
    CacheEvent,
    PoolInfo,
)
from hicache_client.session import WorkerSession

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

T = TypeVar("T")


class HiCacheClient(DataCalls):
    def __init__(self, target: str | None = None, *, timeout: float = 60.0,
                 reconnect_seconds: float = 10.0, max_message_bytes: int = 64 << 20,
                 tls_ca: bytes | None = None, tls_cert: bytes | None = None,
                 tls_key: bytes | None = None, auth_token: str | None = None,
                 fast_path: bool = True, spin_us: int = DEFAULT_MAX_US,
                 daemon_uid: int | None = None) -> None:
        """``tls_*`` (PEM bytes) and ``auth_token`` are for TCP daemons: the CA that signed
        the daemon's certificate, this client's certificate and key (mutual TLS), the bearer
        token of the daemon's ``auth_token_file``. Unix sockets need none of them.
        ``fast_path=False`` keeps the data calls on gRPC even where the daemon offers its
        fast path (``data_path`` says which is used). ``spin_us``: the longest a fast-path call
        polls for its reply before its thread sleeps; the window adapts per connection
        (``hicache.polling``: calls whose replies take longer than this sleep at once), the
        poll releases the interpreter lock. 0: never poll. ``daemon_uid``: the user the daemon
        runs as, when neither this process's nor root (default: ``$HICACHE_DAEMON_UID``): a
        local daemon running as anyone else gets no fds and no data (``DAEMON_UNTRUSTED``)."""
        self._trusted = trusted_uids(daemon_uid)
        self.target = target or default_target()
        self.timeout = timeout
        self.reconnect_seconds = reconnect_seconds
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 50),
            ("grpc.max_reconnect_backoff_ms", 250),  # a local sidecar: retry connects often
        ]
        if tls_ca or tls_cert or auth_token:
            creds = grpc.ssl_channel_credentials(root_certificates=tls_ca, private_key=tls_key,
                                                 certificate_chain=tls_cert)
            if auth_token:
                creds = grpc.composite_channel_credentials(
                    creds, grpc.access_token_call_credentials(auth_token))
            self._channel = grpc.secure_channel(self.target, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(self.target, options=options)
        self._stub = pb_grpc.HostCacheStub(self._channel)  # type: ignore[no-untyped-call]
        self._sessions: weakref.WeakSet[WorkerSession] = weakref.WeakSet()
        self._init_data_calls(fast_path, spin_us)

    # -- plumbing --------------------------------------------------------------------------

    def _credentials(self, pool: str) -> list[tuple[str, str]]:
        """What proves this client may use ``pool`` where access rules cover it: the
        capability of one of its open sessions on the pool."""
        for s in list(self._sessions):
            if s.pool == pool and not s.closed:
                return [(SESSION_HEADER, s.session_id)]
        return []

    def _call(self, method: Callable[..., T], request: Any, *, retry: bool,
              timeout: float | None = None, pool: str | None = None) -> T:
        """``pool``: the pool a pool-level call acts on ("" = not known here); it carries this
        client's credential for it, and a PEER_NOT_ALLOWED refusal (access rules) is retried
        once with an identity token."""
        start = time.monotonic()
        deadline = start + self.reconnect_seconds
        if timeout is not None:  # a call's own deadline bounds its retries too
            deadline = min(deadline, start + timeout)
        delay = 0.05
        metadata = self._credentials(pool) if pool else []
        identified = pool is None
        while True:
            left = timeout if timeout is None else max(start + timeout - time.monotonic(),
                                                       0.001)
            try:
                return method(request, timeout=left or self.timeout, metadata=metadata)
            except grpc.RpcError as err:
                exc = from_rpc_error(err)
                if isinstance(exc, PeerNotAllowed) and not identified:
                    identified = True
                    token = self.peer_token()
                    if token:
                        metadata = [(PEER_TOKEN_HEADER, token)]
                        continue
                # the daemon is away, or draining with a successor likely on its way
                unreachable = exc.grpc_code == grpc.StatusCode.UNAVAILABLE \
                    and not exc.from_daemon
                # ... or its data path is full for a moment (it says when to come back)
                retryable = unreachable or isinstance(exc, Draining | Overloaded)
                remaining = deadline - time.monotonic()
                if not (retry and retryable) or remaining <= 0:
                    if unreachable and retry:
                        raise Unavailable(
                            f"daemon at {self.target} unreachable for "
                            f"{self.reconnect_seconds:.0f}s: {exc.message}",
                            metadata={"target": self.target}) from None
                    raise exc from None
                if isinstance(exc, Overloaded):
                    delay = max(int(exc.metadata.get("retry_after_ms", "10")) / 1000, 0.001)
                log.debug("daemon %s, retrying in %.3fs", exc.reason.lower(), delay)
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, 1.0)

    def close(self) -> None:
        """Close the channel; heartbeats of sessions opened through it stop."""
        for s in list(self._sessions):
            s.stop_heartbeat()
        self._close_data_calls()
        self._channel.close()

    def __enter__(self) -> HiCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- RPCs ------------------------------------------------------------------------------

    def ping(self) -> None:
        self._call(self._stub.Ping, pb.PingRequest(), retry=True)

    def health(self, service: str = "") -> bool:
        """gRPC health of ``service`` ("" = the process, ``hicache.v1.HostCache`` = ready for
        work: it turns NOT_SERVING when a drain starts). False when unreachable."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)  # type: ignore[no-untyped-call]
        try:
            r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout)
        except grpc.RpcError:
            return False
        return bool(r.status == health_pb2.HealthCheckResponse.SERVING)

    def get_info(self) -> pb.GetInfoResponse:
        info: pb.GetInfoResponse = self._call(self._stub.GetInfo, pb.GetInfoRequest(),
                                              retry=True)
        return info

    def create_pool(self, spec: PoolSpec | pb.PoolSpec, *, wait: bool = True,
                    wait_seconds: float = 3600.0) -> PoolInfo:
        """Create the pool (or find it). The daemon answers at once and builds a new pool in
        the background; with ``wait`` this returns once it is READY (or raises the error its
        build failed with, or ``POOL_NOT_READY`` after ``wait_seconds``)."""
        msg = spec if isinstance(spec, pb.PoolSpec) else spec_to_proto(spec)
        info = PoolInfo.from_proto(self._call(self._stub.CreatePool,
                                              pb.CreatePoolRequest(spec=msg), retry=True,
                                              pool=msg.name))
        deadline, delay = time.monotonic() + wait_seconds, 0.01
        while wait and info.state == "CREATING":
            if time.monotonic() > deadline:
                raise PoolNotReady(f"pool {msg.name} still building after {wait_seconds:.0f}s "
                                   f"({info.progress:.0%})",
                                   metadata={"pool": msg.name, "state": info.state})
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
            info = self.get_pool(msg.name)
        if wait and info.state == "FAILED":
            raise error_class_for(info.error_reason)(info.error, metadata={"pool": msg.name})
        return info

    def get_pool(self, name: str) -> PoolInfo:
        """The pool in any state (``state``: READY, CREATING with ``progress``, FAILED)."""
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
        self._call(self._stub.DeletePool, pb.DeletePoolRequest(name=name), retry=False,
                   pool=name)

    def drain(self, grace_seconds: float = 0.0) -> pb.DrainResponse:
        """Begin the daemon's graceful shutdown (as SIGTERM); 0 = its configured grace."""
        resp: pb.DrainResponse = self._call(
            self._stub.Drain, pb.DrainRequest(grace_seconds=grace_seconds), retry=False)
        return resp

    def open_session(self, pool: str, worker_id: str,
                     buffers: Sequence[DeviceBufferSpec | pb.DeviceBuffer], *,
                     lease_ms: int = 0, heartbeat: bool = True,
                     layer_events: Sequence[bytes] = (), ready_event: bytes = b"",
                     fds: Sequence[int] = ()) -> WorkerSession:
        """Attach ``buffers`` (shm, memfd or cuda_ipc). memfd buffers need their ``fds``
        (``ShmDeviceBuffers.fds``), passed to the daemon over its identity socket. CUDA
        sessions may pass the IPC handles of interprocess events the worker owns:
        ``layer_events`` are recorded by the daemon as layer groups of a load land,
        ``ready_event`` is waited on before each copy."""
        msgs = [b if isinstance(b, pb.DeviceBuffer) else buffer_to_proto(b) for b in buffers]
        token = self.peer_token(fds)
        if fds and not token:
            raise TransportUnavailable(
                "memfd buffers travel over the daemon's identity socket (<socket>.id), which "
                f"{self.target} does not offer", metadata={"target": self.target})
        s = self._call(self._stub.OpenSession, pb.OpenSessionRequest(
            pool=pool, worker_id=worker_id, buffers=msgs, lease_ms=lease_ms,
            layer_events=list(layer_events), ready_event=ready_event,
            peer_token=token), retry=False)
        session = WorkerSession(self, s, heartbeat)
        self._sessions.add(session)
        self._page_sizes[s.session_id] = int(s.page_size)
        return session

    def peer_token(self, fds: Sequence[int] = ()) -> str:
        """A one-time token from the daemon's identity socket (``<socket>.id``) naming this
        process's uid / gid / pid as the kernel reports them, and the ``fds`` handed over with
        it (SCM_RIGHTS); "" over TCP or when the daemon has none (pools without access rules
        and sessions without memfd buffers do not need it). A refusal of the fds (too many)
        raises ``FD_REJECTED``."""
        return request_token(self.target, fds, self._trusted)

    def heartbeat(self, session_id: str, *, timeout: float | None = None) -> pb.Session:
        """Extend the lease; the session as the daemon sees it (``loads_in_flight`` too)."""
        s: pb.Session = self._call(self._stub.Heartbeat,
                                   pb.HeartbeatRequest(session_id=session_id), retry=True,
                                   timeout=timeout)
        return s

    def close_session(self, session_id: str) -> None:
        self._page_sizes.pop(session_id, None)
        self._call(self._stub.CloseSession, pb.CloseSessionRequest(session_id=session_id),
                   retry=False, pool=None if not is_public_id(session_id) else "")

    def list_sessions(self, pool: str = "") -> list[pb.Session]:
        return list(self._call(self._stub.ListSessions, pb.ListSessionsRequest(pool=pool),
                               retry=True).sessions)

    def alloc(self, pool: str, num_tokens: int, session_id: str = "") -> torch.Tensor:
        """Token indices of fresh raw host pages, as an int64 tensor; owned by
        ``session_id`` (freed when it ends) when one is given."""
        import torch

        resp = self._call(self._stub.Alloc, pb.AllocRequest(
            pool=pool, num_tokens=num_tokens, session_id=session_id), retry=False, pool=pool)
        return torch.from_numpy(to_index_array(resp.host_indices, "host_indices").copy())

    def free(self, pool: str, host_indices: object) -> int:
        resp = self._call(self._stub.Free, pb.FreeRequest(
            pool=pool, host_indices=indices_to_bytes(host_indices)), retry=False, pool=pool)
        return int(resp.pages_freed)

    # -- the cache (Lookup, Store and LoadKeys are in ``data_calls``) ----------------------

    def remove_keys(self, pool: str, keys: Sequence[bytes | str]) -> int:
        r = self._call(self._stub.RemoveKeys,
                       pb.RemoveKeysRequest(pool=pool, keys=encode_keys(keys)), retry=True,
                       pool=pool)
        return int(r.removed)

    def clear_pool(self, pool: str) -> int:
        """Drop every key of the pool (raw pages stay); returns how many."""
        r = self._call(self._stub.ClearPool, pb.ClearPoolRequest(pool=pool), retry=True,
                       pool=pool)
        return int(r.keys_removed)

    def watch_events(self, pool: str, after_seq: int = 0, *, all_tiers: bool = False
                     ) -> EventStream:
        """The pool's STORED / REMOVED / EVICTED events after ``after_seq``, as they happen:
        of host memory, or with ``all_tiers`` of every tier (each event names its tier)."""
        metadata = self._credentials(pool)
        if not metadata and self.target.startswith("unix:"):
            metadata = [(PEER_TOKEN_HEADER, self.peer_token())]  # in case a rule covers it
        return EventStream(self._stub.WatchEvents(
            pb.WatchEventsRequest(pool=pool, after_seq=after_seq, all_tiers=all_tiers),
            metadata=metadata))


class EventStream:
    """An iterator of ``CacheEvent``; ``cancel()`` ends it. Errors arrive as domain errors."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> Iterator[CacheEvent]:
        try:
            for e in self._call:
                yield CacheEvent.from_proto(e)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED and self._call.cancelled():
                return  # cancel() from this side
            raise from_rpc_error(err) from None

    def cancel(self) -> None:
        self._call.cancel()
