"""``HiCacheClient``: typed calls to a hicached daemon.

Every failure is raised as the daemon's domain error class (``hicache.errors``): ``reason``,
``metadata``, ``violations``, ``grpc_code`` and ``from_daemon`` attached. Idempotent calls
(info, pool queries, CreatePool, Heartbeat, Backup, Load, Ping) are retried with exponential
backoff while the daemon is unreachable or draining (its successor may be starting), up to
``reconnect_seconds``. After that an unreachable daemon is ``UNAVAILABLE`` saying so, and a
draining one is ``DRAINING``, as the daemon said it.

The data calls (``backup``, ``load``, ``lookup`` (holding the hit for a session when asked),
``release_holds``, ``store``, ``store_async``, ``load_keys``, and ``beat``: a session's
heartbeat) take the daemon's fast path where it is offered: on a Unix target the client asks
``GetInfo`` once whether the daemon offers it (``GetInfo.fast_path``, the socket
``<socket>.fast``) and, when it does, sends every data call there as page ids: the same
results, the same domain errors. A call goes over gRPC instead when the fast path is not
offered, its connection fails (then the fast path is asked for again after
``FAST_RETRY_SECONDS``), the daemon is draining (gRPC's retry waits for a successor), the
indices are not whole aligned pages (the daemon names the fault over gRPC) or a key does not
fit the framing. ``data_path`` says which path the calls take now; an OVERLOADED refusal is
retried on the path it came from, after the daemon's hint, as gRPC's calls are.

Primitives: ``HiCacheClient`` (one method per RPC, the cache's included: ``lookup``, ``store``,
``store_async``, ``load_keys``, ``remove_keys``, ``clear_pool``, ``watch_events``; the data
calls as above, ``data_path``), ``EventStream``, ``FAST_RETRY_SECONDS``. Sessions are
``session.WorkerSession``; replies are the dataclasses of ``results``. Keys are bytes, or hex
strings (SGLang's ``hash_value``).
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import numpy as np

from hicache import fast_wire as w
from hicache import paths
from hicache.buffers import DeviceBufferSpec
from hicache.calls import (
    AllocRequest,
    CreatePoolRequest,
    DrainRequest,
    FreeRequest,
    KeysRequest,
    LoadKeysRequest,
    LookupRequest,
    NoRequest,
    OpenSessionRequest,
    PoolRequest,
    ReleaseHoldsRequest,
    SessionRequest,
    StoreRequest,
    TransferRequest,
    WatchEventsRequest,
)
from hicache.codec import pool_from_proto
from hicache.error_mapping import from_rpc_error
from hicache.errors import (
    Draining,
    Overloaded,
    PeerNotAllowed,
    PoolNotReady,
    TokenIdsInvalid,
    TransportUnavailable,
    Unavailable,
    error_class_for,
)
from hicache.identity import PEER_TOKEN_HEADER, SESSION_HEADER, is_public_id
from hicache.indices import IndexArray, PageIds
from hicache.keys import check_namespace, encode_keys
from hicache.locks import lock
from hicache.paths import default_target
from hicache.polling import DEFAULT_MAX_US
from hicache.specs import PoolSpec
from hicache.v1 import hicache_pb2 as pb
from hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache_client import fast_path as fp
from hicache_client.codecs import CODECS
from hicache_client.identity import request_token, trusted_uids
from hicache_client.results import (
    CacheEvent,
    LookupResult,
    PoolInfo,
    StoreResult,
    TransferStats,
)
from hicache_client.session import WorkerSession

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

T = TypeVar("T")

STORE_THREADS = 4
"""Threads a client runs ``store_async`` calls on (at most as many Stores in flight)."""
FAST_RETRY_SECONDS = 2.0
"""After the fast path failed (or was not offered), how long calls stay on gRPC before the
client asks the daemon again."""


_INT64 = np.dtype("<i8")
_NONE = NoRequest()


def _token_bytes(token_ids: Sequence[int] | np.ndarray | bytes | None) -> bytes | None:
    """A Store's token ids as the little-endian int64 bytes both wires start from (None for
    none); an engine's int64 array costs one copy. The daemon checks them."""
    if token_ids is None or len(token_ids) == 0:
        return None
    if isinstance(token_ids, bytes):
        return token_ids
    if isinstance(token_ids, np.ndarray) and token_ids.dtype == _INT64 and token_ids.ndim == 1:
        return token_ids.tobytes()
    return np.ascontiguousarray(np.asarray(token_ids).ravel(), _INT64).tobytes()


def _lookahead_bytes(lookahead: Sequence[Sequence[int]] | np.ndarray | None
                    ) -> tuple[int, bytes | None]:
    """A Store's lookahead tokens, one row per key (all rows alike long), as (tokens per key,
    little-endian int64 bytes); (0, None) for none. The daemon checks the counts and ids."""
    if lookahead is None or len(lookahead) == 0:
        return 0, None
    try:
        rows = np.asarray(lookahead)
    except ValueError:  # rows of different lengths
        rows = np.asarray([], dtype=object)
    if rows.ndim == 2 and rows.shape[1] == 0:  # no token after any page
        return 0, None
    if rows.ndim != 2 or rows.dtype.kind not in "iu":
        raise TokenIdsInvalid("lookahead_token_ids must be one row of integer ids per key, "
                              "every row as long", metadata={"field": "lookahead_token_ids",
                                                             "dtype": str(rows.dtype)})
    return int(rows.shape[1]), np.ascontiguousarray(rows, _INT64).tobytes()


class HiCacheClient:
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
        self._want_fast = fast_path and self.target.startswith("unix:")
        self._spin_us = spin_us
        self._fast: fp.FastPath | None = None
        self._fast_flags = 0
        self._fast_asked_at = -FAST_RETRY_SECONDS
        self._page_sizes: dict[str, int] = {}
        self._async: ThreadPoolExecutor | None = None
        self._async_lock = lock("client.async")
        self._fast_lock = lock("client.fast_path")

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
                    delay = exc.retry_after()
                log.debug("daemon %s, retrying in %.3fs", exc.reason.lower(), delay)
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, 1.0)

    def close(self) -> None:
        """Close the channel; heartbeats of sessions opened through it stop."""
        for s in list(self._sessions):
            s.stop_heartbeat()
        self._want_fast = False
        if self._fast is not None:
            self._fast.close()
        if self._async is not None:
            self._async.shutdown(wait=False)
        self._channel.close()

    def __enter__(self) -> HiCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- RPCs ------------------------------------------------------------------------------

    def ping(self) -> None:
        self.call("Ping", _NONE)

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
        info: pb.GetInfoResponse = self.call("GetInfo", _NONE)
        return info

    def create_pool(self, spec: PoolSpec | pb.PoolSpec, *, wait: bool = True,
                    wait_seconds: float = 3600.0) -> PoolInfo:
        """Create the pool (or find it). The daemon answers at once and builds a new pool in
        the background; with ``wait`` this returns once it is READY (or raises the error its
        build failed with, or ``POOL_NOT_READY`` after ``wait_seconds``)."""
        name = spec.name  # (a wire spec goes as it is: the daemon checks it)
        info: PoolInfo = self.call("CreatePool", CreatePoolRequest(spec),  # type: ignore[arg-type]
                                   pool=name)
        deadline, delay = time.monotonic() + wait_seconds, 0.01
        while wait and info.state == "CREATING":
            if time.monotonic() > deadline:
                raise PoolNotReady(f"pool {name} still building after {wait_seconds:.0f}s "
                                   f"({info.progress:.0%})",
                                   metadata={"pool": name, "state": info.state})
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
            info = self.get_pool(name)
        if wait and info.state == "FAILED":
            raise error_class_for(info.error_reason)(info.error, metadata={"pool": name})
        return info

    def get_pool(self, name: str) -> PoolInfo:
        """The pool in any state (``state``: READY, CREATING with ``progress``, FAILED)."""
        info: PoolInfo = self.call("GetPool", PoolRequest(name))
        return info

    def list_pools(self) -> list[PoolInfo]:
        return [pool_from_proto(p) for p in self.list_pools_raw().pools]

    def list_pools_raw(self) -> pb.ListPoolsResponse:
        """The wire response, for tools that print it as is."""
        resp: pb.ListPoolsResponse = self.call("ListPools", _NONE)
        return resp

    def delete_pool(self, name: str) -> None:
        self.call("DeletePool", PoolRequest(name), pool=name)

    def drain(self, grace_seconds: float = 0.0) -> pb.DrainResponse:
        """Begin the daemon's graceful shutdown (as SIGTERM); 0 = its configured grace."""
        resp: pb.DrainResponse = self.call("Drain", DrainRequest(grace_seconds))
        return resp

    def open_session(self, pool: str, worker_id: str,
                     buffers: Sequence[DeviceBufferSpec | pb.DeviceBuffer], *,
                     lease_ms: int = 0, heartbeat: bool = True,
                     layer_events: Sequence[bytes] = (), ready_event: bytes = b"",
                     fds: Sequence[int] = ()) -> WorkerSession:
        """Attach ``buffers`` (shm, memfd, cuda_ipc or cuda_vmm). memfd and cuda_vmm buffers
        need their ``fds`` (``ShmDeviceBuffers.fds``, ``CudaDeviceBuffers.fds``), passed to the
        daemon over its identity socket (they stay the caller's). CUDA sessions may pass the
        IPC handles of interprocess events the worker owns:
        ``layer_events`` are recorded by the daemon as layer groups of a load land,
        ``ready_event`` is waited on before each copy."""
        token = self.peer_token(fds)
        if fds and not token:
            raise TransportUnavailable(
                "memfd and cuda_vmm buffers' fds travel over the daemon's identity socket "
                "(<socket>.id), which "
                f"{self.target} does not offer", metadata={"target": self.target})
        s: pb.Session = self.call("OpenSession", OpenSessionRequest(  # wire buffers as they are
            pool, worker_id, buffers, list(layer_events),  # type: ignore[arg-type]
            ready_event, lease_ms, token))
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
        s: pb.Session = self.call("Heartbeat", SessionRequest(session_id), timeout=timeout)
        return s

    def forget_session(self, session_id: str) -> None:
        """What this client kept for a session it uses no more (no call)."""
        self._page_sizes.pop(session_id, None)

    def close_session(self, session_id: str, *, timeout: float | None = None) -> None:
        """End a session (``SESSION_ENDING`` while a copy of it still runs after an earlier
        close; ``SESSION_NOT_FOUND`` once none does)."""
        self.forget_session(session_id)
        self.call("CloseSession", SessionRequest(session_id), timeout=timeout,
                  pool=None if not is_public_id(session_id) else "")

    def list_sessions(self, pool: str = "") -> list[pb.Session]:
        sessions: list[pb.Session] = self.call("ListSessions", PoolRequest(pool))
        return sessions

    def alloc(self, pool: str, num_tokens: int, session_id: str = "") -> torch.Tensor:
        """Token indices of fresh raw host pages, as an int64 tensor; owned by
        ``session_id`` (freed when it ends) when one is given."""
        import torch

        return torch.from_numpy(self.call("Alloc", AllocRequest(pool, num_tokens, session_id),
                                          pool=pool))

    def free(self, pool: str, host_indices: object) -> int:
        freed: int = self.call("Free", FreeRequest(pool, host_indices),  # type: ignore[arg-type]
                               pool=pool)
        return freed

    # -- choosing the path -------------------------------------------------------------------

    @property
    def data_path(self) -> str:
        """``fast`` while the data calls go over the daemon's fast path, else ``grpc``."""
        return "fast" if self._fast_path() is not None else "grpc"

    def _fast_path(self, timeout: float | None = None) -> fp.FastPath | None:
        """The fast path, asking the daemon for it first if need be, within ``timeout``
        (the call's): a caller never waits past its own deadline for another thread's
        GetInfo, nor for its own (it goes over gRPC instead)."""
        if self._fast is not None or not self._want_fast:
            return self._fast
        wait = min(timeout or self.timeout, 5.0)
        if not self._fast_lock.acquire(timeout=wait):  # one thread asks; others wait, briefly
            return None
        try:
            return self._ask_fast_path(wait)
        finally:
            self._fast_lock.release()

    def _ask_fast_path(self, timeout: float) -> fp.FastPath | None:
        if self._fast is not None or not self._want_fast:
            return self._fast
        now = time.monotonic()
        if now - self._fast_asked_at < FAST_RETRY_SECONDS:
            return None
        self._fast_asked_at = now
        try:
            info = self._stub.GetInfo(pb.GetInfoRequest(), timeout=timeout)
        except grpc.RpcError:
            return None
        if not info.fast_path or info.fast_path_version != w.VERSION:
            return None
        # a daemon that does not say understands the flags the framing had before FLAG_CHAIN
        # (not those that came later: its frames would have bytes left over, or its replies
        # fewer than asked for)
        self._fast_flags = info.fast_path_flags or w.UNSAID_FLAGS
        # the socket beside ours (the daemon may see its sockets at another path), else its
        mine = paths.beside(paths.unix_path(self.target), paths.FAST_PATH_SUFFIX)
        path = mine if os.path.exists(mine) else info.fast_path
        self._fast = fp.FastPath(path, self.timeout, self._spin_us, self._trusted)
        log.info("data calls to %s over the fast path %s", self.target, path)
        return self._fast

    def _fast_call(self, method: w.Method, build: Callable[[], list[bytes]], flags: int = 0,
                   timeout: float | None = None) -> bytes | None:
        """The reply body over the fast path, or None: send it over gRPC. Everything it
        does (asking for the fast path, connecting, retrying an OVERLOADED) stays within
        ``timeout`` (the call's; the client's when None)."""
        start = time.monotonic()
        fast = self._fast_path(timeout)
        if fast is None or flags & ~self._fast_flags:
            return None  # (a flag this daemon's fast path does not know: gRPC)
        try:
            parts = build()
        except ValueError:
            return None  # a key the framing cannot carry: gRPC names it
        budget = timeout or self.timeout
        deadline = start + min(self.reconnect_seconds, budget)
        while True:
            left = start + budget - time.monotonic()
            if left <= 0:
                raise fp.deadline_exceeded("before the call could be sent")
            try:  # the whole budget while little of it is spent (the socket's timeout is
                # set only when it changes: a syscall saved per call)
                return fast.call(method, parts, flags, budget if budget - left < 0.01 else left)
            except fp.FastPathLost as exc:
                log.info("fast path lost (%s); data calls over gRPC", exc)
                self._fast = None
                self._fast_asked_at = time.monotonic()
                fast.close()
                return None
            except Draining:
                return None  # gRPC's retry waits for the successor
            except Overloaded as exc:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise
                time.sleep(min(exc.retry_after(), remaining))

    def _pages(self, session_id: str, indices: object) -> IndexArray | None:
        page_size = self._page_sizes.get(session_id, 0)
        return fp.page_ids(indices, page_size) if page_size else None

    def call(self, name: str, request: Any, fast_request: Any = None, *,
             timeout: float | None = None, pool: str | None = None) -> Any:
        """One call (``codecs.CODECS[name]``): over the fast path when ``fast_request``
        is given (the request as the fast path carries it: device indices as page ids, the
        pool's credential in it) and the path is there, else ``request`` over gRPC (retried
        where the call is idempotent). Either way the same result, or the same domain error.
        ``pool``: the pool a pool-level call acts on (see ``_call``)."""
        codec = CODECS[name]
        start = time.monotonic()
        if fast_request is not None and codec.fast is not None:
            got = self._fast_call(codec.fast, lambda: codec.body(fast_request),
                                  codec.flags(fast_request), timeout)
            if got is not None:
                return codec.from_fast(got, fast_request)
        return codec.from_grpc(self._call(getattr(self._stub, codec.grpc),
                                          codec.message(request), retry=codec.retry,
                                          timeout=_left(start, timeout), pool=pool))

    def beat(self, session_id: str) -> None:
        """A heartbeat of ``session_id``: over the fast path where it is offered (an idle
        worker's only call; over gRPC it costs the daemon about a millisecond of CPU)."""
        q = SessionRequest(session_id)
        self.call("Heartbeat", q, q)

    # -- raw pages ---------------------------------------------------------------------------

    def backup(self, session_id: str, host_indices: object, device_indices: object,
               layer_begin: int = 0, layer_end: int = 0) -> TransferStats:
        return self._transfer("Backup", session_id, host_indices, device_indices,
                              layer_begin, layer_end)

    def load(self, session_id: str, host_indices: object, device_indices: object,
             layer_begin: int = 0, layer_end: int = 0, *, layer_events: bool = False
             ) -> TransferStats:
        """Copy host pages to the device. ``layer_events=True`` (CUDA sessions opened with
        layer events) returns once the copies are enqueued: wait on the session's events
        before reading each layer."""
        return self._transfer("Load", session_id, host_indices, device_indices,
                              layer_begin, layer_end, layer_events)

    def _transfer(self, name: str, session_id: str, host: object, dev: object,
                  begin: int, end: int, layer_events: bool = False) -> TransferStats:
        hp, dp = self._pages(session_id, host), self._pages(session_id, dev)
        deadline = self._deadline_ns(None) if name == "Load" else 0
        q = TransferRequest(session_id, host, dev, (begin, end),  # type: ignore[arg-type]
                            layer_events, deadline)
        fast = (TransferRequest(session_id, PageIds(hp), PageIds(dp), (begin, end),
                                layer_events, deadline)
                if hp is not None and dp is not None else None)
        result: TransferStats = self.call(name, q, fast)
        return result

    def _deadline_ns(self, timeout: float | None) -> int:
        """A copy's deadline on this node's clock: no copy into or out of the caller's
        memory begins after the caller has given up on it (``DEADLINE_PASSED``)."""
        return time.time_ns() + int((timeout or self.timeout) * 1e9)

    # -- the cache ---------------------------------------------------------------------------

    def lookup(self, pool: str, keys: Sequence[bytes | str], *, timeout: float | None = None,
               session_id: str = "", hold_ms: int = 0, touch: bool = False) -> LookupResult:
        """Which keys are cached (no copy): the hit prefix and a tier per key. With
        ``session_id`` (a session of ``pool``) and ``hold_ms`` the hit is held for that
        session until its ``load_keys`` consumes it, ``release_holds``, its end or
        ``hold_ms`` (``held`` says how many leading keys). ``touch``: the hit's host pages
        count as used now, as a load makes them (the engine still uses them where the cache
        cannot see it: its own prefix cache). ``timeout`` overrides the client's deadline for
        this call."""
        enc = encode_keys(keys)
        hold = bool(session_id and hold_ms > 0)
        q = LookupRequest(pool, enc, session_id if hold else "", hold_ms if hold else 0, touch)
        # the fast path carries the pool's credential in the request (gRPC: in metadata)
        cred = session_id if hold else (self._credentials(pool) or [("", "")])[0][1]
        # the reply says what is promised (a daemon from before refuses the flag)
        promise = (hold and self._fast_path(timeout) is not None
                   and bool(self._fast_flags & w.FLAG_PROMISE))
        result: LookupResult = self.call("Lookup", q,
                                         LookupRequest(pool, enc, cred, q.hold_ms, touch,
                                                       promise),
                                         timeout=timeout, pool=pool)
        return result

    def release_holds(self, session_id: str, keys: Sequence[bytes | str] = (), *,
                      timeout: float | None = None) -> int:
        """End the session's holds of ``keys`` (none: all of them); returns how many."""
        q = ReleaseHoldsRequest(session_id, encode_keys(keys))
        released: int = self.call("ReleaseHolds", q, q, timeout=timeout)
        return released

    def store(self, session_id: str, keys: Sequence[bytes | str], device_indices: object,
              *, token_ids: Sequence[int] | np.ndarray | None = None,
              parent_key: bytes | str = b"", lora_name: str = "", cache_salt: str = "",
              lookahead_token_ids: Sequence[Sequence[int]] | np.ndarray | None = None,
              timeout: float | None = None) -> StoreResult:
        """The device pages of ``device_indices`` cached under ``keys``. Once ``timeout``
        (the client's when None) has passed the caller may reuse those pages: the daemon
        then begins no copy, and keeps nothing of a copy that ends later
        (``DEADLINE_PASSED``). ``lookahead_token_ids``: one row per key, every row as long
        (``WorkerSession.store``)."""
        q = self._store_request(session_id, keys, device_indices, token_ids, parent_key,
                                self._deadline_ns(timeout), lora_name, cache_salt,
                                lookahead_token_ids)
        fast = None
        dp = self._pages(session_id, device_indices)
        if dp is not None and self._fast_path(timeout) is not None:
            # a daemon from before Store deadlines (or namespaces, or lookahead tokens)
            # refuses a Store frame that carries one: it gets none (and could not honour it
            # over gRPC either)
            flags = self._fast_flags
            named, ahead = flags & w.FLAG_NAMESPACE, flags & w.FLAG_LOOKAHEAD
            fast = StoreRequest(q.session_id, q.keys, PageIds(dp), q.layers, q.token_ids,
                                q.parent_key, q.deadline_ns if flags & w.STORE_DEADLINE else 0,
                                q.lora_name if named else "", q.cache_salt if named else "",
                                q.lookahead_tokens if ahead else 0,
                                q.lookahead_token_ids if ahead else None)
        result: StoreResult = self.call("Store", q, fast, timeout=timeout)
        return result

    @staticmethod
    def _store_request(session_id: str, keys: Sequence[bytes | str], device_indices: object,
                       token_ids: Sequence[int] | np.ndarray | None, parent_key: bytes | str,
                       deadline_ns: int, lora_name: str = "", cache_salt: str = "",
                       lookahead: Sequence[Sequence[int]] | np.ndarray | None = None
                       ) -> StoreRequest:
        parent = encode_keys([parent_key], "parent_key")[0] if parent_key else b""
        tokens = _token_bytes(token_ids)
        ns = check_namespace(lora_name, cache_salt)
        ahead, ahead_ids = _lookahead_bytes(lookahead)
        return StoreRequest(session_id, encode_keys(keys), device_indices,  # type: ignore[arg-type]
                            (0, 0), tokens, parent, deadline_ns, *ns, ahead, ahead_ids)

    def store_async(self, session_id: str, keys: Sequence[bytes | str],
                    device_indices: object, *,
                    token_ids: Sequence[int] | np.ndarray | None = None,
                    parent_key: bytes | str = b"", lora_name: str = "",
                    cache_salt: str = "",
                    lookahead_token_ids: Sequence[Sequence[int]] | np.ndarray | None = None
                    ) -> Future[StoreResult]:
        """``store`` without blocking the caller: a future of its result (or domain error).
        It runs on one of ``STORE_THREADS`` threads through the one call path (fast path or
        gRPC, the same deadline, credentials and errors as ``store``)."""
        with self._async_lock:
            if self._async is None:
                self._async = ThreadPoolExecutor(STORE_THREADS,
                                                 thread_name_prefix="hicache-store")
            pool = self._async
        return pool.submit(self.store, session_id, keys, device_indices, token_ids=token_ids,
                           parent_key=parent_key, lora_name=lora_name, cache_salt=cache_salt,
                           lookahead_token_ids=lookahead_token_ids)

    def load_keys(self, session_id: str, keys: Sequence[bytes | str], device_indices: object,
                  layer_begin: int = 0, layer_end: int = 0, *, layer_events: bool = False,
                  timeout: float | None = None) -> TransferStats:
        """The pages of ``keys`` into one device page each (see ``WorkerSession``). No copy
        begins once ``timeout`` (the client's when None) has passed."""
        dp = self._pages(session_id, device_indices)
        q = LoadKeysRequest(session_id, encode_keys(keys), device_indices,  # type: ignore[arg-type]
                            (layer_begin, layer_end), layer_events,
                            self._deadline_ns(timeout))
        fast = (LoadKeysRequest(session_id, q.keys, PageIds(dp), q.layers, layer_events,
                                q.deadline_ns) if dp is not None else None)
        result: TransferStats = self.call("LoadKeys", q, fast, timeout=timeout)
        return result

    # -- the cache's control calls ---------------------------------------------------------

    def remove_keys(self, pool: str, keys: Sequence[bytes | str]) -> int:
        removed: int = self.call("RemoveKeys", KeysRequest(pool, encode_keys(keys)), pool=pool)
        return removed

    def clear_pool(self, pool: str) -> int:
        """Drop every key of the pool (raw pages stay); returns how many."""
        removed: int = self.call("ClearPool", PoolRequest(pool), pool=pool)
        return removed

    def watch_events(self, pool: str, after_seq: int = 0, *, all_tiers: bool = False
                     ) -> EventStream:
        """The pool's STORED / REMOVED / EVICTED events after ``after_seq``, as they happen:
        of host memory, or with ``all_tiers`` of every tier (each event names its tier)."""
        metadata = self._credentials(pool)
        if not metadata and self.target.startswith("unix:"):
            metadata = [(PEER_TOKEN_HEADER, self.peer_token())]  # in case a rule covers it
        return EventStream(self._stub.WatchEvents(CODECS["WatchEvents"].message(
            WatchEventsRequest(pool, after_seq, all_tiers)), metadata=metadata))


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


def _left(start: float, timeout: float | None) -> float | None:
    """What is left of a call's ``timeout`` once the fast path gave up on it (None: none)."""
    return None if timeout is None else max(timeout - (time.monotonic() - start), 0.001)
