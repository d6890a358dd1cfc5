"""The gRPC servicer of ``hicache.v1.HostCache``.

Every method of ``service.calls.METHODS`` with a typed request is served the same way: its
request arrives decoded by ``grpc_codec`` (the interceptor decodes it, so the envelope's
access rules read the same typed request on both front ends), the table's handler runs, and
the codec encodes the result. The control calls whose results are read models the servicer
renders (pools, sessions, the daemon's info, the event stream) have a method of their own.

Primitives:

- ``HostCacheServicer(daemon, drain)``; domain errors, metrics, access rules, admission and
  the drain gate are the envelope's (``envelope``, through ``interceptors``), the flows the
  daemon's (``daemon``).
- ``pool_message(view)``: a pool (``service.views.PoolView``) as its wire message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

import hicache
from hicache import fast_wire
from hicache.codec import buffer_from_proto, spec_from_proto, spec_to_proto
from hicache.errors import SpecInvalid
from hicache.v1 import hicache_pb2 as pb
from hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicached.frontends import grpc_codec
from hicached.frontends.grpc_codec import session_message
from hicached.service import calls, views
from hicached.service.daemon import Daemon
from hicached.service.views import PoolView

log = logging.getLogger(__name__)

def pool_message(v: PoolView) -> pb.Pool:
    state = {"creating": pb.POOL_STATE_CREATING, "failed": pb.POOL_STATE_FAILED}.get(
        v.state, pb.POOL_STATE_READY)
    return pb.Pool(spec=spec_to_proto(v.spec), size_tokens=v.size_tokens,
                   page_bytes=v.page_bytes, state=state, progress=v.progress, error=v.error,
                   error_reason=v.error_reason, page_num=v.page_num, used_pages=v.used_pages,
                   free_pages=v.free_pages, capacity_bytes=v.capacity_bytes,
                   used_bytes=v.used_bytes, pinned_bytes=v.pinned_bytes, sessions=v.sessions,
                   keys=v.keys, keyed_pages=v.keyed_pages, raw_pages=v.raw_pages,
                   busy_pages=v.busy_pages,
                   pinned_pages=v.busy_pages,  # the deprecated name of busy_pages
                   metadata_bytes=v.metadata_bytes, attach_outcome=v.attach_outcome,
                   generation=v.generation, recovered_keys=v.recovered_keys,
                   disk_keys=v.disk_keys, disk_capacity_pages=v.disk_capacity_pages,
                   cluster_namespace=v.cluster_namespace, cluster_puts=v.cluster_puts,
                   cluster_pending=v.cluster_pending,
                   # the deprecated names of the three above
                   remote_namespace=v.cluster_namespace, remote_puts=v.cluster_puts,
                   remote_pending=v.cluster_pending, kv_events_endpoint=v.kv_events_endpoint,
                   kv_events_replay_endpoint=v.kv_events_replay_endpoint)


class HostCacheServicer(pb_grpc.HostCacheServicer):
    def __init__(self, daemon: Daemon, drain: Callable[[float], float]) -> None:
        """``drain(grace_seconds)`` begins the process's graceful shutdown (the Drain RPC) and
        returns the grace period that applies (0 asks for the configured one)."""
        self.daemon = daemon
        self._drain = drain
        for name, codec in grpc_codec.CODECS.items():  # the table's methods
            setattr(self, name, self._typed(calls.METHODS[name], codec))

    def _typed(self, m: calls.Method, codec: grpc_codec.GrpcCodec
               ) -> Callable[[Any, grpc.ServicerContext], Any]:
        daemon, handler, request_type = self.daemon, m.handler, m.request
        assert handler is not None, f"{m.name} has a codec: it has a handler"

        def serve(request: Any, context: grpc.ServicerContext) -> Any:
            if type(request) is not request_type:  # not decoded by the interceptor
                request = codec.decode(request)
            return codec.encode(handler(daemon, request))

        serve.__name__ = m.name
        return serve

    def GetInfo(self, request: pb.GetInfoRequest, context: grpc.ServicerContext
                ) -> pb.GetInfoResponse:
        d = self.daemon
        devices = d.cuda.driver.devices if d.cuda is not None else ()
        store = d.pools.cluster_store
        cluster = "" if store is None else "up" if store.up else f"down: {store.why}"
        return pb.GetInfoResponse(
            version=hicache.__version__,
            transports=[*(["shm"] if d.shm.accept_paths else []),
                        *(["memfd"] if d.identities else []),
                        *(["cuda_ipc"] if d.cuda is not None else [])],
            memory_budget_bytes=d.pools.budget_bytes,
            memory_used_bytes=d.pools.used_bytes,
            memory_available_bytes=views.memory_available_bytes(),
            shm_dir=d.shm.shm_dir, cuda_available=d.cuda is not None,
            serving=not d.draining.is_set(), pools=len(d.pools.list()),
            sessions=d.sessions.count(), metrics_port=d.metrics_port,
            cuda_devices=[pb.CudaDevice(uuid=x.uuid, ordinal=x.ordinal, name=x.name,
                                        total_bytes=x.total_bytes) for x in devices],
            cluster_tier=cluster, remote_tier=cluster,  # remote_tier: its deprecated name
            fast_path=d.fast_paths[0] if d.fast_paths else "",
            fast_path_version=fast_wire.VERSION if d.fast_paths else 0,
            fast_path_flags=fast_wire.KNOWN_FLAGS if d.fast_paths else 0,
            kv_events_endpoint=d.kv_events[0], kv_events_replay_endpoint=d.kv_events[1],
            kv_events_topic=d.kv_events[2],
            max_keys_per_call=d.max_keys_per_call)

    def Ping(self, request: pb.PingRequest, context: grpc.ServicerContext) -> pb.PingResponse:
        return pb.PingResponse()

    def CreatePool(self, request: pb.CreatePoolRequest, context: grpc.ServicerContext
                   ) -> pb.Pool:
        spec = spec_from_proto(request.spec)
        _, started = self.daemon.pools.create_async(spec)
        if started:
            log.info("pool %s: building in the background", spec.name)
        return self._pool(spec.name)

    def GetPool(self, request: pb.GetPoolRequest, context: grpc.ServicerContext) -> pb.Pool:
        return self._pool(request.name)

    def _pool(self, name: str) -> pb.Pool:
        return pool_message(views.pool_view(self.daemon, name))

    def ListPools(self, request: pb.ListPoolsRequest, context: grpc.ServicerContext
                  ) -> pb.ListPoolsResponse:
        return pb.ListPoolsResponse(pools=[pool_message(v)
                                           for v in views.pool_views(self.daemon)])

    def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.ServicerContext
                    ) -> pb.Session:
        return session_message(self.daemon.open_session(
            request.pool, request.worker_id,
            lambda: [buffer_from_proto(b, i) for i, b in enumerate(request.buffers)],
            list(request.layer_events), bytes(request.ready_event), request.lease_ms / 1000.0,
            request.peer_token))

    def ListSessions(self, request: pb.ListSessionsRequest, context: grpc.ServicerContext
                     ) -> pb.ListSessionsResponse:
        return pb.ListSessionsResponse(
            sessions=[session_message(s, capability=False)
                      for s in self.daemon.sessions.list(request.pool)])

    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext
              ) -> pb.DrainResponse:
        grace = float(request.grace_seconds)
        if not 0 <= grace < float("inf"):
            raise SpecInvalid(f"grace_seconds must be a finite number >= 0, got {grace}",
                              metadata={"field": "grace_seconds", "value": grace})
        already = self.daemon.draining.is_set()
        in_flight = self.daemon.in_flight
        grace = self._drain(grace)
        return pb.DrainResponse(in_flight=in_flight, grace_seconds=grace,
                                already_draining=already)

    # -- the cache -------------------------------------------------------------------------

    def WatchEvents(self, request: pb.WatchEventsRequest, context: grpc.ServicerContext
                    ) -> Iterator[pb.CacheEvent]:
        """Events after ``after_seq`` until the client goes, the pool is deleted or the daemon
        drains."""
        for v in views.watch_events(self.daemon, request.pool, int(request.after_seq),
                                    request.all_tiers, context.is_active):
            yield pb.CacheEvent(seq=v.seq, kind=v.kind,  # type: ignore[arg-type]
                                keys=v.keys, pool=v.pool, tier=v.tier, medium=v.medium,
                                parent_key=v.parent_key, token_ids=v.token_ids,
                                block_size=v.block_size, lora_name=v.lora_name,
                                cache_salt=v.cache_salt)
