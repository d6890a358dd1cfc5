"""What the client's calls return, as plain dataclasses (decoded from the wire replies).

Primitives: ``PoolInfo`` (the API package's, ``hicache.pools``), ``TransferStats``,
``LookupResult``, ``StoreResult``, ``CacheEvent``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.pools import PoolInfo as PoolInfo  # a reply of GetPool, ListPools, CreatePool
from hicache.v1 import hicache_pb2 as pb

STORED, ALREADY_PRESENT, NO_SPACE = 1, 2, 3
"""Per-key Store status."""


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
