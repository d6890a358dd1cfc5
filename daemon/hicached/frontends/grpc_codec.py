"""The gRPC front end's codec: protobuf messages <-> ``service.calls``' requests and results.

One ``GrpcCodec`` per method of the table: how its protobuf request decodes (a bad field
raises its domain error, as the fast path's decode does) and how its result encodes into the
response message (a server stream's: each message). The read models of ``service.views``
(pools, sessions, the daemon's info, events) are rendered here and nowhere else.

Primitives: ``GrpcCodec`` (``decode(message)``, ``encode(result)``), ``CODECS`` (by method
name), ``pool_message(pool)``, ``session_message(session)``, ``transfer_response(result)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from hicache.codec import buffer_from_proto, fill_deprecated, pool_to_proto, spec_from_proto
from hicache.indices import indices_to_bytes, to_index_array
from hicache.v1 import hicache_pb2 as pb
from hicached.service import calls as c
from hicached.service.calls import TransferResult
from hicached.service.sessions import Session
from hicached.service.views import EventView, InfoView, session_view


class GrpcCodec(NamedTuple):
    decode: Callable[[Any], Any]
    """The protobuf request -> the typed request."""
    encode: Callable[[Any], Any]
    """The typed result -> the protobuf response."""


def session_message(s: Session, capability: bool = True) -> pb.Session:
    """``capability=False`` for anyone but the worker holding it: the id left empty."""
    v = session_view(s, capability)
    return pb.Session(session_id=v.session_id, public_id=v.public_id, pool=v.pool,
                      worker_id=v.worker_id, lease_ms=v.lease_ms,
                      expires_in_ms=v.expires_in_ms, attached_bytes=v.attached_bytes,
                      device_tokens=v.device_tokens, transfers=v.transfers,
                      device_uuid=v.device_uuid, layer_events=v.layer_events,
                      lease_clamped=v.lease_clamped, peer_known=v.peer_uid is not None,
                      peer_uid=v.peer_uid or 0, peer_gid=v.peer_gid, peer_pid=v.peer_pid,
                      page_size=v.page_size, loads_in_flight=v.loads_in_flight)


pool_message = pool_to_proto


def _info(v: InfoView) -> pb.GetInfoResponse:
    return fill_deprecated(pb.GetInfoResponse(  # type: ignore[no-any-return]
        version=v.version, transports=v.transports, memory_budget_bytes=v.memory_budget_bytes,
        memory_used_bytes=v.memory_used_bytes, memory_available_bytes=v.memory_available_bytes,
        shm_dir=v.shm_dir, cuda_available=v.cuda_available, serving=v.serving, pools=v.pools,
        sessions=v.sessions, metrics_port=v.metrics_port,
        cuda_devices=[pb.CudaDevice(uuid=x.uuid, ordinal=x.ordinal, name=x.name,
                                    total_bytes=x.total_bytes) for x in v.cuda_devices],
        cluster_tier=v.cluster_tier,
        fast_path=v.fast_path, fast_path_version=v.fast_path_version,
        fast_path_flags=v.fast_path_flags, kv_events_endpoint=v.kv_events_endpoint,
        kv_events_replay_endpoint=v.kv_events_replay_endpoint,
        kv_events_topic=v.kv_events_topic, max_keys_per_call=v.max_keys_per_call))


def _event(v: EventView) -> pb.CacheEvent:
    return pb.CacheEvent(seq=v.seq, kind=v.kind,  # type: ignore[arg-type]
                         keys=v.keys, pool=v.pool, tier=v.tier, medium=v.medium,
                         parent_key=v.parent_key, token_ids=v.token_ids,
                         block_size=v.block_size, lora_name=v.lora_name,
                         cache_salt=v.cache_salt)


def _open_session(m: pb.OpenSessionRequest) -> c.OpenSessionRequest:
    return c.OpenSessionRequest(
        m.pool, m.worker_id, lambda: [buffer_from_proto(b, i) for i, b in enumerate(m.buffers)],
        list(m.layer_events), bytes(m.ready_event), int(m.lease_ms), m.peer_token)


def transfer_response(r: TransferResult) -> pb.TransferResponse:
    return pb.TransferResponse(bytes_moved=r.bytes, pages=r.pages, duration_seconds=r.seconds,
                               pending=r.pending)


_NONE = c.NoRequest()


def _layers(m: Any) -> tuple[int, int]:
    return int(m.layer_begin), int(m.layer_end)


def _events(m: Any) -> bool:
    return bool(m.completion == pb.COMPLETION_LAYER_EVENTS)


def _lookup(m: pb.LookupRequest) -> c.LookupRequest:
    return c.LookupRequest(m.pool, list(m.keys), m.session_id, int(m.hold_ms), m.touch)


def _lookup_response(r: c.LookupResult) -> pb.LookupResponse:
    return pb.LookupResponse(hit_prefix=r.hit_prefix, tiers=r.tiers, hits=r.hits, held=r.held,
                             promised=r.promised)


def _store(m: pb.StoreRequest) -> c.StoreRequest:
    return c.StoreRequest(m.session_id, list(m.keys),
                          to_index_array(m.device_indices, "device_indices"), _layers(m),
                          m.token_ids, m.parent_key, int(m.deadline_unix_ns), m.lora_name,
                          m.cache_salt)


def _store_response(r: c.StoreResult) -> pb.StoreResponse:
    return pb.StoreResponse(stored=r.stored, already_present=r.already_present,
                            no_space=r.no_space, status=r.status, bytes_moved=r.bytes_moved,
                            duration_seconds=r.duration_seconds)


def _load_keys(m: pb.LoadKeysRequest) -> c.LoadKeysRequest:
    return c.LoadKeysRequest(m.session_id, list(m.keys),
                             to_index_array(m.device_indices, "device_indices"), _layers(m),
                             _events(m), int(m.deadline_unix_ns))


def _transfer(m: pb.TransferRequest) -> c.TransferRequest:
    return c.TransferRequest(m.session_id, to_index_array(m.host_indices, "host_indices"),
                             to_index_array(m.device_indices, "device_indices"), _layers(m),
                             _events(m), int(m.deadline_unix_ns))


def _session(m: Any) -> c.SessionRequest:
    return c.SessionRequest(m.session_id)


def _pool(m: Any) -> c.PoolRequest:
    return c.PoolRequest(m.pool)


def _alloc(m: pb.AllocRequest) -> c.AllocRequest:
    return c.AllocRequest(m.pool, int(m.num_tokens), m.session_id)


def _free(m: pb.FreeRequest) -> c.FreeRequest:
    return c.FreeRequest(m.pool, to_index_array(m.host_indices, "host_indices"))


CODECS: dict[str, GrpcCodec] = {
    "Lookup": GrpcCodec(_lookup, _lookup_response),
    "Store": GrpcCodec(_store, _store_response),
    "LoadKeys": GrpcCodec(_load_keys, transfer_response),
    "Backup": GrpcCodec(_transfer, transfer_response),
    "Load": GrpcCodec(_transfer, transfer_response),
    "Heartbeat": GrpcCodec(_session, session_message),
    "ReleaseHolds": GrpcCodec(lambda m: c.ReleaseHoldsRequest(m.session_id, list(m.keys)),
                              lambda r: pb.ReleaseHoldsResponse(released=r.n)),
    "RemoveKeys": GrpcCodec(lambda m: c.KeysRequest(m.pool, list(m.keys)),
                            lambda r: pb.RemoveKeysResponse(removed=r.n)),
    "ClearPool": GrpcCodec(_pool, lambda r: pb.ClearPoolResponse(pages_freed=r.n,
                                                                  keys_removed=r.n)),
    "DeletePool": GrpcCodec(lambda m: c.PoolRequest(m.name), lambda r: pb.DeletePoolResponse()),
    "Alloc": GrpcCodec(_alloc, lambda r: pb.AllocResponse(host_indices=indices_to_bytes(r))),
    "Free": GrpcCodec(_free, lambda r: pb.FreeResponse(pages_freed=r.n)),
    "CloseSession": GrpcCodec(_session, lambda r: pb.CloseSessionResponse()),
    "CreatePool": GrpcCodec(lambda m: c.CreatePoolRequest(spec_from_proto(m.spec)),
                            pool_message),
    "OpenSession": GrpcCodec(_open_session, session_message),
    "WatchEvents": GrpcCodec(lambda m: c.WatchEventsRequest(m.pool, int(m.after_seq),
                                                            m.all_tiers), _event),
    "GetInfo": GrpcCodec(lambda m: _NONE, _info),
    "Ping": GrpcCodec(lambda m: _NONE, lambda r: pb.PingResponse()),
    "GetPool": GrpcCodec(lambda m: c.PoolRequest(m.name), pool_message),
    "ListPools": GrpcCodec(lambda m: _NONE, lambda r: pb.ListPoolsResponse(
        pools=[pool_message(v) for v in r])),
    "ListSessions": GrpcCodec(_pool, lambda r: pb.ListSessionsResponse(
        sessions=[session_message(s, capability=False) for s in r])),
    "Drain": GrpcCodec(lambda m: c.DrainRequest(float(m.grace_seconds)),
                       lambda r: pb.DrainResponse(in_flight=r.in_flight,
                                                  grace_seconds=r.grace_seconds,
                                                  already_draining=r.already_draining)),
}
"""Every method of ``calls.METHODS``, by name."""
