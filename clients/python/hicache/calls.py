"""The requests of ``hicache.v1.HostCache``'s calls and its data calls' results, typed once
for both sides.

The daemon's method table (``hicached.service.calls``) hands these to its handlers; each front
end's codec decodes its wire into them (gRPC's protobuf, the fast path's frames), and the
client's codecs (``hicache_client.codecs``) encode them onto either wire. Immutable
``NamedTuple`` classes: as cheap to build as a tuple, on the hot path of every call.

Primitives: ``LookupRequest``, ``StoreRequest``, ``LoadKeysRequest``, ``TransferRequest``
(Backup, Load), ``SessionRequest`` (Heartbeat, CloseSession), ``ReleaseHoldsRequest``,
``KeysRequest`` (RemoveKeys), ``PoolRequest`` (ClearPool, DeletePool, GetPool, ListSessions),
``AllocRequest``, ``FreeRequest``, ``CreatePoolRequest``, ``OpenSessionRequest``,
``DrainRequest``, ``WatchEventsRequest``, ``NoRequest`` (Ping, GetInfo, ListPools);
``LookupResult``, ``StoreResult`` (what the daemon's handlers return is what the client's
calls return).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from hicache.buffers import DeviceBufferSpec
from hicache.indices import IndexArray, PageIds
from hicache.specs import PoolSpec


class LookupRequest(NamedTuple):
    pool: str
    keys: list[bytes]
    session_id: str = ""
    """A session of ``pool``: whose the hold is (with ``hold_ms``), and the credential access
    rules accept for the pool."""
    hold_ms: int = 0
    """Hold the hit for ``session_id`` this long (0: no hold)."""
    touch: bool = False
    """The hit's host pages count as used now (the most recently used)."""
    promise: bool = False
    """The fast path's reply says ``promised`` too (``FLAG_PROMISE``; a gRPC reply always does)."""


class StoreRequest(NamedTuple):
    session_id: str
    keys: list[bytes]
    device: IndexArray | PageIds
    """Token indices (gRPC) or device page ids (the fast path), one page per key."""
    layers: tuple[int, int] = (0, 0)
    token_ids: Sequence[int] | IndexArray | bytes | None = None
    """``page_size`` per key, or None: what the pool's events publish of the keys (``bytes``:
    little-endian int64, as the fast path's frame carries them)."""
    parent_key: bytes = b""
    """The key before the first one, where the keys continue a chain."""
    deadline_ns: int = 0
    """Unix ns past which no copy begins and none is kept (0: none)."""
    lora_name: str = ""
    """The LoRA adapter whose KV the pages are ("" = the base model): what events say."""
    cache_salt: str = ""
    """The cache salt of the request that wrote the pages ("" = none): what events say."""
    lookahead_tokens: int = 0
    """Tokens after each page that its key's hash covers (vLLM's lookahead block hashes; 0:
    none): what events say."""
    lookahead_token_ids: Sequence[int] | IndexArray | bytes | None = None
    """``lookahead_tokens`` per key (with ``token_ids`` only), or None (``bytes``: as for
    ``token_ids``)."""


class LoadKeysRequest(NamedTuple):
    session_id: str
    keys: list[bytes]
    device: IndexArray | PageIds
    layers: tuple[int, int] = (0, 0)
    layer_events: bool = False
    """Return once the copies are enqueued (CUDA sessions with layer events)."""
    deadline_ns: int = 0


class TransferRequest(NamedTuple):
    """A Backup or Load of raw pages."""

    session_id: str
    host: IndexArray | PageIds
    device: IndexArray | PageIds
    layers: tuple[int, int] = (0, 0)
    layer_events: bool = False
    deadline_ns: int = 0


class SessionRequest(NamedTuple):
    session_id: str
    """The capability (or, for CloseSession, a public id a peer may close)."""


class ReleaseHoldsRequest(NamedTuple):
    session_id: str
    keys: list[bytes] | None
    """None or empty: every hold of the session."""


class KeysRequest(NamedTuple):
    pool: str
    keys: list[bytes]


class PoolRequest(NamedTuple):
    pool: str
    """The pool's name (ListSessions: "" for every pool's sessions)."""


class AllocRequest(NamedTuple):
    pool: str
    num_tokens: int
    session_id: str = ""
    """The session that owns the pages (freed when it ends); "" for none."""


class FreeRequest(NamedTuple):
    pool: str
    host: IndexArray


class NoRequest(NamedTuple):
    """A call that names nothing (Ping, GetInfo, ListPools)."""


class CreatePoolRequest(NamedTuple):
    spec: PoolSpec


BufferSource = Sequence[DeviceBufferSpec] | Callable[[], list[DeviceBufferSpec]]
"""A session's buffers, or (the daemon's decode) what decodes them: called once the caller's
access to the pool was checked, so a refused caller's buffers are never read."""


class OpenSessionRequest(NamedTuple):
    pool: str
    worker_id: str
    buffers: BufferSource
    layer_events: list[bytes]
    """IPC handles of the worker's interprocess CUDA events, one per layer group."""
    ready_event: bytes = b""
    lease_ms: int = 0
    """0: the daemon's default lease."""
    peer_token: str = ""
    """From the identity socket: who asks, and the fds of its memfd buffers."""


class DrainRequest(NamedTuple):
    grace_seconds: float = 0.0
    """0: the daemon's configured grace."""


def _forever() -> bool:
    return True


class WatchEventsRequest(NamedTuple):
    pool: str
    after_seq: int = 0
    all_tiers: bool = False
    """Every tier's events, not only host memory's."""
    active: Callable[[], bool] = _forever
    """The daemon's side: whether the watcher is still there (its transport says)."""


# -- results the daemon returns and the client reads, defined once --------------------------


class LookupResult(NamedTuple):
    hit_prefix: int
    """Leading keys found in some tier: the prefix a worker can load instead of recomputing."""
    tiers: bytes
    """One byte per key: 0 absent, 1 host memory, 2 the node's disk, 3 the cluster."""
    hits: int
    """Keys present, wherever they are in the batch."""
    held: int = 0
    """Leading keys held for the session named (``session_id`` and ``hold_ms``): a LoadKeys
    of that session cannot fail for them. Keys below host memory are held once promoted."""
    promise: int = -1
    """What the daemon said ``promised`` is; -1 from a daemon from before it said so."""

    @property
    def promised(self) -> int:
        """The leading keys a load can count on: those held, then those below host memory
        that the daemon keeps there, promotes and holds for the load, within the session's
        share of the pool (as the daemon says; a daemon from before it said nothing: every
        key below host memory after the held ones, which a hit past the share overstates)."""
        if self.promise >= 0:
            return self.promise
        n = self.held
        while n < self.hit_prefix and self.tiers[n] > 1:
            n += 1
        return n


class StoreResult(NamedTuple):
    stored: int
    already_present: int
    no_space: int
    status: bytes
    """One byte per key: STORED, ALREADY_PRESENT (or being written by another request),
    NO_SPACE (the pool is full of pages no copy lets go: not cached, not an error)."""
    bytes_moved: int
    duration_seconds: float

