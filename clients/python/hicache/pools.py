"""A pool as the service reports it: its fields, written once for the daemon and its clients.

The daemon builds a ``PoolInfo`` for each pool it reports (``GetPool``, ``ListPools``,
``CreatePool``); its codec turns it into ``hicache.v1.Pool`` and the client's reads it back
into the same class. A field added here is one field everywhere: the wire mapping goes by
name (``pool_to_proto`` / ``pool_from_proto``), and a test holds the fields to the message's.

Renamed fields keep their old names on the wire for older clients: ``DEPRECATED_FIELDS``
says which old name repeats which field, the codec fills the old from the new
(``fill_deprecated``), a reply from an older daemon that filled only the old one is read
through it, and ``PoolInfo`` answers the old names as the new ones' values.

Primitives: ``PoolInfo``, ``READY`` / ``CREATING`` / ``FAILED``, ``DEPRECATED_FIELDS``,
``fill_deprecated``, ``pool_to_proto``, ``pool_from_proto``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from hicache.codec import spec_from_proto, spec_to_proto
from hicache.specs import PoolSpec
from hicache.v1 import hicache_pb2 as pb

READY, CREATING, FAILED = "READY", "CREATING", "FAILED"
"""A pool's states: serving; being built in the background; its build failed."""

DEPRECATED_FIELDS: dict[str, dict[str, str]] = {
    "Pool": {"pinned_pages": "busy_pages", "remote_namespace": "cluster_namespace",
             "remote_puts": "cluster_puts", "remote_pending": "cluster_pending"},
    "GetInfoResponse": {"remote_tier": "cluster_tier"},
}
"""By message: each deprecated field -> the field whose value it repeats (a test holds this
to the proto's ``deprecated`` options)."""

_STATES = {READY: pb.POOL_STATE_READY, CREATING: pb.POOL_STATE_CREATING,
           FAILED: pb.POOL_STATE_FAILED}


@dataclass(frozen=True, kw_only=True)
class PoolInfo:
    """One pool: its spec, its state, what it holds and what its tiers and budget say."""

    spec: PoolSpec
    size_tokens: int
    page_bytes: int
    state: str = READY
    """``READY``, ``CREATING`` (memory still being faulted in / pinned) or ``FAILED``."""
    progress: float = 1.0
    """CREATING: how much of the memory is faulted in (0..1); 1 once READY."""
    error: str = ""
    """FAILED: why."""
    error_reason: str = ""
    """FAILED: the reason code of the build's error."""
    page_num: int = 0
    used_pages: int = 0
    free_pages: int = 0
    capacity_bytes: int = 0
    used_bytes: int = 0
    pinned_bytes: int = 0
    """Page-locked bytes (GPU hosts)."""
    sessions: int = 0
    keys: int = 0
    """Ready keys of the cache."""
    keyed_pages: int = 0
    raw_pages: int = 0
    busy_pages: int = 0
    """Pages a copy or a hold has now (read- or write-held; never evicted meanwhile)."""
    metadata_bytes: int = 0
    attach_outcome: str = ""
    """How the daemon found the pool's saved state: created, reattached, cold_version,
    cold_mismatch, cold_corrupt, or memory (no state directory)."""
    generation: int = 0
    """How many times a daemon attached the pool's files."""
    recovered_keys: int = 0
    disk_keys: int = 0
    """Keys the pool's disk tier holds (0 without one)."""
    disk_capacity_pages: int = 0
    cluster_namespace: str = ""
    """The pool's key namespace in the cluster tier ('' without one)."""
    cluster_puts: int = 0
    """Keys this daemon wrote to the cluster tier."""
    cluster_pending: int = 0
    """Stored keys waiting to be written there."""
    kv_events_endpoint: str = ""
    """The pool's own KV event stream ("" = none): register the engine instances that load
    from this pool with it."""
    kv_events_replay_endpoint: str = ""
    share_bytes: int = 0
    """With an elastic budget: the bytes the pool may hold now (0: a pool of fixed size)."""
    floor_bytes: int = 0
    """With an elastic budget: what the pool always keeps."""
    ceiling_bytes: int = 0
    """With an elastic budget: what it may hold at most."""
    tenant: str = ""
    """With an elastic budget: the tenant whose quota it counts in."""

    def __getattr__(self, name: str) -> Any:
        """A deprecated name: the value of the field it was renamed to."""
        new = DEPRECATED_FIELDS["Pool"].get(name)
        if new is None:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}")
        return getattr(self, new)


_SCALARS = tuple(f.name for f in fields(PoolInfo) if f.name not in ("spec", "state"))
"""The fields that go onto the wire as they are, each under its own name."""


def fill_deprecated(msg: Any) -> Any:
    """``msg`` with each of its deprecated fields repeating the field it was renamed to."""
    for old, new in DEPRECATED_FIELDS.get(msg.DESCRIPTOR.name, {}).items():
        setattr(msg, old, getattr(msg, new))
    return msg


def pool_to_proto(p: PoolInfo) -> pb.Pool:
    msg = pb.Pool(spec=spec_to_proto(p.spec), state=_STATES[p.state],  # type: ignore[arg-type]
                  **{name: getattr(p, name) for name in _SCALARS})
    return fill_deprecated(msg)  # type: ignore[no-any-return]


def pool_from_proto(msg: pb.Pool) -> PoolInfo:
    """The pool a reply reports (from an older daemon too: the old names read through)."""
    values = {name: getattr(msg, name) for name in _SCALARS}
    for old, new in DEPRECATED_FIELDS["Pool"].items():
        values[new] = values[new] or getattr(msg, old)
    state = pb.PoolState.Name(msg.state).removeprefix("POOL_STATE_")
    if state == READY:
        values["progress"] = 1.0
    return PoolInfo(spec=spec_from_proto(msg.spec), state=state, **values)
