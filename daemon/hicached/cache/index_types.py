"""The types the content index speaks in: store tickets and status bytes, the lower-tier
protocol, counters.

Primitives: ``STORED`` / ``PRESENT`` / ``NO_SPACE``, ``KEY_INDEX_BYTES``, ``StoreTicket``,
``LowerTier``, ``CacheStats``, ``EVICTION_REASONS``, ``EVICTED_AGE_BUCKETS``, ``Resized``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np

STORED, PRESENT, NO_SPACE = 1, 2, 3
"""Store status bytes: written now, already present (or being written), no page to be had."""

KEY_INDEX_BYTES = 560
"""Host bytes the index spends per key (dict entries, the key object, the eviction policy's
node and ghost), charged to the memory budget for every page of a pool:
benchmarks/bench_cache.py measures, per key of a full 100,000-page pool with 32-byte keys,
283 (LRU) and 177 (reuse) filling it, and 475 and 541 once five more poolfuls went through
it (the dictionaries at their high-water size; reuse's native queues, ghost of four
poolfuls' ids and shadows, 245, in that). Longer keys (up to 64 bytes) take the rest."""


@dataclass
class StoreTicket:
    """A Store between ``begin_store`` and ``finish_store``."""

    keys: list[bytes]
    status: bytearray
    """One status byte per key (STORED is set by ``finish_store``)."""
    positions: np.ndarray
    """Positions in ``keys`` of the keys being written now."""
    pages: np.ndarray
    """Their pages, busy for writing, in the same order."""
    chain: bool = True
    """Whether ``keys`` are one chain in order (a Store's; a promotion's are not): what the
    STORED event says of keys the pool's chain table does not know."""
    reason: str = "store"
    """What asked for the pages (``begin_store``'s ``reason``): a promotion's keys are read
    up for a load, so they enter the eviction policy as used (``back``), not as new."""


class LowerTier(Protocol):
    """A tier below host memory holding keyed pages of this pool (``hicached.tiers``)."""

    tier: int
    """Its tier byte in Lookup (2 disk, 3 cluster)."""

    def contains(self, key: bytes) -> bool: ...

    def forget(self, keys: Sequence[bytes] | None) -> list[int]:
        """Drop ``keys`` (None: all) from the tier's index at once, no I/O (the pool cache's
        lock is held); the slots they had, for ``erase``."""

    def erase(self, slots: Sequence[int]) -> None:
        """The I/O of a ``forget`` (outside the pool cache's lock): the slots' records gone
        for good, the slots free again."""


EVICTION_REASONS = ("store", "promotion", "alloc", "budget")
"""What needed the room an eviction made: a Store's new pages, a page read up from the disk or
the cluster (a LoadKeys' promotion or a prefetch), raw pages for an Alloc, the pool's share of
the memory budget shrinking (``Sizing.resize``)."""
EVICTED_AGE_BUCKETS = (0.1, 1.0, 10.0, 60.0, 300.0, 1800.0, 3600.0, 21600.0, 86400.0)
"""Upper bounds (seconds) of the histogram of evicted keys' idle time (the last is +Inf)."""


@dataclass
class CacheStats:
    lookups: int = 0
    lookup_hits: int = 0
    lookup_misses: int = 0
    stored: int = 0
    already_present: int = 0
    no_space: int = 0
    evicted: int = 0
    removed: int = 0
    load_misses: int = 0
    spill_dropped: int = 0
    """Evicted keys the lower tier had not written yet: gone from every tier."""
    holds_taken: int = 0
    """Holds a Lookup (or the promotion it started) took."""
    holds_loaded: int = 0
    """Holds a LoadKeys of their session consumed (the promise kept)."""
    holds_released: int = 0
    """Holds ended by ReleaseHolds."""
    holds_ended: int = 0
    """Holds ended with their session."""
    holds_expired: int = 0
    """Holds that reached their deadline unused."""
    evicted_by: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(EVICTION_REASONS, 0))
    """Evicted keys by what needed the room (``EVICTION_REASONS``)."""
    evicted_age: list[int] = field(default_factory=lambda: [0] * (len(EVICTED_AGE_BUCKETS) + 1))
    """Evicted keys by their idle time (since their last use: stored, hit by a touching
    Lookup, loaded), one count per ``EVICTED_AGE_BUCKETS`` bound and one above the last."""
    evicted_age_sum: float = 0.0
    """The idle times of all evicted keys, summed (seconds)."""


class Resized(NamedTuple):
    """What a ``Sizing.resize`` did."""

    limit: int
    """Pages the pool may use now (its allocator's limit): the size asked for, or above it
    where pages it could neither evict nor move are still in use."""
    evicted: int
    """Keys evicted (least recently used first) to fit the new size."""
    moved: int
    """Keys whose pages were copied below the new limit (their bytes and recency kept)."""
    released_bytes: int
    """Memory of the pages above the limit given back to the system."""
