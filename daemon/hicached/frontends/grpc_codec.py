"""The gRPC front end's codec: protobuf messages <-> ``service.calls``' requests and results.

One ``GrpcCodec`` per method with a typed request: how its protobuf request decodes (a bad
field raises its domain error, as the fast path's decode does) and how its result encodes
into the response message. Methods without one (``calls.Method.request`` is None) are served
by the servicer on their messages.

Primitives: ``GrpcCodec`` (``decode(message)``, ``encode(result)``), ``CODECS`` (by method
name), ``session_message(session)``, ``transfer_response(result)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

from hicache.indices import indices_to_bytes, to_index_array
from hicache.v1 import hicache_pb2 as pb
from hicached.copy.engine import TransferResult
from hicached.cuda.runner import CudaRunner
from hicached.service import calls as c
from hicached.service.sessions import Session


class GrpcCodec(NamedTuple):
    decode: Callable[[Any], Any]
    """The protobuf request -> the typed request."""
    encode: Callable[[Any], Any]
    """The typed result -> the protobuf response."""


def session_message(s: Session, capability: bool = True) -> pb.Session:
    """``capability=False`` for anyone but the worker holding it: the id left empty."""
    runner = s.attachment.runner
    uuid, events = "", 0
    if isinstance(runner, CudaRunner):
        uuid, events = runner.driver.devices[runner.ordinal].uuid, len(runner.layer_events)
    return pb.Session(session_id=s.session_id if capability else "", public_id=s.public_id,
                      pool=s.pool_name, worker_id=s.worker_id,
                      lease_ms=int(s.lease_seconds * 1000),
                      expires_in_ms=int(s.expires_in(time.monotonic()) * 1000),
                      attached_bytes=s.attachment.nbytes, device_tokens=s.device_tokens,
                      transfers=s.transfers, device_uuid=uuid, layer_events=events,
                      lease_clamped=s.lease_clamped, peer_known=s.peer is not None,
                      peer_uid=s.peer.uid if s.peer else 0, peer_gid=s.peer.gid if s.peer else 0,
                      peer_pid=s.peer.pid if s.peer else 0, page_size=s.pool.page_size,
                      loads_in_flight=s.loads)


def transfer_response(r: TransferResult) -> pb.TransferResponse:
    return pb.TransferResponse(bytes_moved=r.bytes, pages=r.pages, duration_seconds=r.seconds,
                               pending=r.pending)


def _layers(m: Any) -> tuple[int, int]:
    return int(m.layer_begin), int(m.layer_end)


def _events(m: Any) -> bool:
    return bool(m.completion == pb.COMPLETION_LAYER_EVENTS)


def _lookup(m: pb.LookupRequest) -> c.LookupRequest:
    return c.LookupRequest(m.pool, list(m.keys), m.session_id, int(m.hold_ms))


def _lookup_response(r: c.LookupResult) -> pb.LookupResponse:
    return pb.LookupResponse(hit_prefix=r.hit_prefix, tiers=r.tiers, hits=r.hits, held=r.held)


def _store(m: pb.StoreRequest) -> c.StoreRequest:
    return c.StoreRequest(m.session_id, list(m.keys),
                          to_index_array(m.device_indices, "device_indices"), _layers(m),
                          m.token_ids, m.parent_key, int(m.deadline_unix_ns))


def _store_response(r: c.StoreResult) -> pb.StoreResponse:
    return pb.StoreResponse(stored=r.stored, already_present=r.already_present,
                            no_space=r.no_space, status=r.status, bytes_moved=r.bytes_moved,
                            duration_seconds=r.seconds)


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
}
"""Every method of ``calls.METHODS`` with a typed request, by name."""
