"""What the client's calls return, as plain dataclasses (decoded from the wire replies).

Primitives: ``PoolInfo``, ``TransferStats``, ``LookupResult``, ``StoreResult``, ``CacheEvent``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.codec import spec_from_proto
from hicache.specs import PoolSpec
from hicache.v1 import hicache_pb2 as pb

STORED, ALREADY_PRESENT, NO_SPACE = 1, 2, 3
"""Per-key Store status."""


@dataclass(frozen=True)
class PoolInfo:
    spec: PoolSpec
    size_tokens: int
    page_num: int
    page_bytes: int
    used_pages: int
    free_pages: int
    capacity_bytes: int
    used_bytes: int
    pinned_bytes: int
    sessions: int
    keys: int = 0
    """Ready keys of the cache."""
    keyed_pages: int = 0
    raw_pages: int = 0
    pinned_pages: int = 0
    """Deprecated: ``busy_pages`` under its old name (the same number)."""
    metadata_bytes: int = 0
    state: str = "READY"
    """``READY``, ``CREATING`` (memory still being faulted in / pinned) or ``FAILED``."""
    progress: float = 1.0
    """CREATING: how much of the memory is faulted in (0..1)."""
    error: str = ""
    error_reason: str = ""
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
    busy_pages: int = 0
    """Pages a copy is reading or writing right now (never evicted)."""
    kv_events_endpoint: str = ""
    """The pool's own KV event stream ("" = none): register the engine instances that load
    from this pool with it."""
    kv_events_replay_endpoint: str = ""
    share_bytes: int = 0
    """With an elastic budget: the bytes the pool may hold now (0: a pool of fixed size)."""
    floor_bytes: int = 0
    ceiling_bytes: int = 0
    tenant: str = ""

    @classmethod
    def from_proto(cls, p: pb.Pool) -> PoolInfo:
        state = pb.PoolState.Name(p.state).removeprefix("POOL_STATE_")
        return cls(spec_from_proto(p.spec), p.size_tokens, p.page_num, p.page_bytes,
                   p.used_pages, p.free_pages, p.capacity_bytes, p.used_bytes, p.pinned_bytes,
                   p.sessions, p.keys, p.keyed_pages, p.raw_pages, p.pinned_pages,
                   p.metadata_bytes, state, p.progress if state != "READY" else 1.0,
                   p.error, p.error_reason, p.attach_outcome, p.generation, p.recovered_keys,
                   p.disk_keys, p.disk_capacity_pages,
                   # a daemon from before the cluster_* names fills only the remote_* ones
                   p.cluster_namespace or p.remote_namespace, p.cluster_puts or p.remote_puts,
                   p.cluster_pending or p.remote_pending, p.busy_pages or p.pinned_pages,
                   p.kv_events_endpoint, p.kv_events_replay_endpoint, p.share_bytes,
                   p.floor_bytes, p.ceiling_bytes, p.tenant)

    @property
    def remote_namespace(self) -> str:
        """Deprecated: ``cluster_namespace``."""
        return self.cluster_namespace

    @property
    def remote_puts(self) -> int:
        """Deprecated: ``cluster_puts``."""
        return self.cluster_puts

    @property
    def remote_pending(self) -> int:
        """Deprecated: ``cluster_pending``."""
        return self.cluster_pending


@dataclass(frozen=True)
class TransferStats:
    bytes_moved: int
    pages: int
    duration_seconds: float
    pending: bool = False
    """The copies may still be running on the GPU (a load with layer events)."""

    @classmethod
    def from_proto(cls, r: pb.TransferResponse) -> TransferStats:
        return cls(r.bytes_moved, r.pages, r.duration_seconds, r.pending)


@dataclass(frozen=True)
class LookupResult:
    hit_prefix: int
    """Leading keys found in some tier: the prefix a worker can load instead of recomputing."""
    tiers: bytes
    """One byte per key: 0 absent, 1 host memory, 2 the node's disk, 3 the cluster."""
    hits: int
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


@dataclass(frozen=True)
class StoreResult:
    stored: int
    already_present: int
    no_space: int
    status: bytes
    """One byte per key: STORED, ALREADY_PRESENT (or being written by another request),
    NO_SPACE (the pool is full of pages no copy lets go: not cached, not an error)."""
    bytes_moved: int
    duration_seconds: float

    @classmethod
    def from_proto(cls, r: pb.StoreResponse) -> StoreResult:
        return cls(r.stored, r.already_present, r.no_space, bytes(r.status), r.bytes_moved,
                   r.duration_seconds)


@dataclass(frozen=True)
class CacheEvent:
    seq: int
    kind: str
    """``STORED``, ``REMOVED`` or ``EVICTED``."""
    keys: tuple[bytes, ...]
    pool: str
    tier: int = 1
    """1 host memory, 2 disk, 3 cluster store (Lookup's tier bytes)."""
    medium: str = "CPU_PINNED"
    """The tier as SGLang's ``StorageMedium`` names it: CPU_PINNED, DISK, EXTERNAL."""
    parent_key: bytes = b""
    """STORED: the key before ``keys[0]`` in its chain (b"" when none is known)."""
    token_ids: tuple[int, ...] = ()
    """STORED: the pages' tokens, ``block_size`` per key, when the writer gave them."""
    block_size: int = 0
    lora_name: str = ""
    """STORED: the LoRA adapter the writer named ("" = the base model)."""
    cache_salt: str = ""
    """STORED: the cache salt the writer named ("" = none)."""

    @classmethod
    def from_proto(cls, e: pb.CacheEvent) -> CacheEvent:
        kind = pb.CacheEventKind.Name(e.kind).removeprefix("CACHE_EVENT_KIND_")
        return cls(e.seq, kind, tuple(e.keys), e.pool, e.tier or 1, e.medium or "CPU_PINNED",
                   bytes(e.parent_key), tuple(e.token_ids), e.block_size, e.lora_name,
                   e.cache_salt)
