"""What the tiers below a pool cache borrow from it: pages to write down, keys to bring up.

``Lending`` is the part of ``PoolCache`` the spillers, the cluster writer and promotions use;
``PoolCache`` inherits it and shares its lock and index with it.

Primitives: ``spill_candidates(n, window, written)`` / ``finish_spill(keys, pages)``: the
oldest ready keys' pages, read-held for a spiller (an eviction meanwhile drops the key, but
its page is not reused until the write is done); ``borrow(keys)`` / ``give_back(pages)``: the
pages of given keys for a writer to another tier; ``not_ready(keys)``: the keys to promote;
``wait_landed(keys, timeout)``: until none of them is being written (a promotion in flight).
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

    def spill_candidates(self, n: int, window: int,
                         written: Callable[[bytes], bool]) -> tuple[list[bytes], np.ndarray]:
        """Up to ``n`` of the ``window`` least recently used ready keys whose page the lower
        tier has not ``written``, with their pages held for reading: an eviction meanwhile
        drops the key from host memory, but its page is not reused until ``finish_spill``."""
        with self._lock:
            keys = [k for k in self._lru.oldest(window)
                    if k not in self._spilling and not written(k)][:n]
            if not keys:
                return [], np.zeros(0, np.int64)
            pages = np.asarray([self._ready[k] for k in keys], dtype=np.int64)
            self._alloc.acquire(pages, write=False)
            self._spilling.update(keys)
        return keys, pages

    def finish_spill(self, keys: list[bytes], pages: np.ndarray) -> None:
        """The lower tier has (or failed to take) these pages: release them."""
        with self._lock:
            self._alloc.release(pages, write=False)
            self._spilling.subtract(keys)
            self._spilling += Counter()  # drop the keys no spiller holds any more

    def borrow(self, keys: Sequence[bytes]) -> tuple[list[bytes], np.ndarray]:
        """The keys of ``keys`` still ready, with their pages read-held for a writer to
        another tier; an eviction meanwhile drops the key, its page waits for ``give_back``."""
        with self._lock:
            held = [k for k in dict.fromkeys(keys) if k in self._ready]
            pages = np.asarray([self._ready[k] for k in held], dtype=np.int64)
            if pages.size:
                self._alloc.acquire(pages, write=False, unique=False)
        return held, pages

    def give_back(self, pages: np.ndarray) -> None:
        """The writer to another tier is done with the pages ``borrow`` lent it."""
        if pages.size:
            with self._lock:
                self._alloc.release(pages, write=False, unique=False)

