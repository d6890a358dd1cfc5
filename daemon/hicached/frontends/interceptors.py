"""The gRPC front end's interceptors: how ``hicache.v1.HostCache`` calls reach the envelope.

The servicer's handlers only decode, call the daemon and encode; what every call needs (error
mapping, metrics, authentication, access rules, admission, the drain gate) is
``envelope.Envelope``'s, shared with the fast path. Here, outermost first:

- ``ExecutorInterceptor``: data methods run on their own executor (gRPC's per-handler
  ``experimental_thread_pool``), every other call on the server's: transfers and control calls
  never wait for each other's threads.
- ``EnvelopeInterceptor``: each call described as an ``envelope.Call`` (from a Unix socket or
  TCP, its metadata) and run through the envelope, its request decoded by ``grpc_codec`` into
  the method's typed request (``service.calls``) where the table has one; a refusal leaves
  as its gRPC code with the rich ``google.rpc.Status``. Server streams (WatchEvents) the
  same, through ``Envelope.stream``. A keyed request larger than any legal one
  (``service.request_bounds``) is not decoded: its refusal runs through the envelope like any
  other.

Health checking and reflection pass through untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from grpc_status import rpc_status

from hicache.errors import HiCacheError
from hicached.frontends.envelope import Call, Envelope, Refused
from hicached.frontends.grpc_codec import CODECS
from hicached.service.calls import DATA_METHODS
from hicached.service.request_bounds import KEYED_METHODS, RequestBounds

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

    def deserializer(self, method: str, decode: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
        """How a request of ``method`` is decoded (the handler's own, unless overridden)."""
        return decode

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
        codec = {"request_deserializer": self.deserializer(method,
                                                           handler.request_deserializer),
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


class EnvelopeInterceptor(_ServiceInterceptor):
    """Every call through ``envelope.Envelope``: the call described from gRPC's context (TCP
    or not, its metadata read only when a step asks), a refusal sent as its rich status."""

    def __init__(self, envelope: Envelope, bounds: RequestBounds | None = None) -> None:
        super().__init__()
        self.envelope = envelope
        self.bounds = bounds

    def deserializer(self, method: str, decode: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
        """The protobuf message decoded, then (a method of the table) its typed request: a
        request too large, or a field the codec refuses, becomes an ``_Unread`` whose error
        the envelope's decode step raises."""
        bounds = self.bounds
        codec = CODECS.get(method)
        message: Callable[[bytes], Any] = decode
        if bounds is not None and method in KEYED_METHODS:
            keys_only = bounds.keys_only

            def bounded(data: bytes) -> Any:
                if len(data) > keys_only:  # only then are the pools asked about
                    try:
                        bounds.check(method, len(data))
                    except HiCacheError as exc:
                        return _Unread(exc)
                return decode(data)

            message = bounded
        if codec is None:
            return message
        typed = codec.decode

        def decoded(data: bytes) -> Any:
            msg = message(data)
            if type(msg) is _Unread:
                return msg
            try:
                return typed(msg)
            except Exception as exc:  # the envelope maps it (and logs a non-domain one)
                return _Unread(exc)

        return decoded

    def wrap(self, method: str, behavior: Behavior) -> Behavior:
        env = self.envelope

        def enveloped(request: Any, context: grpc.ServicerContext) -> Any:
            call = _call(method, context)
            try:
                return env.run(call, request.refuse if type(request) is _Unread
                               else lambda: request, lambda r: behavior(r, context))
            except Refused as refused:
                context.abort_with_status(rpc_status.to_status(refused.status))
                raise  # unreachable: abort raises

        return enveloped

    def wrap_stream(self, method: str, behavior: StreamBehavior) -> StreamBehavior:
        env = self.envelope

        def enveloped(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from env.stream(_call(method, context), request,
                                      lambda r: behavior(r, context))
            except Refused as refused:
                context.abort_with_status(rpc_status.to_status(refused.status))

        return enveloped


class _Unread:
    """A request refused before (or while) decoding: the envelope's decode step raises its
    error."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error

    def refuse(self) -> Any:
        raise self.error


def _call(method: str, context: grpc.ServicerContext) -> Call:
    return Call(method, "grpc", tcp=not context.peer().startswith("unix:"),
                credentials=lambda: dict(context.invocation_metadata()))


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


def server_interceptors(envelope: Envelope, data_pool: ThreadPoolExecutor | None = None,
                        bounds: RequestBounds | None = None) -> list[grpc.ServerInterceptor]:
    """The interceptors of a daemon's gRPC server, outermost first; ``data_pool`` runs the
    data methods apart from the server's threads; ``bounds`` refuses keyed requests larger
    than any legal one before they are decoded."""
    executor: list[grpc.ServerInterceptor] = [
        ExecutorInterceptor(data_pool, DATA_METHODS)] if data_pool is not None else []
    return [*executor, EnvelopeInterceptor(envelope, bounds)]
