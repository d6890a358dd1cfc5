"""The one envelope every call of ``hicache.v1.HostCache`` goes through, whichever front end
received it (gRPC through ``interceptors.EnvelopeInterceptor``, the fast path itself).

A front end describes what arrived as a ``Call`` (the method, the front end, whether it came
over TCP, the connection's peer when the kernel named it, the credentials it carried) and runs
its handler with ``Envelope.run(call, decode, handle)``. In this order, the same for both:

1. metrics: the call is counted under its method and the code it ends with, and timed
   (``hicache_rpc_requests_total{method, code}``, ``hicache_rpc_duration_seconds{method}``,
   ``hicache_rejected_requests_total{reason}``; ``hicache_fast_path_requests_total{method}``
   besides for the fast path);
2. error mapping: a domain error leaves as ``Refused`` with its rich ``google.rpc.Status``
   (``hicache.error_mapping``), its log line rate-limited per reason; anything else is logged
   with its traceback and becomes INTERNAL, nothing of it told to the caller;
3. authentication: a TCP caller must carry the daemon's bearer token (constant-time compare);
4. admission: a data method takes a slot of ``admission.DataGate`` (``OVERLOADED`` past it);
5. the drain gate: in-flight accounting, ``DRAINING`` for work-creating methods once
   shutdown began;
6. the request is decoded (the fast path decodes here; gRPC has already);
7. authorization: a pool-level call on a pool an ``[[access]]`` rule covers needs a session
   of that pool, or a peer the rules list (the connection's own, or the identity-socket token
   it carried), else ``PEER_NOT_ALLOWED``;
8. the checks added with ``add_check`` (one place: both front ends refuse alike);
9. the handler.

Server streams (``stream``) get 1-3 and 6-8: they are neither bounded nor drained (they end by
themselves when the daemon drains).

What the envelope knows of a method (whether it creates work, whether it is a data call, where
its request names its pool) is its entry in ``service.calls.METHODS``; the request it reads is
the method's typed request, decoded by either front end's codec.

Primitives: ``Call``; ``Refused``
(``status``, ``code``); ``CallMetrics``; ``Envelope(daemon, gate, metrics, auth_token)``:
``run``, ``stream``, ``add_check``, ``status_of(exc, method)``.
"""

from __future__ import annotations

import fnmatch
import hmac
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import grpc
from google.rpc import status_pb2

from hicache.error_mapping import grpc_code, to_rpc_status
from hicache.errors import HiCacheError, SessionNotFound, Unauthenticated
from hicache.identity import PEER_TOKEN_HEADER, SESSION_HEADER, is_public_id
from hicache.log_limit import LimitedLog
from hicached.service.admission import DataGate
from hicached.service.calls import Method, method
from hicached.service.daemon import Daemon
from hicached.service.identity import Peer, check_access

log = logging.getLogger(__name__)

class Call:
    """One call as its front end received it."""

    __slots__ = ("credentials", "front", "method", "peer", "tcp")

    def __init__(self, method: str, front: str, *, tcp: bool = False, peer: Peer | None = None,
                 credentials: Callable[[], Mapping[str, str]] = dict) -> None:
        self.method, self.front, self.tcp, self.peer = method, front, tcp, peer
        self.credentials = credentials
        """What the call carried (gRPC metadata: ``authorization``, ``hicache-session``,
        ``hicache-peer-token``), read only when a step needs it."""


class Refused(Exception):
    """A call that ends with an error: ``status`` (a ``google.rpc.Status``) and ``code``, for
    its front end to send."""

    def __init__(self, status: status_pb2.Status, code: grpc.StatusCode) -> None:
        super().__init__(status.message)
        self.status, self.code = status, code


Check = Callable[[Call, Any], None]


class CallMetrics(Protocol):
    """The counters of calls (``hicached.server.metrics.Metrics`` has them)."""

    def call(self, method: str, code: str, fast: bool, seconds: float) -> None:
        """A call ended: ``hicache_rpc_requests_total{method, code}``,
        ``hicache_rpc_duration_seconds{method}``, ``hicache_fast_path_requests_total{method}``
        when ``fast``."""

    rejected: Any
    """``hicache_rejected_requests_total{reason}``."""
    fast_dropped: Any
    """``hicache_fast_path_dropped_connections_total{reason}``."""


class Envelope:
    def __init__(self, daemon: Daemon, gate: DataGate, metrics: CallMetrics,
                 auth_token: str = "") -> None:
        """``gate``: the data path's bound; ``metrics``: where calls are counted;
        ``auth_token``: what TCP callers must send as ``authorization: Bearer <token>``
        ("" = no listener asks)."""
        self.daemon, self.gate, self.metrics = daemon, gate, metrics
        self._expected = f"Bearer {auth_token}".encode() if auth_token else b""
        self._checks: list[Check] = []
        self._covered: dict[str, bool] = {}
        self._log = LimitedLog(log)

    def add_check(self, check: Check) -> None:
        """Run ``check(call, request)`` on every call, after authorization: a domain error it
        raises refuses the call, on every front end."""
        self._checks.append(check)

    # -- one call --------------------------------------------------------------------------

    def run(self, call: Call, decode: Callable[[], Any], handle: Callable[[Any], Any]) -> Any:
        """The handler's result; ``Refused`` when the call ends with an error."""
        t0 = time.perf_counter()
        spec = method(call.method)
        try:
            self._authenticate(call)
            if spec.data:
                self.gate.enter()
            try:
                self.daemon.enter(spec.creates_work)
                try:
                    request = decode()
                    self._authorize(call, spec, request)
                    out = handle(request)
                finally:
                    self.daemon.leave()
            finally:
                if spec.data:
                    self.gate.leave()
        except Exception as exc:
            raise self._refused(call, exc, t0) from None
        self._count(call, "OK", t0)
        return out

    def stream(self, call: Call, request: Any, handle: Callable[[Any], Iterator[Any]]
               ) -> Iterator[Any]:
        """A server stream's messages; ``Refused`` when it ends with an error."""
        t0 = time.perf_counter()
        try:
            self._authenticate(call)
            self._authorize(call, method(call.method), request)
            yield from handle(request)
        except GeneratorExit:
            self._count(call, "CANCELLED", t0)  # the client went away mid-stream
            raise
        except Exception as exc:
            raise self._refused(call, exc, t0) from None
        self._count(call, "OK", t0)

    # -- the steps -------------------------------------------------------------------------

    def _authenticate(self, call: Call) -> None:
        if call.tcp and self._expected:
            sent = str(call.credentials().get("authorization", ""))
            if not hmac.compare_digest(sent.encode(), self._expected):
                raise Unauthenticated("this listener needs the daemon's bearer token "
                                      "(authorization: Bearer ...)")

    def _authorize(self, call: Call, spec: Method, request: Any) -> None:
        d = self.daemon
        if d.access and spec.pool_of is not None:
            pool, capability = spec.pool_of(request, d)
            if pool and self._is_covered(pool):
                self._check_peer(call, pool, capability)
        for check in self._checks:
            check(call, request)

    def _is_covered(self, pool: str) -> bool:
        got = self._covered.get(pool)
        if got is None:
            if len(self._covered) > 4096:
                self._covered.clear()
            got = self._covered[pool] = any(fnmatch.fnmatchcase(pool, r.pools)
                                            for r in self.daemon.access)
        return got

    def _check_peer(self, call: Call, pool: str, capability: str) -> None:
        """``PEER_NOT_ALLOWED`` unless the call carries a session of ``pool`` or comes from a
        peer the rules list (its connection's, or the one its identity token names)."""
        d = self.daemon
        creds = call.credentials()
        for sid in (capability, str(creds.get(SESSION_HEADER, ""))):
            if sid and not is_public_id(sid):
                try:
                    if d.sessions.get(sid).pool_name == pool:
                        return
                except SessionNotFound:
                    pass
        peer = call.peer
        if peer is None:
            grant = d.identify(str(creds.get(PEER_TOKEN_HEADER, "")))
            if grant is not None:
                grant.close()
                peer = grant.peer
        check_access(d.access, pool, peer)

    # -- outcomes --------------------------------------------------------------------------

    def status_of(self, exc: Exception, method: str) -> tuple[status_pb2.Status,
                                                                grpc.StatusCode]:
        """What a call that raised ``exc`` answers: a domain error's rich status, or an
        INTERNAL that says nothing of the failure."""
        if isinstance(exc, HiCacheError):
            return to_rpc_status(exc), grpc_code(exc)
        code = grpc.StatusCode.INTERNAL
        return status_pb2.Status(code=code.value[0],
                                 message=f"{method} failed; see the daemon log"), code

    def _refused(self, call: Call, exc: Exception, t0: float) -> Refused:
        status, code = self.status_of(exc, call.method)
        if isinstance(exc, HiCacheError):
            self._log.info("%s rejected: %s", call.method, exc, key=exc.reason)
            self.metrics.rejected.labels(exc.reason).inc()
        else:
            log.error("%s failed", call.method, exc_info=exc)
        self._count(call, str(code.name), t0)
        return Refused(status, code)

    def _count(self, call: Call, code: str, t0: float) -> None:
        self.metrics.call(call.method, code, call.front == "fast", time.perf_counter() - t0)
