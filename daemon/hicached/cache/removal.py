"""How keys leave a pool cache: removed (``RemoveKeys``, ``ClearPool``) or evicted.

``Removal`` is the part of ``PoolCache`` that drops keys; ``PoolCache`` inherits it and shares
its lock and index with it. A removal reaches every tier of the node and is recorded before
any tier hears of it (``lending``'s epochs), so a writer below never commits a removed key; a
page a copy or a hold still has is freed when that ends.

Primitives: ``remove(keys)`` (how many were there), ``remove_keys(keys)`` (which), ``clear()``
(how many); lock held: ``_forget(keys)``, ``_evict(n)`` (the least recently used ready keys no
copy holds, EVICTED events), ``_drop_pages(pages)``.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from hicached.cache.events import EventKind, EventLog
from hicached.cache.index_types import CacheStats, LowerTier
from hicached.cache.key_slots import KeySlots
from hicached.cache.lru import LRU
from hicached.core.allocator import PageAllocator
from hicached.core.pool import HostPool


class Removal:
    # the pool cache's, which sets them
    _lock: threading.Lock
    _alloc: PageAllocator
    _ready: dict[bytes, int]
    _writing: dict[bytes, int]
    _page_key: dict[int, bytes]
    _lru: LRU
    _spilling: Counter[bytes]
    pool: HostPool
    slots: KeySlots
    stats: CacheStats
    events: EventLog
    lower: LowerTier | None
    kept_below: Callable[[bytes], bool] | None
    _record_removal: Callable[[Sequence[bytes] | None], None]  # lending.Lending's

    # -- removal ---------------------------------------------------------------------------

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop ``keys`` (ready or being written) from every tier of this node; returns how
        many were there."""
        return len(self.remove_keys(keys))

    def remove_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """``remove``, returning the keys that were there."""
        with self._lock:
            unique, lower = list(dict.fromkeys(keys)), self.lower
            self._record_removal(unique)  # before any tier hears of it
            gone = self._forget([k for k in unique
                                 if k in self._ready or k in self._writing])
            self.events.append(EventKind.REMOVED, gone)  # the tier below says its own
            slots: list[int] = []
            if lower is not None:
                below = [k for k in unique if lower.contains(k)]
                slots = lower.forget(below)  # gone below at once, its I/O after the lock
                here = set(gone)
                gone = gone + [k for k in below if k not in here]
            self.stats.removed += len(gone)
        if lower is not None:
            lower.erase(slots)
        return gone

    def clear(self) -> int:
        """Drop every key; returns how many (each frees its page now, or once the copy that
        holds it ends). The tier below forgets its keys in the same step; its files are
        rewritten after the pool's lock is let go (a clear of a million keys on disk does not
        stop the pool's other calls)."""
        with self._lock:
            self._record_removal(None)  # before any tier hears of it
            gone = self._forget([*self._ready, *self._writing])
            lower = self.lower
            slots = lower.forget(None) if lower is not None else []
            self.stats.removed += len(gone)
            self.events.append(EventKind.REMOVED, gone)
        if lower is not None:
            lower.erase(slots)
        return len(gone)

    # -- internals (lock held) -------------------------------------------------------------

    def _forget(self, keys: list[bytes]) -> list[bytes]:
        pages = []
        for k in keys:
            page = self._ready.pop(k, None)
            if page is None:
                self._writing.pop(k, None)  # finish_store frees its page
                continue
            self._lru.discard(k)
            del self._page_key[page]
            pages.append(page)
        self._drop_pages(np.asarray(pages, dtype=np.int64))
        return keys

    def _evict(self, n: int) -> None:
        keys = self._lru.pop_oldest(n)
        kept = self.kept_below or (self.lower.contains if self.lower is not None else None)
        if kept is not None:  # being written below counts as below: it lands there
            below = sum(k in self._spilling or kept(k) for k in keys)
            self.stats.evicted_to_lower += below
            self.stats.spill_dropped += len(keys) - below
        pages = np.asarray([self._ready.pop(k) for k in keys], dtype=np.int64)
        for page in pages.tolist():
            del self._page_key[page]
        self._drop_pages(pages)
        self.stats.evicted += len(keys)
        self.events.append(EventKind.EVICTED, keys)

    def _drop_pages(self, pages: np.ndarray) -> None:
        if pages.size:
            self.slots.clear(pages)
            if self.pool.canary is not None:
                self.pool.canary.forget(pages)
            self._alloc.release_pages(pages)
