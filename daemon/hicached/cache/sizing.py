"""Sizing: one pool's size as its share of a memory budget.

A pool that shares a budget grows on demand: when a Store or an Alloc finds it full, it asks
its ``Share`` for pages before it evicts its own. The budget shrinks it again (another pool's
demand, a tenant's quota): the least recently used keys go down to the new size (reason
``budget``), the pages of keys still above it are copied into free pages below it (a key keeps
its bytes, its recency and every tier's view of it; a page a copy, a hold or a spill is using,
or a raw page, stays where it is and the limit stays above it), and the memory above the limit
goes back to the system. The budget chooses whom to shrink by what the pool's next eviction
would cost: the idle time of its coldest key.

Primitives: ``Sizing(lock, pool, stats, index, slots, evict, drop, clock)``, over its pool
cache's lock and books (``evict(n, reason, now)`` -> keys evicted and ``drop(pages)`` are its
pool cache's):

- ``pool``, ``stats``: the pool and its cache's counters, as the budget reads them;
- ``share_with(share)``: the ``Share`` a full pool asks before it evicts (None: a fixed size);
  ``grow(pages)`` (the lock held): asks it, whether the pool grew;
- ``resize(pages, max_moves)`` -> ``Resized``: let the pool use ``pages`` pages;
- ``coldest_age(now)``: the idle time of the least recently used evictable key.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

import numpy as np

from hicache import seams
from hicache.errors import CanaryMismatch, PageBusy
from hicached.cache.index_types import CacheStats, Resized
from hicached.cache.key_index import KeyIndex
from hicached.cache.key_slots import KeySlots
from hicached.core.pool import HostPool

MOVE_BYTES = 64 << 20
"""Page bytes one ``resize`` copies below a shrinking pool's new size under the pool's lock
(a few milliseconds); the rest move on the next call."""


class Share(Protocol):
    """A pool's share of a memory budget, as its cache sees it."""

    def grow(self, pages: int) -> int:
        """Raise the pool allocator's limit by up to ``pages`` now (the cache's lock held);
        how many it rose by (0: the pool evicts its own)."""
        ...


class Sizing:
    """One pool's size under a memory budget (see the module's docstring)."""

    def __init__(self, lock: threading.Lock, pool: HostPool, stats: CacheStats,
                 index: KeyIndex, slots: KeySlots,
                 evict: Callable[[int, str, float], int],
                 drop: Callable[[np.ndarray], None],
                 clock: Callable[[], float]) -> None:
        self.pool = pool
        self.stats = stats
        """The pool cache's counters (the budget watches its evictions for pressure)."""
        self._lock = lock
        self._index = index
        self._slots = slots
        self._evict = evict
        self._drop = drop
        self._clock = clock
        self._share: Share | None = None
        self._layers = range(0, max(pool.spec.max_layers, 1))

    def share_with(self, share: Share | None) -> None:
        """Grow through ``share`` (a memory budget's) before evicting; None: the pool's size
        is fixed again."""
        with self._lock:
            self._share = share

    def grow(self, pages: int) -> bool:
        """The lock held: ask the share for ``pages`` more pages; whether it gave any."""
        return self._share is not None and pages > 0 and self._share.grow(pages) > 0

    def coldest_age(self, now: float) -> float:
        """How long ago the least recently used evictable key was used (0 without one): what
        the pool's next eviction would cost, the memory budget's value rule."""
        with self._lock:
            last = self._index.oldest_use()
        return max(now - last, 0.0) if last is not None else 0.0

    def resize(self, pages: int, max_moves: int | None = None) -> Resized:
        """Let the pool use ``pages`` pages (see the module's docstring); at most
        ``max_moves`` pages (default: ``MOVE_BYTES`` of them) are copied under the lock in
        one call (call again for the rest: the limit stays above the keys not moved yet)."""
        if max_moves is None:
            max_moves = max(MOVE_BYTES // max(self.pool.spec.page_bytes, 1), 1)
        now = self._clock()
        with self._lock:
            alloc = self.pool.allocator
            old = alloc.limit
            target = min(max(int(pages), 0), alloc.page_num)
            if target >= old:
                alloc.set_limit(target)
                return Resized(target, 0, 0, 0)
            short = alloc.used_pages - target
            evicted = self._evict(min(short, self._index.evictable), "budget", now) \
                if short > 0 else 0
            alloc.set_limit(target)
            moved = 0
            for page in alloc.in_use_from(target).tolist():
                if moved >= max_moves:
                    break
                if self._index.owner(page) is not None:  # (a raw page stays)
                    moved += self._move(page)
            seams.reached("resize.moved")
            limit = alloc.set_limit(max(target, alloc.top()))
            released = self.pool.release_pages(limit, old)
            return Resized(limit, evicted, moved, released)

    def _move(self, page: int) -> int:
        """Copy a ready key's page into a free page below the limit (1), or leave it where it
        is (0): being written, read, held or spilled, or no free page below."""
        key = self._index.movable(page)
        if key is None:
            return 0
        src = np.asarray([page], dtype=np.int64)
        pool, layers = self.pool, self._layers
        alloc = pool.allocator
        if not alloc.free_pages:
            return 0
        try:
            alloc.acquire(src, write=True)  # no copy reads it meanwhile
        except PageBusy:
            return 0
        dst = alloc.alloc_pages(1)  # busy for writing
        try:
            if pool.canary is not None:  # a damaged page is not copied into a sound one
                pool.canary.verify(src, layers, pool.fingerprints(src, layers))
            pool.copy_page(page, int(dst[0]))
            if pool.canary is not None:
                pool.canary.record(dst, layers, pool.fingerprints(dst, layers))
        except CanaryMismatch:
            alloc.release(src, write=True)
            alloc.release(dst, write=True)
            alloc.release_pages(dst)
            return 0
        new = int(dst[0])
        self._index.moved(key, page, new)
        self._slots.ready([new], [key])  # the newer slot wins if a crash leaves both
        alloc.release(dst, write=True, layers=layers)
        alloc.release(src, write=True)
        self._drop(src)
        return 1
