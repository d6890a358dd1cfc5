"""The fast path's codec: ``hicache.fast_wire`` bodies <-> ``service.calls``' requests and results.

One ``FastCodec`` per method the fast path carries (every ``calls.METHODS`` entry not marked
``grpc_only``): how its body decodes into the typed request (the frame's flags say which
optional fields follow) and how its result encodes into the reply body. The framing itself
(headers, ids, errors as ``google.rpc.Status``) is ``fast_path``'s.

Primitives: ``FastCodec`` (``name``, ``decode(reader, flags, max_keys)``,
``encode(result, flags)``), ``CODECS`` (by ``fast_wire.Method``).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from hicache import fast_wire as w
from hicache.indices import PageIds
from hicached.service import calls as c
from hicached.service.calls import TransferResult
from hicached.service.sessions import Session

_U32 = struct.Struct("<I")


class FastCodec(NamedTuple):
    name: str
    """The method's name in ``calls.METHODS``."""
    decode: Callable[[w.Reader, int, int], Any]
    """(body reader, frame flags, most keys per call) -> the typed request."""
    encode: Callable[[Any, int], bytes]
    """(result, frame flags) -> the reply body."""


def _lookup(r: w.Reader, flags: int, max_keys: int) -> c.LookupRequest:
    pool, capability = r.string(), r.string()
    keys = r.keys(max_keys)
    hold_ms = r.i64() if flags & w.FLAG_HOLD else 0
    r.end()
    return c.LookupRequest(pool, keys, capability, hold_ms, bool(flags & w.FLAG_TOUCH),
                           bool(flags & w.FLAG_PROMISE))


def _lookup_reply(res: c.LookupResult, flags: int) -> bytes:
    reply = w.LOOKUP_REPLY.pack(res.hit_prefix, res.hits, len(res.tiers)) + res.tiers
    if not flags & w.FLAG_HOLD:
        return reply
    reply += _U32.pack(res.held)
    return reply + _U32.pack(res.promised) if flags & w.FLAG_PROMISE else reply


def _store(r: w.Reader, flags: int, max_keys: int) -> c.StoreRequest:
    session, layers = r.string(), r.layers()
    keys, device = r.keys(max_keys), PageIds(r.pages())
    parent, tokens = ((r.short_bytes(), r.page_bytes()) if flags & w.FLAG_CHAIN
                      else (b"", None))
    lora, salt = ((r.short_str("lora_name"), r.short_str("cache_salt"))
                  if flags & w.FLAG_NAMESPACE else ("", ""))
    ahead, ahead_ids = (r.u16(), r.page_bytes()) if flags & w.FLAG_LOOKAHEAD else (0, None)
    deadline = r.i64() if flags & w.FLAG_DEADLINE else 0
    r.end()
    return c.StoreRequest(session, keys, device, layers, tokens, parent, deadline, lora, salt,
                          ahead, ahead_ids)


def _store_reply(res: c.StoreResult, flags: int) -> bytes:
    return (w.STORE_REPLY.pack(res.stored, res.already_present, res.no_space, res.bytes_moved,
                               res.duration_seconds)
            + _U32.pack(len(res.status)) + res.status)


def _load_keys(r: w.Reader, flags: int, max_keys: int) -> c.LoadKeysRequest:
    session, layers = r.string(), r.layers()
    keys, device = r.keys(max_keys), PageIds(r.pages())
    if flags & w.FLAG_CHAIN:  # (a Store's trailer: read and ignored, as it always was)
        r.short_bytes()
        r.page_bytes()
    deadline = r.i64() if flags & w.FLAG_DEADLINE else 0
    r.end()
    return c.LoadKeysRequest(session, keys, device, layers, bool(flags & w.FLAG_LAYER_EVENTS),
                             deadline)


def _raw(r: w.Reader, flags: int, max_keys: int) -> c.TransferRequest:
    session, layers = r.string(), r.layers()
    host, device = PageIds(r.pages()), PageIds(r.pages())
    deadline = r.i64() if flags & w.FLAG_DEADLINE else 0
    r.end()
    return c.TransferRequest(session, host, device, layers, bool(flags & w.FLAG_LAYER_EVENTS),
                             deadline)


def _transfer_reply(res: TransferResult, flags: int) -> bytes:
    return w.TRANSFER_REPLY.pack(res.bytes, res.pages, res.seconds, res.pending)


def _session(r: w.Reader, flags: int, max_keys: int) -> c.SessionRequest:
    session = r.string()
    r.end()
    return c.SessionRequest(session)


def _heartbeat_reply(s: Session, flags: int) -> bytes:
    return w.HEARTBEAT_REPLY.pack(int(s.lease_seconds * 1000),
                                  int(s.expires_in(time.monotonic()) * 1000))


def _release(r: w.Reader, flags: int, max_keys: int) -> c.ReleaseHoldsRequest:
    session, keys = r.string(), r.keys(max_keys)
    r.end()
    return c.ReleaseHoldsRequest(session, keys)


def _count_reply(res: c.Count, flags: int) -> bytes:
    return _U32.pack(res.n)


CODECS: dict[int, FastCodec] = {
    w.Method.LOOKUP: FastCodec("Lookup", _lookup, _lookup_reply),
    w.Method.STORE: FastCodec("Store", _store, _store_reply),
    w.Method.LOAD_KEYS: FastCodec("LoadKeys", _load_keys, _transfer_reply),
    w.Method.BACKUP: FastCodec("Backup", _raw, _transfer_reply),
    w.Method.LOAD: FastCodec("Load", _raw, _transfer_reply),
    w.Method.HEARTBEAT: FastCodec("Heartbeat", _session, _heartbeat_reply),
    w.Method.RELEASE_HOLDS: FastCodec("ReleaseHolds", _release, _count_reply),
}
"""The fast path's methods by their number in ``fast_wire.Method``."""
