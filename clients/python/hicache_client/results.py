"""What the client's calls return, as plain dataclasses (decoded from the wire replies).

Primitives: ``TransferStats``, ``CacheEvent``; the API package's ``PoolInfo`` (``hicache.pools``),
``LookupResult`` and ``StoreResult`` (``hicache.calls``: the daemon returns the same types).
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.calls import LookupResult as LookupResult  # Lookup's reply
from hicache.calls import StoreResult as StoreResult  # Store's reply
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
    lookahead_token_ids: tuple[tuple[int, ...], ...] = ()
    """STORED: per key, the tokens after its page that its hash covers (vLLM's lookahead
    block hashes), when the writer gave them."""

    @classmethod
    def from_proto(cls, e: pb.CacheEvent) -> CacheEvent:
        kind = pb.CacheEventKind.Name(e.kind).removeprefix("CACHE_EVENT_KIND_")
        per, ids = int(e.lookahead_tokens), tuple(e.lookahead_token_ids)
        ahead = tuple(ids[i:i + per] for i in range(0, len(ids), per)) if per > 0 else ()
        return cls(e.seq, kind, tuple(e.keys), e.pool, e.tier or 1, e.medium or "CPU_PINNED",
                   bytes(e.parent_key), tuple(e.token_ids), e.block_size, e.lora_name,
                   e.cache_salt, ahead)
