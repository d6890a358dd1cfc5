"""Cross-cutting concerns of every ``hicache.v1.HostCache`` RPC, as ``grpc.ServerInterceptor``s.

The servicer's handlers only decode, call the daemon and encode; what every call needs is here,
outermost first (the order ``server_interceptors`` returns):

- ``ExecutorInterceptor``: data methods run on their own executor (gRPC's per-handler
  ``experimental_thread_pool``), every other call on the server's: transfers and control calls
  never wait for each other's threads.
- ``ErrorMappingInterceptor``: a domain error leaves as its gRPC code with a rich
  ``google.rpc.Status`` (``hicache.error_mapping``); anything else is logged with its traceback
  and becomes INTERNAL without leaking internals to the caller.
- ``MetricsInterceptor``: ``hicache_rpc_requests_total{method, code}``,
  ``hicache_rpc_duration_seconds{method}`` and ``hicache_rejected_requests_total{reason}``.
- ``AuthInterceptor``: on TCP listeners with ``auth_token_file``, the bearer token every call
  must carry (compared in constant time); Unix-socket callers pass (the socket's permissions
  are their boundary). Mutual TLS is enforced by the listener itself.
- ``PoolAccessInterceptor`` (only with ``[[access]]`` rules): pool-level calls on a pool a rule
  covers (CreatePool, DeletePool, Alloc, Free, Lookup, RemoveKeys, ClearPool, WatchEvents,
  CloseSession by public id) need a credential in the call's metadata: ``hicache-session``, the
  capability of an open session on that pool (its opener was checked), or
  ``hicache-peer-token``, an identity-socket token of a peer the rules list. Else
  ``PEER_NOT_ALLOWED``. Session-bound calls are covered by the capability they carry.
- ``AdmissionInterceptor``: the data path's bound (``admission.DataGate``, shared with the fast
  path): at most ``max_data_rpcs`` transfers at once,
  past it ``OVERLOADED`` at once with a retry hint (never a queue), so control calls (health,
  heartbeats, sessions, pools) always find an RPC thread while transfers saturate the rest.
- ``DrainInterceptor``: the daemon's drain gate: in-flight accounting, and ``DRAINING`` for
  work-creating methods once shutdown began. Server streams (WatchEvents) are not gated: they
  end by themselves when the daemon drains.

Health checking and reflection pass through untouched.
"""

from __future__ import annotations

import fnmatch
import hmac
import logging
import time
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import grpc

from hicache.error_mapping import abort_status, grpc_code
from hicache.errors import HiCacheError, SessionNotFound, Unauthenticated
from hicache.identity import PEER_TOKEN_HEADER, SESSION_HEADER, is_public_id
from hicached.server.admission import DataGate
from hicached.server.daemon import Daemon
from hicached.server.identity import check_access
from hicached.server.metrics import Metrics

log = logging.getLogger(__name__)

SERVICE_PREFIX = "/hicache.v1.HostCache/"

Behavior = Callable[[Any, grpc.ServicerContext], Any]
StreamBehavior = Callable[[Any, grpc.ServicerContext], Iterator[Any]]


class _ServiceInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Wraps the handlers of ``hicache.v1.HostCache`` (unary with ``wrap``, server streams
    with ``wrap_stream``), once per method: the service's handlers never change, so the
    wrapped chain is reused."""

    def __init__(self) -> None:
        self._wrapped: dict[str, Any] = {}

    def wrap(self, method: str, behavior: Behavior) -> Behavior:
        raise NotImplementedError

    def wrap_stream(self, method: str, behavior: StreamBehavior) -> StreamBehavior:
        return behavior

    def intercept_service(self, continuation: Callable[[Any], Any],
                          handler_call_details: Any) -> Any:
        full: str = handler_call_details.method
        wrapped = self._wrapped.get(full)
        if wrapped is not None:
            return wrapped
        handler = continuation(handler_call_details)
        if handler is None or not full.startswith(SERVICE_PREFIX):
            return handler
        method = full[len(SERVICE_PREFIX):]
        codec = {"request_deserializer": handler.request_deserializer,
                 "response_serializer": handler.response_serializer}
        if handler.unary_unary is not None:
            wrapped = grpc.unary_unary_rpc_method_handler(
                self.wrap(method, handler.unary_unary), **codec)
        elif handler.unary_stream is not None:
            wrapped = grpc.unary_stream_rpc_method_handler(
                self.wrap_stream(method, handler.unary_stream), **codec)
        else:
            return handler
        self._wrapped[full] = wrapped
        return wrapped


class ErrorMappingInterceptor(_ServiceInterceptor):
    def wrap(self, method: str, behavior: Behavior) -> Behavior:
        def mapped(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                return behavior(request, context)
            except Exception as exc:
                _abort(method, exc, context)
                raise  # unreachable: abort raises

        return mapped

    def wrap_stream(self, method: str, behavior: StreamBehavior) -> StreamBehavior:
        def mapped(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from behavior(request, context)
            except Exception as exc:
                _abort(method, exc, context)

        return mapped


def _abort(method: str, exc: Exception, context: grpc.ServicerContext) -> None:
    """A domain error as its rich status; anything else logged and INTERNAL."""
    if isinstance(exc, HiCacheError):
        log.info("%s rejected: %s", method, exc)
        context.abort_with_status(abort_status(exc))
    log.error("%s failed", method, exc_info=exc)
    context.abort(grpc.StatusCode.INTERNAL, f"{method} failed; see the daemon log")


class MetricsInterceptor(_ServiceInterceptor):
    def __init__(self, metrics: Metrics) -> None:
        super().__init__()
        self._metrics = metrics

    def wrap(self, method: str, behavior: Behavior) -> Behavior:
        def observed(request: Any, context: grpc.ServicerContext) -> Any:
            with self._observing(method):
                return behavior(request, context)

        return observed

    def wrap_stream(self, method: str, behavior: StreamBehavior) -> StreamBehavior:
        def observed(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            with self._observing(method):
                yield from behavior(request, context)

        return observed

    @contextmanager
    def _observing(self, method: str) -> Iterator[None]:
        """Count the call under the code it ends with, and time it."""
        t0 = time.perf_counter()
        code = "OK"
        try:
            yield
        except BaseException as exc:
            code = self._failed(exc)
            raise
        finally:
            self._metrics.requests.labels(method, code).inc()
            self._metrics.rpc_seconds.labels(method).observe(time.perf_counter() - t0)

    def _failed(self, exc: BaseException) -> str:
        """The code a call ends with, counting domain rejections by reason."""
        if isinstance(exc, HiCacheError):
            self._metrics.rejected.labels(exc.reason).inc()
            return str(grpc_code(exc).name)
        if isinstance(exc, GeneratorExit):
            return "CANCELLED"  # the client went away mid-stream
        return "INTERNAL"


class _CheckInterceptor(_ServiceInterceptor):
    """An interceptor that only checks a call before it runs (``wrap`` raises or passes the
    call on): a server stream gets the same check before its first message."""

    def wrap_stream(self, method: str, behavior: StreamBehavior) -> StreamBehavior:
        check = self.wrap(method, lambda r, c: None)

        def checked(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            check(request, context)
            yield from behavior(request, context)

        return checked


class AuthInterceptor(_CheckInterceptor):
    def __init__(self, token: str) -> None:
        """``token``: what TCP callers must send as ``authorization: Bearer <token>``."""
        super().__init__()
        self._expected = f"Bearer {token}".encode()

    def wrap(self, method: str, behavior: Behavior) -> Behavior:
        def authenticated(request: Any, context: grpc.ServicerContext) -> Any:
            if not context.peer().startswith("unix:"):
                sent = dict(context.invocation_metadata()).get("authorization", "")
                if not hmac.compare_digest(str(sent).encode(), self._expected):
                    raise Unauthenticated("this listener needs the daemon's bearer token "
                                          "(authorization: Bearer ...)")
            return behavior(request, context)

        return authenticated


_POOL_OF: dict[str, Callable[[Any], str]] = {
    "CreatePool": lambda r: str(r.spec.name),
    "DeletePool": lambda r: str(r.name),
    **{m: (lambda r: str(r.pool)) for m in ("Alloc", "Free", "Lookup", "RemoveKeys",
                                            "ClearPool", "WatchEvents")},
}
"""Pool-level methods guarded by access rules, and where their request names the pool."""


class PoolAccessInterceptor(_CheckInterceptor):
    def __init__(self, daemon: Daemon) -> None:
        super().__init__()
        self._daemon = daemon
        self._covered: dict[str, bool] = {}

    def _is_covered(self, pool: str) -> bool:
        got = self._covered.get(pool)
        if got is None:
            if len(self._covered) > 4096:
                self._covered.clear()
            got = self._covered[pool] = any(fnmatch.fnmatchcase(pool, r.pools)
                                            for r in self._daemon.access)
        return got

    def authorize(self, pool: str, context: grpc.ServicerContext, capability: str = ""
                  ) -> None:
        """PEER_NOT_ALLOWED unless the call carries a credential for ``pool``."""
        if not self._is_covered(pool):
            return
        d = self._daemon
        md = dict(context.invocation_metadata())
        for sid in (capability, str(md.get(SESSION_HEADER, ""))):
            if sid and not is_public_id(sid):
                try:
                    if d.sessions.get(sid).pool_name == pool:
                        return
                except SessionNotFound:
                    pass
        grant = d.identify(str(md.get(PEER_TOKEN_HEADER, "")))
        if grant is not None:
            grant.close()
        check_access(d.access, pool, grant.peer if grant is not None else None)

    def _pool_and_capability(self, method: str, request: Any) -> tuple[str, str]:
        if method == "CloseSession":
            sid = str(request.session_id)
            if not is_public_id(sid):
                return "", ""  # the capability itself: the handler checks it
            found = [s for s in self._daemon.sessions.list() if s.public_id == sid]
            return (found[0].pool_name, "") if found else ("", "")
        capability = str(request.session_id) if method in ("Alloc", "Lookup") else ""
        return _POOL_OF[method](request), capability

    def wrap(self, method: str, behavior: Behavior) -> Behavior:
        if method not in _POOL_OF and method != "CloseSession":
            return behavior

        def authorized(request: Any, context: grpc.ServicerContext) -> Any:
            pool, capability = self._pool_and_capability(method, request)
            if pool:
                self.authorize(pool, context, capability)
            return behavior(request, context)

        return authorized


class ExecutorInterceptor(_ServiceInterceptor):
    def __init__(self, pool: ThreadPoolExecutor, data_methods: Collection[str]) -> None:
        """``data_methods`` run on ``pool``; must be the outermost interceptor (gRPC reads the
        executor off the handler it is given)."""
        super().__init__()
        self.pool = pool
        self._data = frozenset(data_methods)

    def wrap(self, method: str, behavior: Behavior) -> Behavior:
        if method not in self._data:
            return behavior

        def on_data_pool(request: Any, context: grpc.ServicerContext) -> Any:
            return behavior(request, context)

        on_data_pool.experimental_thread_pool = self.pool  # type: ignore[attr-defined]
        return on_data_pool


class AdmissionInterceptor(_ServiceInterceptor):
    def __init__(self, limit: int | DataGate, data_methods: Collection[str]) -> None:
        """``limit`` calls of ``data_methods`` run at once (a ``DataGate`` the fast path
        shares, or a new one of that size); the next one is refused."""
        super().__init__()
        self.gate = limit if isinstance(limit, DataGate) else DataGate(limit)
        self._data = frozenset(data_methods)

    @property
    def limit(self) -> int:
        return self.gate.limit

    @property
    def in_flight(self) -> int:
        return self.gate.in_flight

    def wrap(self, method: str, behavior: Behavior) -> Behavior:
        if method not in self._data:
            return behavior
        gate = self.gate

        def admitted(request: Any, context: grpc.ServicerContext) -> Any:
            gate.enter()
            try:
                return behavior(request, context)
            finally:
                gate.leave()

        return admitted


class DrainInterceptor(_ServiceInterceptor):
    def __init__(self, daemon: Daemon, creates_work: Collection[str]) -> None:
        """``creates_work``: methods refused while draining (the others still answer)."""
        super().__init__()
        self._daemon = daemon
        self._creates_work = frozenset(creates_work)

    def wrap(self, method: str, behavior: Behavior) -> Behavior:
        d = self._daemon
        creates_work = method in self._creates_work

        def gated(request: Any, context: grpc.ServicerContext) -> Any:
            d.enter(creates_work)
            try:
                return behavior(request, context)
            finally:
                d.leave()

        return gated


def server_interceptors(daemon: Daemon, creates_work: Collection[str],
                        data_methods: Collection[str], max_data_rpcs: int | DataGate,
                        auth_token: str = "", data_pool: ThreadPoolExecutor | None = None
                        ) -> list[grpc.ServerInterceptor]:
    """The interceptors of a daemon's gRPC server, outermost first; ``data_pool`` runs the
    data methods apart from the server's threads."""
    executor: list[grpc.ServerInterceptor] = [
        ExecutorInterceptor(data_pool, data_methods)] if data_pool is not None else []
    auth: list[grpc.ServerInterceptor] = [AuthInterceptor(auth_token)] if auth_token else []
    access: list[grpc.ServerInterceptor] = [PoolAccessInterceptor(daemon)] if daemon.access \
        else []
    return [*executor, ErrorMappingInterceptor(), MetricsInterceptor(daemon.metrics), *auth,
            *access,
            AdmissionInterceptor(max_data_rpcs, data_methods),
            DrainInterceptor(daemon, creates_work)]
