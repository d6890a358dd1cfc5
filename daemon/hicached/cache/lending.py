"""What the tiers below a pool cache borrow from it: pages to write down, keys to bring up.

``Lending`` is the part of ``PoolCache`` the spillers, the cluster writer and promotions use;
``PoolCache`` inherits it and shares its lock and index with it.

A removed key stays removed in every tier: a writer to a lower tier gets an *epoch* with the
pages it borrows, and before it commits a key there (under the tier's own lock) it asks
``removed_since(key, epoch)``: a ``RemoveKeys`` or ``ClearPool`` that came after the borrow
refuses the commit, or (the cluster, which has no such lock) has the write undone. A removal
records its keys (a clear, its sequence number) before it reaches the tiers, so whichever of
the two comes second sees the other. Removals are remembered only while some writer is out
(the memory is bounded by the removals during writes).

Primitives: ``spill_candidates(n, window, written)`` -> (keys, pages, epoch) /
``finish_spill(keys, pages, epoch)``: the oldest ready keys' pages, read-held for a spiller (an
eviction meanwhile drops the key, but its page is not reused until the write is done);
``borrow(keys)`` -> (keys, pages, epoch) / ``give_back(pages, epoch)``: the pages of given keys
for a writer to another tier; ``removed_since(key, epoch)`` (lock-free: a tier calls it under
its own lock); ``not_ready(keys)``: the keys to promote; ``wait_landed(keys, timeout)``: until
none of them is being written (a promotion in flight).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from hicached.cache.lru import LRU
from hicached.core.allocator import PageAllocator


class Lending:
    # the pool cache's, which sets them
    _lock: threading.Lock
    _landed: threading.Condition
    _alloc: PageAllocator
    _ready: dict[bytes, int]
    _writing: dict[bytes, int]
    _lru: LRU
    _spilling: Counter[bytes]
    _removal_seq: int
    _removed_at: dict[bytes, int]
    _cleared_at: int
    _lent: Counter[int]
    """Epochs of the writers out now (how many of each)."""

    def _init_lending(self) -> None:
        self._removal_seq = 0
        self._removed_at = {}
        self._cleared_at = -1
        self._lent = Counter()

    def _record_removal(self, keys: Sequence[bytes] | None) -> None:
        """A removal of ``keys`` (None: a clear), recorded before it reaches any tier (lock
        held): every writer out now will see it."""
        self._removal_seq += 1
        if keys is None:
            self._cleared_at = self._removal_seq
            self._removed_at.clear()
        elif self._lent:
            for k in keys:
                self._removed_at[k] = self._removal_seq

    def removed_since(self, key: bytes, epoch: int) -> bool:
        """Whether ``key`` was removed (or the pool cleared) after ``epoch``. No lock: a
        tier asks under its own, and a removal records its keys before it reaches a tier."""
        return self._cleared_at > epoch or self._removed_at.get(key, -1) > epoch

    def _lend(self) -> int:
        epoch = self._removal_seq
        self._lent[epoch] += 1
        return epoch

    def _end_lend(self, epoch: int) -> None:
        self._lent[epoch] -= 1
        if self._lent[epoch] <= 0:
            del self._lent[epoch]
            if not self._lent:  # no writer out: no commit can predate a removal now
                self._removed_at.clear()

    def wait_landed(self, keys: Sequence[bytes], timeout: float) -> bool:
        """Wait until none of ``keys`` is being written (a promotion in flight); False at
        ``timeout``."""
        with self._landed:
            return self._landed.wait_for(lambda: not any(k in self._writing for k in keys),
                                         timeout)

    def not_ready(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys host memory does not hold ready (to be promoted from a lower tier)."""
        with self._lock:
            return [k for k in dict.fromkeys(keys) if k not in self._ready]

    # -- spill -----------------------------------------------------------------------------

    def spill_candidates(self, n: int, window: int, written: Callable[[bytes], bool]
                         ) -> tuple[list[bytes], np.ndarray, int]:
        """Up to ``n`` of the ``window`` least recently used ready keys whose page the lower
        tier has not ``written``, with their pages held for reading (an eviction meanwhile
        drops the key from host memory, but its page is not reused until ``finish_spill``),
        and the epoch to check removals against."""
        with self._lock:
            keys = [k for k in self._lru.oldest(window)
                    if k not in self._spilling and not written(k)][:n]
            if not keys:
                return [], np.zeros(0, np.int64), self._removal_seq
            pages = np.asarray([self._ready[k] for k in keys], dtype=np.int64)
            self._alloc.acquire(pages, write=False)
            self._spilling.update(keys)
            return keys, pages, self._lend()

    def finish_spill(self, keys: list[bytes], pages: np.ndarray, epoch: int) -> None:
        """The lower tier has (or failed to take) these pages: release them."""
        with self._lock:
            self._alloc.release(pages, write=False)
            self._spilling.subtract(keys)
            self._spilling += Counter()  # drop the keys no spiller holds any more
            self._end_lend(epoch)

    def borrow(self, keys: Sequence[bytes]) -> tuple[list[bytes], np.ndarray, int]:
        """The keys of ``keys`` still ready, with their pages read-held for a writer to
        another tier (an eviction meanwhile drops the key, its page waits for
        ``give_back``), and the epoch to check removals against."""
        with self._lock:
            held = [k for k in dict.fromkeys(keys) if k in self._ready]
            pages = np.asarray([self._ready[k] for k in held], dtype=np.int64)
            if pages.size:
                self._alloc.acquire(pages, write=False, unique=False)
            return held, pages, self._lend()

    def give_back(self, pages: np.ndarray, epoch: int) -> None:
        """The writer to another tier is done with the pages ``borrow`` lent it."""
        with self._lock:
            if pages.size:
                self._alloc.release(pages, write=False, unique=False)
            self._end_lend(epoch)
