"""A pool as the service reports it: its fields, written once for the daemon and its clients.

The daemon builds a ``PoolInfo`` for each pool it reports (``GetPool``, ``ListPools``,
``CreatePool``); ``hicache.codec`` turns it into ``hicache.v1.Pool`` and back into the same
class for the client. A field added here is one field everywhere: the wire mapping goes by
name (``codec.pool_to_proto`` / ``codec.pool_from_proto``), and a test holds the fields to the
message's. No protobuf here: the daemon's service layer speaks no wire format.

Renamed fields keep their old names on the wire for older clients: ``DEPRECATED_FIELDS``
says which old name repeats which field, the codec fills the old from the new
(``codec.fill_deprecated``), a reply from an older daemon that filled only the old one is
read through it, and ``PoolInfo`` answers the old names as the new ones' values.

Primitives: ``PoolInfo``, ``READY`` / ``CREATING`` / ``FAILED``, ``DEPRECATED_FIELDS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hicache.specs import PoolSpec

READY, CREATING, FAILED = "READY", "CREATING", "FAILED"
"""A pool's states: serving; being built in the background; its build failed."""

DEPRECATED_FIELDS: dict[str, dict[str, str]] = {
    "Pool": {"pinned_pages": "busy_pages", "remote_namespace": "cluster_namespace",
             "remote_puts": "cluster_puts", "remote_pending": "cluster_pending"},
    "GetInfoResponse": {"remote_tier": "cluster_tier"},
}
"""By message: each deprecated field -> the field whose value it repeats (a test holds this
to the proto's ``deprecated`` options)."""

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
