"""Lending: what the tiers below borrow from one pool's host memory.

A spiller takes the least recently used ready pages its tier has not written; a writer to
another tier borrows the pages of given keys. Either gets them read-held (an eviction meanwhile
drops the key from host memory, but its page is not reused until it comes back) and an
*epoch*: before it commits a key below, under its tier's own lock, it asks
``removed_since(key, epoch)``, so a key removed meanwhile never comes back through it (the
books are a ``removals.RemovalLog``, recorded by the pool cache's removals).

Primitives: ``Lending(lock, index, allocator, removals)``, over its pool cache's lock and
books (every verb takes the lock but ``removed_since``):

- ``spill_candidates(n, window, written)`` -> (keys, pages, epoch) / ``finish_spill(keys,
  pages, epoch)``: a spiller's batch out and back;
- ``borrow(keys)`` -> (keys still ready, pages, epoch) / ``give_back(pages, epoch)``: a
  writer's loan;
- ``removed_since(key, epoch)``: whether a removal since forbids the commit;
  ``still_wanted(epoch)``: the same as the test a tier's commit asks of each key;
- ``not_ready(keys)``: the keys host memory does not hold ready (what a tier below promotes).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from hicached.cache.key_index import KeyIndex
from hicached.cache.removals import RemovalLog
from hicached.core.allocator import PageAllocator


class Lending:
    """One pool's loans to the tiers below (see the module's docstring)."""

    def __init__(self, lock: threading.Lock, index: KeyIndex, allocator: PageAllocator,
                 removals: RemovalLog) -> None:
        self._lock = lock
        self._index = index
        self._alloc = allocator
        self._removals = removals

    def spill_candidates(self, n: int, window: int, written: Callable[[bytes], bool]
                         ) -> tuple[list[bytes], np.ndarray, int]:
        """Up to ``n`` of the ``window`` least recently used ready keys whose page the lower
        tier has not ``written``, with their pages read-held until ``finish_spill``, and the
        epoch to check removals against."""
        with self._lock:
            keys = self._index.to_spill(n, window, written)
            if not keys:
                return [], np.zeros(0, np.int64), self._removals.seq
            pages = np.asarray([self._index.ready[k] for k in keys], dtype=np.int64)
            self._alloc.acquire(pages, write=False)
            self._index.spill_begun(keys)
            return keys, pages, self._removals.lend()

    def finish_spill(self, keys: list[bytes], pages: np.ndarray, epoch: int) -> None:
        """The lower tier has (or failed to take) these pages: release them."""
        with self._lock:
            self._alloc.release(pages, write=False)
            self._index.spill_ended(keys)
            self._removals.end_lend(epoch)

    def borrow(self, keys: Sequence[bytes]) -> tuple[list[bytes], np.ndarray, int]:
        """The keys of ``keys`` still ready, with their pages read-held for a writer to
        another tier until ``give_back``, and the epoch to check removals against."""
        with self._lock:
            ready = self._index.ready
            held = [k for k in dict.fromkeys(keys) if k in ready]
            pages = np.asarray([ready[k] for k in held], dtype=np.int64)
            if pages.size:
                self._alloc.acquire(pages, write=False, unique=False)
            return held, pages, self._removals.lend()

    def give_back(self, pages: np.ndarray, epoch: int) -> None:
        """The writer to another tier is done with the pages ``borrow`` lent it."""
        with self._lock:
            if pages.size:
                self._alloc.release(pages, write=False, unique=False)
            self._removals.end_lend(epoch)

    def removed_since(self, key: bytes, epoch: int) -> bool:
        """Whether ``key`` was removed (or the pool cleared) after ``epoch``. No lock: a
        tier asks under its own, and a removal records its keys before it reaches a tier."""
        return self._removals.removed_since(key, epoch)

    def still_wanted(self, epoch: int) -> Callable[[bytes], bool]:
        """A key lent at ``epoch`` may still be committed below: not removed since."""
        return lambda key: not self._removals.removed_since(key, epoch)

    def not_ready(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys host memory does not hold ready (to be promoted from a lower tier)."""
        with self._lock:
            return [k for k in dict.fromkeys(keys) if k not in self._index.ready]
