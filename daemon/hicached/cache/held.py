"""The holds of a pool cache: the pages a Lookup promised to a session, kept for its load.

``HeldKeys`` is the part of ``PoolCache`` that takes and ends holds (the books are a
``holds.HoldTable``); ``PoolCache`` inherits it and shares its lock and index with it. A held
page is read-held in the allocator and out of the LRU for as long as the hold lasts, so no
Store evicts it and no removal frees it: a removed held key is gone for every later Lookup,
its holder still loads it from its page, and the page is freed when the hold ends (a
LoadKeys consumed it, ``release_holds``, ``end_holds``, ``expire_holds``). A key removed and
stored again is held anew, on its new page, by the holder's next Lookup.

Primitives (all under the cache's lock): ``lookup_held(keys, holder, below)`` ->
(hit prefix, tiers, held); ``hold_promoted(owner, keys, seconds)``; ``release_holds(owner,
keys)``; ``end_holds(owner)``; ``expire_holds()``. ``Holder``: a session's owner number and
how long its holds last.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from hicached.cache.holds import Deadline, Hold, HoldPolicy, HoldTable
from hicached.cache.index_types import CacheStats
from hicached.core.allocator import PageAllocator
from hicached.core.pool import HostPool


class Holder(NamedTuple):
    """Who a Lookup holds its hit for: a session (its owner number) and for how long."""

    owner: int
    seconds: float


class HeldKeys:
    # shared with PoolCache, which sets them
    pool: HostPool
    policy: HoldPolicy
    holds: HoldTable
    stats: CacheStats
    _lock: threading.Lock
    _alloc: PageAllocator
    _ready: dict[bytes, int]
    _clock: Callable[[], float]
    _lookup: Callable[..., tuple[int, bytes, int]]
    _read_more: Callable[[int, bytes], None]
    _read_less: Callable[[int], None]
    _removal_seq: int
    _last_holds: dict[int, tuple[int, int, int, list[bytes], int, Deadline]]
    """Per owner, its last Lookup's holding: (leading keys in host memory, its holds'
    version, the removal sequence then, those keys, how many it held, their deadline)."""

    def lookup_held(self, keys: Sequence[bytes], holder: Holder,
                    below: Callable[[list[bytes]], list[int]] | None = None
                    ) -> tuple[int, bytes, int]:
        """``lookup``, and in the same step the leading keys host memory has are held for
        ``holder`` (up to its quota): (hit prefix, tier bytes, keys held). Keys it holds
        already take this Lookup's deadline. Keys below host memory are held once promoted
        (``hold_promoted``)."""
        return self._lookup(keys, below, True, holder)

    def hold_promoted(self, owner: int, keys: Sequence[bytes], seconds: float) -> int:
        """Hold for ``owner`` the leading ``keys`` host memory has now (the promotion its
        Lookup started landed); returns how many."""
        with self._lock:
            tiers = bytearray(1 if k in self._ready else 0 for k in keys)
            return self._hold_locked(owner, keys, tiers, self._clock() + seconds)

    def _hold_locked(self, owner: int, keys: Sequence[bytes], tiers: bytearray,
                     until: float) -> int:
        """Hold the leading keys whose tier byte is 1 (host memory), up to the owner's quota,
        until ``until`` (the latest Lookup of a key sets its hold's deadline); returns how
        many leading keys the owner holds now. The owner's Lookup of the very keys it held
        last, with nothing changed since, refreshes them in one step."""
        holds = self.holds
        if holds.ended(owner):
            return 0
        lead = len(tiers) - len(tiers.lstrip(b"\x01"))
        last = self._last_holds.get(owner)
        if (last is not None and last[0] == lead and last[1] == holds.version(owner)
                and last[2] == self._removal_seq and last[3] == keys[:lead]):
            last[5].until = until  # every hold it took points at this deadline
            return last[4]
        limit = self.policy.limit(self.pool.page_num)
        deadline = holds.deadline(owner, until)
        new: dict[bytes, int] = {}
        held = 0
        ready = self._ready
        for k in keys[:lead]:
            page = ready.get(k)
            if page is None:  # gone since a long Lookup's earlier chunk saw it
                break
            h = holds.get(owner, k)
            if h is not None and h.page != page:  # removed and stored again
                self._unhold(holds.drop(owner, [k]))  # since: hold the page it names now
                h = None
            if h is not None:
                h.deadline = deadline
                deadline.keys.append(k)
            elif k not in new:
                if holds.count(owner) + len(new) >= limit:
                    break
                new[k] = page
            held += 1
        if new:
            self._alloc.acquire(np.fromiter(new.values(), np.int64, len(new)), write=False,
                                unique=False)
            for k, page in new.items():
                holds.add(owner, k, page, deadline)
                self._read_more(page, k)
            self.stats.holds_taken += len(new)
        self._last_holds[owner] = (lead, holds.version(owner), self._removal_seq,
                                   list(keys[:lead]), held, deadline)
        return held

    def release_holds(self, owner: int, keys: Sequence[bytes] | None = None) -> int:
        """``ReleaseHolds``: the owner's holds of ``keys`` (None: all) end; how many."""
        with self._lock:
            gone = self.holds.drop(owner, None if keys is None else list(keys))
            self._unhold(gone)
            self.stats.holds_released += len(gone)
        return len(gone)

    def end_holds(self, owner: int) -> int:
        """The owner's session ended: its holds end, and it gets no new ones."""
        with self._lock:
            self._last_holds.pop(owner, None)
            gone = self.holds.end(owner)
            self._unhold(gone)
            self.stats.holds_ended += len(gone)
        return len(gone)

    def expire_holds(self) -> int:
        """End the holds whose deadline passed; returns how many."""
        due = self.holds.next_due()
        if due is None or due > self._clock():
            return 0
        with self._lock:
            gone = self.holds.expire(self._clock())
            self._unhold(gone)
            self.stats.holds_expired += len(gone)
        return len(gone)

    def _unhold(self, gone: list[Hold]) -> None:
        if not gone:
            return
        pages = np.asarray([h.page for h in gone], dtype=np.int64)
        self._alloc.release(pages, write=False, unique=False)
        for page in pages.tolist():
            self._read_less(page)
