"""Held pages: the holds of one pool, as pages its cache keeps for a session.

A hold (``holds``: the books) keeps its page read-held in the allocator and out of the
eviction order until it ends: no Store evicts it, no removal frees it (its holder still loads
it; the page is freed when the hold ends). A Lookup takes holds in the same step as it finds
its hit (the pool cache calls ``take`` under its lock); a LoadKeys consumes them
(``for_load`` / ``loaded``); the rest end by ``release``, ``end`` or ``expire``.

Primitives: ``HeldPages(lock, policy, index, allocator, removals, stats, page_num, clock)``,
over its pool cache's lock and books:

- ``table`` (``holds.HoldTable``) and ``policy`` (``holds.HoldPolicy``): the books and limits;
- ``take(holder, keys, tiers, until)`` (the lock held): hold the leading keys host memory
  has, up to the holder's quota; ``promoted(holder, keys)``: the same for keys a promotion
  landed; ``room(holder)``: how many more the holder may hold;
- ``for_load(owner, keys)`` -> the owner's holds of ``keys``; ``loaded(owner, held)``: a load
  consumed them (both with the lock held);
- ``release(owner, keys)`` (``ReleaseHolds``), ``end(owner)`` (its session ended),
  ``expire()`` (deadlines passed): how many holds ended.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from hicached.cache.holds import Hold, Holder, Holding, HoldPolicy, HoldTable
from hicached.cache.index_types import CacheStats
from hicached.cache.key_index import KeyIndex
from hicached.cache.removals import RemovalLog
from hicached.core.allocator import PageAllocator


class HeldPages:
    """One pool's holds as held pages (see the module's docstring)."""

    def __init__(self, lock: threading.Lock, policy: HoldPolicy, index: KeyIndex,
                 allocator: PageAllocator, removals: RemovalLog, stats: CacheStats,
                 page_num: int, clock: Callable[[], float]) -> None:
        self.table = HoldTable()
        self.policy = policy
        """Limits on holds (``max_held_fraction`` of this pool's pages per session)."""
        self._lock = lock
        self._index = index
        self._alloc = allocator
        self._removals = removals
        self._stats = stats
        self._page_num = page_num
        self._clock = clock

    def room(self, holder: Holder) -> int:
        """How many more pages ``holder`` may hold (its share of the pool, less its holds)."""
        with self._lock:
            if holder.ended():
                return 0
            return max(self.policy.limit(self._page_num) - self.table.count(holder.owner), 0)

    def promoted(self, holder: Holder, keys: Sequence[bytes]) -> int:
        """Hold for ``holder`` the leading ``keys`` host memory has now (the promotion its
        Lookup started landed); returns how many."""
        with self._lock:
            tiers = bytearray(1 if k in self._index.ready else 0 for k in keys)
            return self.take(holder, keys, tiers, self._clock() + holder.seconds)

    def take(self, holder: Holder, keys: Sequence[bytes], tiers: bytearray,
             until: float) -> int:
        """The lock held: hold the leading keys whose tier byte is 1 (host memory), up to the
        owner's quota, until ``until`` (the latest Lookup of a key sets its hold's deadline);
        returns how many leading keys the owner holds now; none once its session has ended
        (it marks itself ended before ``end`` takes the lock). The owner's Lookup of the very
        keys it held last, with nothing changed since, refreshes them in one step."""
        table = self.table
        if holder.ended():
            return 0
        owner = holder.owner
        lead = len(tiers) - len(tiers.lstrip(b"\x01"))
        last = table.last(owner)
        if (last is not None and last.lead == lead and last.version == table.version(owner)
                and last.removals == self._removals.seq and last.keys == keys[:lead]):
            last.deadline.until = until  # every hold it took points at this deadline
            return last.held
        limit = self.policy.limit(self._page_num)
        deadline = table.deadline(owner, until)
        new: dict[bytes, int] = {}
        held = 0
        ready = self._index.ready
        for k in keys[:lead]:
            page = ready.get(k)
            if page is None:  # gone since a long Lookup's earlier chunk saw it
                break
            h = table.get(owner, k)
            if h is not None and h.page != page:  # removed and stored again
                self._unhold(table.drop(owner, [k]))  # since: hold the page it names now
                h = None
            if h is not None:
                h.deadline = deadline
                deadline.keys.append(k)
            elif k not in new:
                if table.count(owner) + len(new) >= limit:
                    break
                new[k] = page
            held += 1
        if new:
            self._alloc.acquire(np.fromiter(new.values(), np.int64, len(new)), write=False,
                                unique=False)
            for k, page in new.items():
                table.add(owner, k, page, deadline)
                self._index.read_more(page, k)
            self._stats.holds_taken += len(new)
        table.remember(owner, Holding(lead, table.version(owner), self._removals.seq,
                                      list(keys[:lead]), held, deadline))
        return held

    def for_load(self, owner: int, keys: Sequence[bytes]) -> dict[bytes, Hold]:
        """The lock held: ``owner``'s holds of ``keys`` (a LoadKeys reads their pages)."""
        table = self.table
        if not owner or not table.count(owner):
            return {}
        return {k: h for k in keys if (h := table.get(owner, k)) is not None}

    def loaded(self, owner: int, held: dict[bytes, Hold]) -> None:
        """The lock held: a load consumed ``held`` (their readers pass to it)."""
        self.table.take(owner, held)
        self._stats.holds_loaded += len(held)

    def release(self, owner: int, keys: Sequence[bytes] | None = None) -> int:
        """``ReleaseHolds``: the owner's holds of ``keys`` (None: all) end; how many."""
        with self._lock:
            gone = self.table.drop(owner, None if keys is None else list(keys))
            self._unhold(gone)
            self._stats.holds_released += len(gone)
        return len(gone)

    def end(self, owner: int) -> int:
        """The owner's session ended (and says so to its ``Holder``s, so it gets no new
        holds): its holds end, and what the table kept for it goes."""
        with self._lock:
            gone = self.table.end(owner)
            self._unhold(gone)
            self._stats.holds_ended += len(gone)
        return len(gone)

    def expire(self) -> int:
        """End the holds whose deadline passed; returns how many."""
        due = self.table.next_due()
        if due is None or due > self._clock():
            return 0
        with self._lock:
            gone = self.table.expire(self._clock())
            self._unhold(gone)
            self._stats.holds_expired += len(gone)
        return len(gone)

    def _unhold(self, gone: list[Hold]) -> None:
        if not gone:
            return
        pages = np.asarray([h.page for h in gone], dtype=np.int64)
        self._alloc.release(pages, write=False, unique=False)
        self._index.read_less(pages.tolist(), self._clock())
