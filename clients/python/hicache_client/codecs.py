"""The client's codecs: ``hicache.calls``' typed requests onto either wire, replies as results.

The daemon decodes both wires into the same typed requests (``hicached.frontends``'
``fast_codec`` and ``grpc_codec``); here each call is the mirror image, one ``ClientCodec``
per method of the service: the protobuf message for a request (its indices as token
indices), the reply as the client's result, whether the call may be sent again (it is
idempotent), and, for the calls the fast path carries, the frame's body and flags for a
request (its indices as page ids) and its reply as the result. ``HiCacheClient.call`` picks
the path.

Primitives: ``ClientCodec`` (``grpc``, ``message``, ``from_grpc``, ``retry``, ``fast``,
``body``, ``flags``, ``from_fast``), ``CODECS`` (by the method's gRPC name).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from hicache import calls as c
from hicache import fast_wire as w
from hicache.codec import buffer_to_proto, pool_from_proto, spec_to_proto
from hicache.indices import PageIds, indices_to_bytes, to_index_array
from hicache.v1 import hicache_pb2 as pb
from hicache_client import fast_path as fp
from hicache_client.results import LookupResult, StoreResult, TransferStats


def _same(reply: Any) -> Any:
    return reply


def _nothing(reply: Any) -> None:
    return None


class ClientCodec(NamedTuple):
    grpc: str
    """The method's name: the gRPC stub's attribute."""
    message: Callable[[Any], Any]
    """The request (device indices as token indices) as its protobuf message."""
    from_grpc: Callable[[Any], Any] = _same
    """The protobuf reply -> the result (by default the reply itself)."""
    retry: bool = True
    """Idempotent: sent again while the daemon is away, draining or overloaded."""
    fast: w.Method | None = None
    """Its number on the fast path (None: gRPC only)."""
    body: Callable[[Any], list[bytes]] = lambda q: []
    """The request (device indices as ``PageIds``) as a fast-path body (``ValueError``: the
    framing cannot carry it; the call goes over gRPC)."""
    flags: Callable[[Any], int] = lambda q: 0
    """The frame's flags for the request."""
    from_fast: Callable[[bytes, Any], Any] = lambda data, q: None
    """(reply body, request) -> the result."""


def _ids(x: Any) -> Any:
    return x.ids if isinstance(x, PageIds) else x


def _events(layer_events: bool, deadline_ns: int) -> int:
    return ((w.FLAG_LAYER_EVENTS if layer_events else 0)
            | (w.FLAG_DEADLINE if deadline_ns else 0))


def _completion(layer_events: bool) -> Any:
    return pb.COMPLETION_LAYER_EVENTS if layer_events else pb.COMPLETION_WAIT




def _chain(q: c.StoreRequest) -> tuple[bytes, Any] | None:
    """What the Store says of its chain, None when nothing (its flags and body both ask: no
    copy of the tokens here; the framing and the daemon take them as they are)."""
    tokens = q.token_ids
    if (tokens is None or len(tokens) == 0) and not q.parent_key:
        return None
    return q.parent_key, tokens if tokens is not None else b""


def _namespace(q: c.StoreRequest) -> tuple[str, str] | None:
    """The Store's LoRA name and cache salt, None when it names neither."""
    return (q.lora_name, q.cache_salt) if q.lora_name or q.cache_salt else None


def _lookahead(q: c.StoreRequest) -> tuple[int, Any] | None:
    """The Store's lookahead tokens (per key, the ids), None when it gives none."""
    ids = q.lookahead_token_ids
    if not q.lookahead_tokens and (ids is None or len(ids) == 0):
        return None
    return q.lookahead_tokens, ids if ids is not None else b""


def _token_list(tokens: Any) -> list[int]:
    """A Store's tokens as the message's ints (the client keeps them as int64 bytes)."""
    if isinstance(tokens, bytes):
        return np.frombuffer(tokens, "<i8").tolist()  # type: ignore[no-any-return]
    return np.asarray(tokens, dtype=np.int64).ravel().tolist()  # type: ignore[no-any-return]


def _store_message(q: c.StoreRequest) -> pb.StoreRequest:
    chain, ahead = _chain(q), _lookahead(q)
    return pb.StoreRequest(session_id=q.session_id, keys=q.keys,
                           device_indices=indices_to_bytes(q.device),
                           token_ids=_token_list(chain[1]) if chain is not None else (),
                           parent_key=q.parent_key, deadline_unix_ns=q.deadline_ns,
                           lora_name=q.lora_name, cache_salt=q.cache_salt,
                           lookahead_tokens=ahead[0] if ahead is not None else 0,
                           lookahead_token_ids=_token_list(ahead[1]) if ahead is not None
                           else (), layer_begin=q.layers[0], layer_end=q.layers[1])


def _transfer_message(q: c.TransferRequest) -> pb.TransferRequest:
    return pb.TransferRequest(session_id=q.session_id, host_indices=indices_to_bytes(q.host),
                              device_indices=indices_to_bytes(q.device),
                              layer_begin=q.layers[0], layer_end=q.layers[1],
                              completion=_completion(q.layer_events),
                              deadline_unix_ns=q.deadline_ns)


def _raw(method: w.Method, name: str) -> ClientCodec:
    return ClientCodec(
        name, _transfer_message, TransferStats.from_proto, True, method,
        lambda q: fp.raw_body(q.session_id, _ids(q.host), _ids(q.device), q.layers,
                              q.deadline_ns),
        lambda q: _events(q.layer_events, q.deadline_ns),
        lambda data, q: fp.decode_transfer(data))


def _store_result(r: pb.StoreResponse) -> StoreResult:
    return StoreResult(r.stored, r.already_present, r.no_space, bytes(r.status), r.bytes_moved,
                       r.duration_seconds)


def _open_session(q: c.OpenSessionRequest) -> pb.OpenSessionRequest:
    assert not callable(q.buffers), "the daemon's decode, not a client's request"
    return pb.OpenSessionRequest(
        pool=q.pool, worker_id=q.worker_id, lease_ms=q.lease_ms,
        buffers=[b if isinstance(b, pb.DeviceBuffer) else buffer_to_proto(b)
                 for b in q.buffers],  # a caller's wire buffers go as they are
        layer_events=list(q.layer_events), ready_event=q.ready_event,
        peer_token=q.peer_token)


CODECS: dict[str, ClientCodec] = {
    "Lookup": ClientCodec(
        "Lookup",
        lambda q: pb.LookupRequest(pool=q.pool, keys=q.keys, session_id=q.session_id,
                                   hold_ms=q.hold_ms, touch=q.touch),
        lambda r: LookupResult(r.hit_prefix, bytes(r.tiers), r.hits, r.held,
                               r.promised if r.HasField("promised") else -1),
        True, w.Method.LOOKUP,
        lambda q: fp.lookup_body(q.pool, q.session_id, q.keys, q.hold_ms),
        lambda q: ((w.FLAG_HOLD if q.hold_ms else 0) | (w.FLAG_TOUCH if q.touch else 0)
                   | (w.FLAG_PROMISE if q.hold_ms and q.promise else 0)),
        lambda data, q: fp.decode_lookup(data, bool(q.hold_ms), q.promise)),
    "Store": ClientCodec(
        "Store", _store_message, _store_result, True, w.Method.STORE,
        lambda q: fp.keyed_body(q.session_id, q.keys, _ids(q.device), q.layers,
                                q.deadline_ns, _chain(q), _namespace(q), _lookahead(q)),
        lambda q: ((w.FLAG_CHAIN if _chain(q) is not None else 0)
                   | (w.FLAG_NAMESPACE if _namespace(q) is not None else 0)
                   | (w.FLAG_LOOKAHEAD if _lookahead(q) is not None else 0)
                   | (w.FLAG_DEADLINE if q.deadline_ns else 0)),
        lambda data, q: fp.decode_store(data)),
    "LoadKeys": ClientCodec(
        "LoadKeys",
        lambda q: pb.LoadKeysRequest(
            session_id=q.session_id, keys=q.keys, device_indices=indices_to_bytes(q.device),
            layer_begin=q.layers[0], layer_end=q.layers[1],
            completion=_completion(q.layer_events), deadline_unix_ns=q.deadline_ns),
        TransferStats.from_proto, True, w.Method.LOAD_KEYS,
        lambda q: fp.keyed_body(q.session_id, q.keys, _ids(q.device), q.layers,
                                q.deadline_ns),
        lambda q: _events(q.layer_events, q.deadline_ns),
        lambda data, q: fp.decode_transfer(data)),
    "Backup": _raw(w.Method.BACKUP, "Backup"),
    "Load": _raw(w.Method.LOAD, "Load"),
    "Heartbeat": ClientCodec(
        "Heartbeat", lambda q: pb.HeartbeatRequest(session_id=q.session_id), _same, True,
        w.Method.HEARTBEAT, lambda q: fp.session_body(q.session_id)),
    "ReleaseHolds": ClientCodec(
        "ReleaseHolds",
        lambda q: pb.ReleaseHoldsRequest(session_id=q.session_id, keys=q.keys or []),
        lambda r: int(r.released), True, w.Method.RELEASE_HOLDS,
        lambda q: fp.release_body(q.session_id, q.keys or []), lambda q: 0,
        lambda data, q: int(fp.U32.unpack(data)[0])),
    # over gRPC only
    "RemoveKeys": ClientCodec("RemoveKeys",
                              lambda q: pb.RemoveKeysRequest(pool=q.pool, keys=q.keys),
                              lambda r: int(r.removed)),
    "ClearPool": ClientCodec("ClearPool", lambda q: pb.ClearPoolRequest(pool=q.pool),
                             lambda r: int(r.keys_removed)),
    "DeletePool": ClientCodec("DeletePool", lambda q: pb.DeletePoolRequest(name=q.pool),
                              _nothing, retry=False),
    "Alloc": ClientCodec("Alloc", lambda q: pb.AllocRequest(
        pool=q.pool, num_tokens=q.num_tokens, session_id=q.session_id),
        lambda r: to_index_array(r.host_indices, "host_indices").copy(), retry=False),
    "Free": ClientCodec("Free", lambda q: pb.FreeRequest(
        pool=q.pool, host_indices=indices_to_bytes(q.host)), lambda r: int(r.pages_freed),
        retry=False),
    "CloseSession": ClientCodec("CloseSession",
                                lambda q: pb.CloseSessionRequest(session_id=q.session_id),
                                _nothing, retry=False),
    "CreatePool": ClientCodec("CreatePool", lambda q: pb.CreatePoolRequest(
        spec=q.spec if isinstance(q.spec, pb.PoolSpec) else spec_to_proto(q.spec)),
        pool_from_proto),  # (a caller's wire spec goes as it is: the daemon checks it)
    "OpenSession": ClientCodec("OpenSession", _open_session, retry=False),
    "WatchEvents": ClientCodec("WatchEvents", lambda q: pb.WatchEventsRequest(
        pool=q.pool, after_seq=q.after_seq, all_tiers=q.all_tiers)),
    "GetInfo": ClientCodec("GetInfo", lambda q: pb.GetInfoRequest()),
    "Ping": ClientCodec("Ping", lambda q: pb.PingRequest(), _nothing),
    "GetPool": ClientCodec("GetPool", lambda q: pb.GetPoolRequest(name=q.pool),
                           pool_from_proto),
    "ListPools": ClientCodec("ListPools", lambda q: pb.ListPoolsRequest()),
    "ListSessions": ClientCodec("ListSessions", lambda q: pb.ListSessionsRequest(pool=q.pool),
                                lambda r: list(r.sessions)),
    "Drain": ClientCodec("Drain", lambda q: pb.DrainRequest(grace_seconds=q.grace_seconds),
                         retry=False),
}
"""Every method of the service, by gRPC name (WatchEvents': its request; the stream is the
caller's)."""
