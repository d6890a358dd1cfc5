"""The gRPC servicer of ``hicache.v1.HostCache``: every method of ``service.calls.METHODS``.

Each is served the same way: its request arrives decoded by ``grpc_codec`` (the interceptor
decodes it, so the envelope's access rules read the same typed request on both front ends),
the table's handler runs, and the codec encodes the result (a server stream's: each message,
while the client is there).

Primitives: ``HostCacheServicer(daemon)``; domain errors, metrics, access rules, admission and
the drain gate are the envelope's (``envelope``, through ``interceptors``), the flows the
service's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

from hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicached.frontends import grpc_codec
from hicached.service import calls
from hicached.service.daemon import Daemon


class HostCacheServicer(pb_grpc.HostCacheServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        for m in calls.METHODS.values():
            serve = self._stream(m) if m.stream else self._unary(m)
            serve.__name__ = m.name
            setattr(self, m.name, serve)

    def _unary(self, m: calls.Method) -> Callable[[Any, grpc.ServicerContext], Any]:
        daemon, handler, request_type = self.daemon, m.handler, m.request
        codec = grpc_codec.CODECS[m.name]

        def serve(request: Any, context: grpc.ServicerContext) -> Any:
            if type(request) is not request_type:  # not decoded by the interceptor
                request = codec.decode(request)
            return codec.encode(handler(daemon, request))

        return serve

    def _stream(self, m: calls.Method) -> Callable[[Any, grpc.ServicerContext], Iterator[Any]]:
        daemon, handler, request_type = self.daemon, m.handler, m.request
        codec = grpc_codec.CODECS[m.name]

        def serve(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            if type(request) is not request_type:
                request = codec.decode(request)
            for item in handler(daemon, request._replace(active=context.is_active)):
                yield codec.encode(item)

        return serve
