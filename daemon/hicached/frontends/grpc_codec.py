"""The gRPC front end's codec: protobuf messages <-> ``service.calls``' requests and results.

One ``GrpcCodec`` per method of the table: how its protobuf request decodes (a bad field
raises its domain error, as the fast path's decode does) and how its result encodes into the
response message (a server stream's: each message). The read models of ``service.views``
(pools, sessions, the daemon's info, events) are rendered here and nowhere else, each field
under its own name (``_named``; ``tests/daemon/test_method_table.py`` holds each read model's
fields to its message's).

Primitives: ``GrpcCodec`` (``decode(message)``, ``encode(result)``), ``CODECS`` (by method
name), ``pool_message(pool)``, ``session_message(session)``, ``transfer_response(result)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any, NamedTuple

from hicache.codec import buffer_from_proto, fill_deprecated, pool_to_proto, spec_from_proto
from hicache.indices import indices_to_bytes, to_index_array
from hicache.v1 import hicache_pb2 as pb
from hicached.service import calls as c
from hicached.service.calls import TransferResult
from hicached.service.sessions import Session
from hicached.service.views import EventView, InfoView, SessionView, session_view


class GrpcCodec(NamedTuple):
    decode: Callable[[Any], Any]
    """The protobuf request -> the typed request."""
    encode: Callable[[Any], Any]
    """The typed result -> the protobuf response."""


def _named(view: Any, *but: str) -> dict[str, Any]:
    """A read model's fields (a dataclass's or a ``NamedTuple``'s) that go onto the wire as
    they are, each under its own name: all ``but`` those named."""
    names = getattr(view, "_fields", None) or [f.name for f in fields(view)]
    return {name: getattr(view, name) for name in names if name not in but}


def session_message(s: Session, capability: bool = True) -> pb.Session:
    """``capability=False`` for anyone but the worker holding it: the id left empty."""
    return _session_of(session_view(s, capability))


def _session_of(v: SessionView) -> pb.Session:
    return pb.Session(**_named(v, "peer_uid"), peer_known=v.peer_uid is not None,
                      peer_uid=v.peer_uid or 0)


pool_message = pool_to_proto


def _info(v: InfoView) -> pb.GetInfoResponse:
    return fill_deprecated(pb.GetInfoResponse(  # type: ignore[no-any-return]
        **_named(v, "cuda_devices"),
        cuda_devices=[pb.CudaDevice(**_named(x)) for x in v.cuda_devices]))


def _event(v: EventView) -> pb.CacheEvent:
    return pb.CacheEvent(**_named(v))


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
                          m.cache_salt, int(m.lookahead_tokens), m.lookahead_token_ids)


def _store_response(r: c.StoreResult) -> pb.StoreResponse:
    return pb.StoreResponse(**_named(r))


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
