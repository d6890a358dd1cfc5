"""The calls of ``hicache.v1.HostCache``, defined once: a method table both front ends serve.

Each method is one ``Method`` entry: its typed request and result, the handler that turns one
into the other on a ``Daemon``, and what the envelope must know of it (whether it creates
work, whether it is a data call, where its request names a pool). A front end is a codec per
message and nothing else: gRPC's (``frontends.grpc_codec``: protobuf <-> these types) and the
fast path's (``frontends.fast_codec``: ``hicache.fast_wire`` frames <-> these types). Adding a
method is one entry here, one handler, and a codec on each front end that serves it
(``grpc_only`` for the control calls the fast path does not carry).

Requests and results are immutable ``NamedTuple`` classes: typed, and as cheap to build as the
tuple a hot call would otherwise pass. A method whose ``request`` is None is still served by
the gRPC servicer's own method on its protobuf message (the control calls whose results are
read models the servicer renders: pools, sessions, the daemon's info, the event stream); its
entry still says what the envelope needs.

Primitives:

- Requests (``hicache.calls``, shared with the client) and results:
  ``LookupRequest``/``LookupResult``, ``StoreRequest``/``StoreResult``,
  ``LoadKeysRequest``, ``TransferRequest`` (Backup, Load; their result and LoadKeys' is
  ``TransferResult``, the copy engine's), ``SessionRequest`` (Heartbeat, CloseSession; Heartbeat's
  result is the ``Session``), ``ReleaseHoldsRequest``, ``KeysRequest`` (RemoveKeys),
  ``PoolRequest`` (ClearPool, DeletePool), ``AllocRequest``, ``FreeRequest``, ``Count``.
- ``Method`` and ``METHODS`` (every RPC of the service, by its gRPC name), ``method(name)``,
  ``CREATES_WORK``, ``DATA_METHODS``; ``PoolOf``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from hicache.calls import (
    AllocRequest,
    FreeRequest,
    KeysRequest,
    LoadKeysRequest,
    LookupRequest,
    PoolRequest,
    ReleaseHoldsRequest,
    SessionRequest,
    StoreRequest,
    TransferRequest,
)
from hicache.identity import is_public_id
from hicache.indices import IndexArray
from hicached.cache.index_types import NO_SPACE, PRESENT, STORED
from hicached.copy.engine import Op, TransferResult
from hicached.service.daemon import Daemon
from hicached.service.sessions import Session

__all__ = [
    "CREATES_WORK", "DATA_METHODS", "METHODS", "AllocRequest", "Count", "FreeRequest",
    "KeysRequest", "LoadKeysRequest", "LookupRequest", "LookupResult", "Method", "PoolOf",
    "PoolRequest", "ReleaseHoldsRequest", "SessionRequest", "StoreRequest", "StoreResult",
    "TransferRequest", "TransferResult", "alloc", "backup", "clear_pool", "close_session",
    "delete_pool", "free", "heartbeat", "load", "load_keys", "lookup", "method",
    "release_holds", "remove_keys", "store",
]

log = logging.getLogger(__name__)


# -- requests and results -------------------------------------------------------------------


class LookupResult(NamedTuple):
    hit_prefix: int
    """Leading keys present in some tier."""
    tiers: bytes
    """One byte per key: 0 absent, else the tier that has it."""
    hits: int
    """Keys present, wherever they are in the batch."""
    held: int
    """Leading keys held for the session (0 without a hold)."""
    promised: int = 0
    """Leading keys the session's LoadKeys can count on: ``held``, then the keys below host
    memory kept there and promoted for it within its share (0 without a hold)."""


class StoreResult(NamedTuple):
    stored: int
    already_present: int
    no_space: int
    status: bytes
    """One status byte per key (``STORED``, ``PRESENT``, ``NO_SPACE``)."""
    bytes_moved: int
    seconds: float


class Count(NamedTuple):
    """How many: keys released or removed, pages freed."""

    n: int


# -- handlers -------------------------------------------------------------------------------


def lookup(d: Daemon, q: LookupRequest) -> LookupResult:
    hit_prefix, tiers, held, promised = d.lookup(q.pool, q.keys, q.session_id, q.hold_ms,
                                                 q.touch)
    return LookupResult(hit_prefix, tiers, len(tiers) - tiers.count(0), held, promised)


def store(d: Daemon, q: StoreRequest) -> StoreResult:
    ticket, r = d.store(q.session_id, q.keys, q.device, q.layers, q.token_ids, q.parent_key,
                        q.deadline_ns, q.lora_name, q.cache_salt)
    st = ticket.status
    return StoreResult(st.count(STORED), st.count(PRESENT), st.count(NO_SPACE), bytes(st),
                       r.bytes if r is not None else 0, r.seconds if r is not None else 0.0)


def load_keys(d: Daemon, q: LoadKeysRequest) -> TransferResult:
    return d.load_keys(q.session_id, q.keys, q.device, q.layers, q.layer_events,
                       deadline_ns=q.deadline_ns)


def backup(d: Daemon, q: TransferRequest) -> TransferResult:
    return d.transfer(Op.BACKUP, q.session_id, q.host, q.device, q.layers, q.layer_events,
                      deadline_ns=q.deadline_ns)


def load(d: Daemon, q: TransferRequest) -> TransferResult:
    return d.transfer(Op.LOAD, q.session_id, q.host, q.device, q.layers, q.layer_events,
                      deadline_ns=q.deadline_ns)


def heartbeat(d: Daemon, q: SessionRequest) -> Session:
    return d.sessions.heartbeat(q.session_id)


def close_session(d: Daemon, q: SessionRequest) -> Count:
    d.sessions.close(q.session_id)
    return Count(1)


def release_holds(d: Daemon, q: ReleaseHoldsRequest) -> Count:
    return Count(d.release_holds(q.session_id, q.keys or None))


def remove_keys(d: Daemon, q: KeysRequest) -> Count:
    return Count(d.remove_keys(q.pool, q.keys))


def clear_pool(d: Daemon, q: PoolRequest) -> Count:
    n = d.pools.stack(q.pool).clear()
    log.info("pool %s cleared: %d key(s) dropped", q.pool, n)
    return Count(n)


def delete_pool(d: Daemon, q: PoolRequest) -> Count:
    d.pools.delete(q.pool)
    log.info("pool %s deleted", q.pool)
    return Count(1)


def alloc(d: Daemon, q: AllocRequest) -> IndexArray:
    return d.alloc(q.pool, q.num_tokens, q.session_id)


def free(d: Daemon, q: FreeRequest) -> Count:
    return Count(d.pools.get(q.pool).free(q.host))


# -- the table ------------------------------------------------------------------------------

PoolOf = Callable[[Any, Daemon], tuple[str, str]]
"""(pool, session capability) a request names, for access rules; ("", "") for none."""


def _pool(r: Any, d: Daemon) -> tuple[str, str]:
    return str(r.pool), ""


def _pool_and_session(r: Any, d: Daemon) -> tuple[str, str]:
    return str(r.pool), str(r.session_id)


def _close_session_pool(r: Any, d: Daemon) -> tuple[str, str]:
    sid = str(r.session_id)
    if not is_public_id(sid):
        return "", ""  # the capability itself: the handler checks it
    found = [s for s in d.sessions.list() if s.public_id == sid]
    return (found[0].pool_name, "") if found else ("", "")


@dataclass(frozen=True)
class Method:
    """One RPC of ``hicache.v1.HostCache``."""

    name: str
    """Its gRPC name (the metrics' ``method`` label on every front end)."""
    request: type | None = None
    """The typed request its codecs decode into; None: the servicer serves the protobuf
    message itself (see the module's docstring)."""
    result: type | None = None
    """The typed result its codecs encode (None with ``request``)."""
    handler: Callable[[Daemon, Any], Any] | None = None
    """The request's result on a daemon (None with ``request``)."""
    creates_work: bool = False
    """Refused with ``DRAINING`` once shutdown began (every other method still answers)."""
    data: bool = False
    """A data call: bounded by ``max_data_rpcs`` over both front ends together."""
    pool_of: PoolOf | None = None
    """A pool-level call: where its request names the pool (and a session capability)."""
    grpc_only: bool = True
    """Served by gRPC alone; False: the fast path carries it too (a codec on each)."""

    def __post_init__(self) -> None:
        if (self.request is None) != (self.handler is None) or (
                self.request is None) != (self.result is None):
            raise ValueError(f"{self.name}: a request type, a result type and a handler, or "
                             "none of them")
        if not self.grpc_only and self.request is None:
            raise ValueError(f"{self.name}: a method on the fast path needs a typed request")


_TABLE = (
    # the data calls, on both front ends
    Method("Lookup", LookupRequest, LookupResult, lookup, data=True,
           pool_of=_pool_and_session, grpc_only=False),
    Method("Store", StoreRequest, StoreResult, store, True, True, grpc_only=False),
    Method("LoadKeys", LoadKeysRequest, TransferResult, load_keys, True, True,
           grpc_only=False),
    Method("Backup", TransferRequest, TransferResult, backup, True, True, grpc_only=False),
    Method("Load", TransferRequest, TransferResult, load, True, True, grpc_only=False),
    # control calls the fast path carries too (an idle worker's only call; a cancelled hold)
    Method("Heartbeat", SessionRequest, Session, heartbeat, grpc_only=False),
    Method("ReleaseHolds", ReleaseHoldsRequest, Count, release_holds, grpc_only=False),
    # control calls over gRPC
    Method("RemoveKeys", KeysRequest, Count, remove_keys, pool_of=_pool),
    Method("ClearPool", PoolRequest, Count, clear_pool, pool_of=_pool),
    Method("DeletePool", PoolRequest, Count, delete_pool, True, pool_of=_pool),
    Method("Alloc", AllocRequest, np.ndarray, alloc, True, pool_of=_pool_and_session),
    Method("Free", FreeRequest, Count, free, pool_of=_pool),
    Method("CloseSession", SessionRequest, Count, close_session,
           pool_of=_close_session_pool),
    # served by the servicer on its protobuf messages (read models it renders)
    Method("CreatePool", creates_work=True, pool_of=lambda r, d: (str(r.spec.name), "")),
    Method("OpenSession", creates_work=True),  # checks its peer itself, before mapping
    Method("WatchEvents", pool_of=_pool),
    Method("GetInfo"),
    Method("Ping"),
    Method("GetPool"),
    Method("ListPools"),
    Method("ListSessions"),
    Method("Drain"),
)

METHODS: dict[str, Method] = {m.name: m for m in _TABLE}
"""Every RPC of the service by name (a test holds it to the proto's service)."""
CREATES_WORK = frozenset(m.name for m in _TABLE if m.creates_work)
DATA_METHODS = frozenset(m.name for m in _TABLE if m.data)
_UNKNOWN = Method("")


def method(name: str) -> Method:
    """The entry of ``name``; an unknown name gets a control call's (no pool, no work)."""
    return METHODS.get(name, _UNKNOWN)
