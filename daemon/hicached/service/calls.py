"""The calls of ``hicache.v1.HostCache``, defined once: a method table both front ends serve.

Each method is one ``Method`` entry: its typed request and result, the handler that turns one
into the other on a ``Daemon``, and what the envelope must know of it (whether it creates
work, whether it is a data call, where its request names a pool). A front end is a codec per
message and nothing else: gRPC's (``frontends.grpc_codec``: protobuf <-> these types) and the
fast path's (``frontends.fast_codec``: ``hicache.fast_wire`` frames <-> these types). Adding a
method is one entry here, one handler, and a codec on each front end that serves it
(``grpc_only`` for the control calls the fast path does not carry).

Requests and results are immutable: the requests ``NamedTuple`` classes (``hicache.calls``),
typed, and as cheap to build as the tuple a hot call would otherwise pass; the control calls'
results are the read models of ``views`` (pools, sessions, the daemon's info, the event
stream), which each front end renders. A server stream (``stream``) has a handler that returns
an iterator of its messages.

Primitives:

- Requests and the data calls' results (``hicache.calls``, shared with the client):
  ``LookupRequest``/``LookupResult``, ``StoreRequest``/``StoreResult``,
  ``LoadKeysRequest``, ``TransferRequest`` (Backup, Load; their result and LoadKeys' is
  ``TransferResult``, the copy engine's), ``SessionRequest`` (Heartbeat, CloseSession; Heartbeat's
  result is the ``Session``), ``ReleaseHoldsRequest``, ``KeysRequest`` (RemoveKeys),
  ``PoolRequest`` (ClearPool, DeletePool, GetPool, ListSessions), ``AllocRequest``,
  ``FreeRequest``, ``CreatePoolRequest``, ``OpenSessionRequest``, ``DrainRequest`` /
  ``DrainResult``, ``WatchEventsRequest``, ``NoRequest`` (Ping, GetInfo, ListPools); ``Count``,
  ``Done``.
- ``Method`` and ``METHODS`` (every RPC of the service, by its gRPC name), ``method(name)``,
  ``DATA_METHODS``; ``PoolOf``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from hicache.calls import (
    AllocRequest,
    CreatePoolRequest,
    DrainRequest,
    FreeRequest,
    KeysRequest,
    LoadKeysRequest,
    LookupRequest,
    LookupResult,
    NoRequest,
    OpenSessionRequest,
    PoolRequest,
    ReleaseHoldsRequest,
    SessionRequest,
    StoreRequest,
    StoreResult,
    TransferRequest,
    WatchEventsRequest,
)
from hicache.errors import SpecInvalid
from hicache.identity import is_public_id
from hicache.indices import IndexArray
from hicache.pools import PoolInfo
from hicached.cache.index_types import NO_SPACE, PRESENT, STORED
from hicached.copy.engine import Op, TransferResult
from hicached.service import views
from hicached.service.daemon import Daemon
from hicached.service.sessions import Session
from hicached.service.views import EventView, InfoView

__all__ = [
    "DATA_METHODS", "METHODS", "AllocRequest", "Count", "CreatePoolRequest",
    "Done", "DrainRequest", "DrainResult", "FreeRequest", "KeysRequest", "LoadKeysRequest",
    "LookupRequest", "LookupResult", "Method", "NoRequest", "OpenSessionRequest", "PoolOf",
    "PoolRequest", "ReleaseHoldsRequest", "SessionRequest", "StoreRequest", "StoreResult",
    "TransferRequest", "TransferResult", "WatchEventsRequest", "method",
]

log = logging.getLogger(__name__)


# -- requests and results -------------------------------------------------------------------


class Count(NamedTuple):
    """How many: keys released or removed, pages freed."""

    n: int


class Done(NamedTuple):
    """A call that answers only that it ran."""


class DrainResult(NamedTuple):
    in_flight: int
    """Calls being handled when the drain began."""
    grace_seconds: float
    """The grace period that applies."""
    already_draining: bool


# -- handlers -------------------------------------------------------------------------------


def lookup(d: Daemon, q: LookupRequest) -> LookupResult:
    hit_prefix, tiers, held, promised = d.lookup(q.pool, q.keys, q.session_id, q.hold_ms,
                                                 q.touch)
    return LookupResult(hit_prefix, tiers, len(tiers) - tiers.count(0), held, promised)


def store(d: Daemon, q: StoreRequest) -> StoreResult:
    ticket, r = d.store(q.session_id, q.keys, q.device, q.layers, q.token_ids, q.parent_key,
                        q.deadline_ns, q.lora_name, q.cache_salt, q.lookahead_tokens,
                        q.lookahead_token_ids)
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


def ping(d: Daemon, q: NoRequest) -> Done:
    return Done()


def get_info(d: Daemon, q: NoRequest) -> InfoView:
    return views.info_view(d)


def create_pool(d: Daemon, q: CreatePoolRequest) -> PoolInfo:
    spec = q.spec
    _, started = d.pools.create_async(spec)
    if started:
        log.info("pool %s: building in the background", spec.name)
    return views.pool_view(d, spec.name)


def get_pool(d: Daemon, q: PoolRequest) -> PoolInfo:
    return views.pool_view(d, q.pool)


def list_pools(d: Daemon, q: NoRequest) -> list[PoolInfo]:
    return views.pool_views(d)


def open_session(d: Daemon, q: OpenSessionRequest) -> Session:
    buffers = q.buffers
    return d.open_session(q.pool, q.worker_id,
                          buffers if callable(buffers) else lambda: list(buffers),
                          list(q.layer_events), q.ready_event, q.lease_ms / 1000.0,
                          q.peer_token)


def list_sessions(d: Daemon, q: PoolRequest) -> list[Session]:
    return d.sessions.list(q.pool)


def drain(d: Daemon, q: DrainRequest) -> DrainResult:
    grace = float(q.grace_seconds)
    if not 0 <= grace < math.inf:
        raise SpecInvalid(f"grace_seconds must be a finite number >= 0, got {grace}",
                          metadata={"field": "grace_seconds", "value": grace})
    already, in_flight = d.draining.is_set(), d.in_flight
    if d.begin_drain is not None:
        grace = d.begin_drain(grace)
    else:
        d.draining.set()
    return DrainResult(in_flight, grace, already)


def watch_events(d: Daemon, q: WatchEventsRequest) -> Iterator[EventView]:
    """Events after ``after_seq`` until the watcher goes, the pool is deleted or the daemon
    drains."""
    return views.watch_events(d, q.pool, int(q.after_seq), q.all_tiers, q.active)


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
    request: type
    """The typed request its codecs decode into."""
    result: type
    """The typed result its codecs encode (a server stream: each of its messages)."""
    handler: Callable[[Daemon, Any], Any]
    """The request's result on a daemon (a server stream: an iterator of its messages)."""
    creates_work: bool = False
    """Refused with ``DRAINING`` once shutdown began (every other method still answers)."""
    data: bool = False
    """A data call: bounded by ``max_data_rpcs`` over both front ends together."""
    pool_of: PoolOf | None = None
    """A pool-level call: where its request names the pool (and a session capability)."""
    grpc_only: bool = True
    """Served by gRPC alone; False: the fast path carries it too (a codec on each)."""
    stream: bool = False
    """A server stream: neither bounded nor drained (it ends by itself on a drain); gRPC's."""

    def __post_init__(self) -> None:
        if self.stream and (self.data or self.creates_work or not self.grpc_only):
            raise ValueError(f"{self.name}: a server stream is a gRPC control call")


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
    Method("CreatePool", CreatePoolRequest, PoolInfo, create_pool, True,
           pool_of=lambda r, d: (str(r.spec.name), "")),
    # checks its peer itself, before anything is mapped
    Method("OpenSession", OpenSessionRequest, Session, open_session, True),
    Method("WatchEvents", WatchEventsRequest, EventView, watch_events, pool_of=_pool,
           stream=True),
    Method("GetInfo", NoRequest, InfoView, get_info),
    Method("Ping", NoRequest, Done, ping),
    Method("GetPool", PoolRequest, PoolInfo, get_pool),
    Method("ListPools", NoRequest, list, list_pools),
    Method("ListSessions", PoolRequest, list, list_sessions),
    Method("Drain", DrainRequest, DrainResult, drain),
)

METHODS: dict[str, Method] = {m.name: m for m in _TABLE}
"""Every RPC of the service by name (a test holds it to the proto's service)."""
DATA_METHODS = frozenset(m.name for m in _TABLE if m.data)
_UNKNOWN = Method("", NoRequest, Done, ping)


def method(name: str) -> Method:
    """The entry of ``name``; an unknown name gets a control call's (no pool, no work)."""
    return METHODS.get(name, _UNKNOWN)
