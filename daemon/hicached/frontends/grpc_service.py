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
- ``pool_message(pool, cache, sessions)``, ``build_message(build)``: pools as wire messages.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

import hicache
from hicache import fast_wire
from hicache.codec import buffer_from_proto, spec_from_proto, spec_to_proto
from hicache.errors import PoolNotFound, SpecInvalid
from hicache.layer_groups import check_layer_events
from hicache.v1 import hicache_pb2 as pb
from hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicached.cache.events import HOST, MEDIUM
from hicached.cache.index_types import KEY_INDEX_BYTES
from hicached.cache.pool_cache import PoolCache
from hicached.core.pool import HostPool
from hicached.core.system import available_bytes
from hicached.frontends import grpc_codec
from hicached.frontends.grpc_codec import session_message
from hicached.service import calls
from hicached.service.daemon import Daemon
from hicached.service.identity import check_access
from hicached.service.pool_build import FAILED, PoolBuild
from hicached.tiers.stack import TierStack

log = logging.getLogger(__name__)

WATCH_POLL_SECONDS = 0.5
"""How often an idle event stream checks that its client, its pool and the daemon are there."""


def pool_message(pool: HostPool, cache: PoolCache, sessions: int,
                 tiers: TierStack | None = None) -> pb.Pool:
    counts = pool.allocator.counts()
    used = pool.page_num - counts["free"]
    msg = pb.Pool(spec=spec_to_proto(pool.spec), size_tokens=pool.size_tokens,
                  page_num=pool.page_num, page_bytes=pool.spec.page_bytes, used_pages=used,
                  free_pages=counts["free"], capacity_bytes=pool.nbytes,
                  used_bytes=used * pool.spec.page_bytes, pinned_bytes=pool.pinned_bytes,
                  sessions=sessions, keys=cache.key_count, keyed_pages=counts["keyed"],
                  raw_pages=counts["raw"], busy_pages=counts["held"],
                  pinned_pages=counts["held"],  # the deprecated name of busy_pages
                  metadata_bytes=pool.metadata_bytes + pool.page_num * KEY_INDEX_BYTES,
                  attach_outcome=pool.outcome.value if pool.outcome else "memory",
                  generation=pool.state.generation if pool.state else 0,
                  recovered_keys=cache.recovered_keys)
    if tiers is not None and tiers.disk is not None:
        msg.disk_keys, msg.disk_capacity_pages = tiers.disk.keys, tiers.disk.capacity
    if tiers is not None and tiers.remote is not None:
        msg.remote_namespace = tiers.remote.prefix
        msg.remote_puts = (tiers.writer.put if tiers.writer is not None else
                           tiers.remote_spiller.spilled if tiers.remote_spiller else 0)
        msg.remote_pending = tiers.writer.waiting if tiers.writer is not None else 0
    return msg


def build_message(b: PoolBuild) -> pb.Pool:
    """A pool still building (or whose build failed): its spec, state and progress."""
    failed = b.state == FAILED
    return pb.Pool(spec=spec_to_proto(b.spec), size_tokens=b.spec.resolved_size_tokens(),
                   page_bytes=b.spec.page_bytes,
                   state=pb.POOL_STATE_FAILED if failed else pb.POOL_STATE_CREATING,
                   progress=b.progress, error=b.error.message if b.error else "",
                   error_reason=b.error.reason if b.error else "")






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
        return pb.GetInfoResponse(
            version=hicache.__version__,
            transports=[*(["shm"] if d.shm.accept_paths else []),
                        *(["memfd"] if d.identities else []),
                        *(["cuda_ipc"] if d.cuda is not None else [])],
            memory_budget_bytes=d.pools.budget_bytes,
            memory_used_bytes=d.pools.used_bytes, memory_available_bytes=available_bytes(),
            shm_dir=d.shm.shm_dir, cuda_available=d.cuda is not None,
            serving=not d.draining.is_set(), pools=len(d.pools.list()),
            sessions=d.sessions.count(), metrics_port=d.metrics_port,
            cuda_devices=[pb.CudaDevice(uuid=x.uuid, ordinal=x.ordinal, name=x.name,
                                        total_bytes=x.total_bytes) for x in devices],
            remote_tier=("" if d.pools.remote is None else "up" if d.pools.remote.up
                         else f"down: {d.pools.remote.why}"),
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
        d = self.daemon
        build = d.pools.build(name)
        if build is not None:
            return build_message(build)
        return pool_message(d.pools.get(name), d.pools.cache(name), d.sessions.count(name),
                            d.pools.stack(name))

    def ListPools(self, request: pb.ListPoolsRequest, context: grpc.ServicerContext
                  ) -> pb.ListPoolsResponse:
        d = self.daemon
        stacks = dict(d.pools.stacks())
        return pb.ListPoolsResponse(pools=[
            *(pool_message(p, c, d.sessions.count(p.spec.name), stacks.get(p.spec.name))
              for p, c in d.pools.entries()),
            *(build_message(b) for b in d.pools.builds())])

    def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.ServicerContext
                    ) -> pb.Session:
        d = self.daemon
        pool = d.pools.get(request.pool)
        grant = d.identify(request.peer_token)
        try:
            peer = grant.peer if grant is not None else None
            check_access(d.access, request.pool, peer)  # before anything is mapped
            check_layer_events(len(request.layer_events), pool.spec.max_layers)
            buffers = [buffer_from_proto(b, i) for i, b in enumerate(request.buffers)]
            attachment = d.attach(buffers, list(request.layer_events),
                                  bytes(request.ready_event), grant.fds if grant else ())
        finally:
            if grant is not None:
                grant.close()  # mapped (the mappings hold the memory) or refused
        try:
            assert attachment.buffers is not None
            tokens = attachment.buffers.check_against(pool.spec)
            session = d.sessions.open(request.pool, pool, request.worker_id, attachment, tokens,
                                      request.lease_ms / 1000.0, peer)
        except BaseException:
            attachment.release()
            raise
        return session_message(session)

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
        d = self.daemon
        cache = d.pools.cache(request.pool)
        seq = int(request.after_seq)
        with d.watch_slot():
            while context.is_active() and not d.draining.is_set():
                for ev in cache.events.wait(seq, WATCH_POLL_SECONDS):
                    seq = ev.seq
                    if ev.tier != HOST and not request.all_tiers:
                        continue
                    yield pb.CacheEvent(
                        seq=ev.seq, kind=ev.kind.value,  # type: ignore[arg-type]
                        keys=list(ev.keys), pool=request.pool, tier=ev.tier,
                        medium=MEDIUM[ev.tier], parent_key=ev.parent,
                        token_ids=ev.token_ids.tolist() if ev.token_ids is not None else (),
                        block_size=cache.pool.page_size)
                if d.pools.cache(request.pool) is not cache:  # deleted and made again
                    raise PoolNotFound(f"pool {request.pool} was deleted",
                                       metadata={"pool": request.pool})

