"""The content index of one pool: keys -> pages, the state of each key, eviction, events.

A key is *writing* from the moment a Store takes a page for it until the copy finished, then
*ready*. Only ready keys are visible (Lookup, LoadKeys); a ready page is never written again, so
a reader never sees a torn page. The copies themselves run elsewhere: the daemon calls
``begin_*``, moves the bytes with the copy engine, then ``finish_*``.

Primitives:

- ``PoolCache(pool, events, policy, clock, eviction)``: over a ``HostPool``, sharing its
  allocator with the raw pages; ``policy``: the limits on holds (``holds.HoldPolicy``);
  ``eviction``: which ready keys go first when room is needed (``EVICTION``: ``"lru"``, least
  recently used, ``lru.LRU``; ``"reuse"``, pages used again outlive pages used once by a
  margin the pool learns, a batch's deepest first, ``reuse_lru.ReuseLRU``). "Least recently
  used" below means the policy's first victims.
- ``lookup(keys, below, touch)``: (hit prefix, one tier byte per key: 1 host, 2 disk, 3
  cluster (``below``, asked outside the lock), 0 absent); with ``touch`` the keys host memory
  has become the most recently used (else a Lookup leaves recency alone); ``LOOKUP_CHUNK`` keys
  per turn of the lock. ``lookup_held(keys, holder, below)`` -> (hit prefix, tiers, held):
  the same, holding for a session what host memory has of the hit prefix in the same step.
- ``holds`` (``held_pages.HeldPages``): the holds Lookups took, as pages kept read-held and
  out of the eviction order for their sessions; ``room``, ``promoted``, ``release``,
  ``end``, ``expire``.
- ``begin_store(keys)`` -> ``StoreTicket``: present or in-flight keys are not written again
  (status 2, touched in the LRU); new keys get a page each, busy for writing, evicting least
  recently used ready keys no copy is using (not busy) when the pool is full; keys left
  without a page are status 3. ``finish_store(ticket, ok)``: the keys become ready (status 1,
  STORED event), or vanish if the copy failed (``ok`` per page, or for all) or they were
  removed meanwhile.
- ``begin_load(keys, owner=)`` -> pages busy for reading, or ``KEY_NOT_FOUND`` (nothing
  held): a key ``owner`` holds is never refused (removed meanwhile, it is read from its held
  page); ``finish_load(pages)`` releases them, ends the holds they consumed and makes their
  keys evictable again, most recently used.
- ``remove(keys)`` (``remove_keys``: which were there), ``clear()``: keys vanish at once from
  every tier, writes below in flight included (see lending); a page a copy or a hold still
  has is freed when that ends (REMOVED events). Eviction (lock held, ``_evict(n, reason,
  now)``): the least recently used ready keys no copy is using (EVICTED events), those whose
  pages a spill has taken last (their pages come back only when the spill ends: evicting them
  first would free nothing for the Store or promotion that asked); counted by ``reason``
  (``EVICTION_REASONS``: what needed the room) and by each key's idle time.
- ``alloc_raw(tokens, owner)``: raw pages, evicting cached pages when the pool is full.
- ``sizing`` (``sizing.Sizing``): the pool's share of a memory budget: a full pool asks it
  for pages before it evicts; the budget resizes the pool (eviction reason ``budget``, pages
  moved below a shrinking pool's new size).
- ``stats``: counters for metrics; ``key_count``; ``eviction_margin`` (what the ``reuse``
  policy learnt); ``snapshot()``: the ready keys (what a KV event resync announces).
- A ``lower`` tier (``LowerTier``, e.g. the disk): ``lookup`` reports its tier byte for keys
  only it holds, ``remove`` / ``clear`` reach it, eviction counts whether each evicted key was
  below already; ``on_stored(keys)`` is the cue of its writers.
- ``lending`` (``lending.Lending``): what the tiers below borrow (a spiller's batch, a
  writer's loan, each with the epoch that makes removals final below) and the keys they
  promote; ``wait_landed(keys, timeout)``: a LoadKeys waits for a promotion to land.
- ``recover()``: after the pool's state files were re-attached, the complete keys again.

Raw pages share the allocator, are never evicted, may evict keyed pages. Thread-safe: one
lock per pool cache, taken before the allocator's (and a lower tier's). Its state is three
books it owns, each changed only under that lock: ``index`` (``key_index.KeyIndex``: keys,
pages, readers, spills, the eviction order), ``removals`` (``removals.RemovalLog``) and the
stats; ``holds``, ``lending`` and ``sizing`` are its roles, each a class of its own over that
lock and those books, passed in.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable, Sequence

import numpy as np

from hicache import seams
from hicache.errors import KeyNotFound
from hicache.locks import condition, lock
from hicached.cache.events import EventKind, EventLog
from hicached.cache.held_pages import HeldPages
from hicached.cache.holds import Holder, HoldPolicy
from hicached.cache.index_types import (
    EVICTED_AGE_BUCKETS,
    NO_SPACE,
    PRESENT,
    STORED,
    CacheStats,
    LowerTier,
    StoreTicket,
)
from hicached.cache.key_index import KeyIndex
from hicached.cache.key_slots import KeySlots
from hicached.cache.lending import Lending
from hicached.cache.lru import LRU
from hicached.cache.removals import RemovalLog
from hicached.cache.reuse_lru import ReuseLRU
from hicached.cache.sizing import Sizing
from hicached.core.pool import HostPool

EVICTION = ("lru", "reuse")
"""The eviction policies a pool may use: ``lru.LRU``, ``reuse_lru.ReuseLRU``."""
LOOKUP_CHUNK = 2048
"""Keys a Lookup checks per turn of the pool's lock (about 0.2 ms): a long batch lets the
other calls on the pool go in between."""


class PoolCache:
    """One pool's content index (see the module's docstring); one lock."""

    def __init__(self, pool: HostPool, events: EventLog | None = None,
                 policy: HoldPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic, eviction: str = "lru") -> None:
        if eviction not in EVICTION:
            raise ValueError(f"no eviction policy {eviction!r} (one of {sorted(EVICTION)})")
        self.pool = pool
        self._clock = clock
        self.events = events or EventLog()
        self.stats = CacheStats()
        self.lower: LowerTier | None = None
        """The tier below host memory, if the pool has one."""
        self.kept_below: Callable[[bytes], bool] | None = None
        """Whether an evicted key is kept by the tier its spiller writes to (default: the
        lower tier's ``contains``), for the eviction counters."""
        self.on_stored: Callable[[list[bytes]], None] = lambda keys: None
        """Called with the keys that became ready (the cue of spillers and writers)."""
        self.recovered_keys = 0
        """Keys found again when the pool was re-attached (``recover``)."""
        self.slots = KeySlots(pool.state.table("key_slots") if pool.state is not None
                              else None)
        self._alloc = pool.allocator
        self._lock = lock("pool_cache")
        self._landed = condition(self._lock)
        """Notified whenever keys stop being written (a LoadKeys waits for a promotion)."""
        self.index = KeyIndex(LRU() if eviction == "lru"
                              else ReuseLRU(lambda: self._alloc.limit))
        """Keys -> pages, their states, readers and eviction order (under this lock)."""
        self.removals = RemovalLog()
        """Removals and the epochs of the writers out (``lending.removed_since``)."""
        self.holds = HeldPages(self._lock, policy or HoldPolicy(), self.index, self._alloc,
                               self.removals, self.stats, pool.page_num, clock)
        """The holds Lookups take for sessions, as read-held pages."""
        self.lending = Lending(self._lock, self.index, self._alloc, self.removals)
        """What the tiers below borrow: spills, loans to writers, promotions' keys."""
        self.sizing = Sizing(self._lock, pool, self.stats, self.index, self.slots,
                             self._evict, self._drop_pages, clock)
        """The pool's size as its share of a memory budget (grow, resize)."""
        self._all_layers = range(0, max(pool.spec.max_layers, 1))

    def recover(self) -> dict[str, int]:
        """After the pool's state files were re-attached: every complete key is ready again
        (least recently stored first in the LRU); pages of keys whose store had not finished,
        damaged slots and raw pages of dead sessions are freed (``allocator.recover``).
        Returns counts: keys, raw pages, damaged slots, duplicates dropped."""
        found, damaged = self.slots.scan()
        found.sort(key=lambda f: f[2])
        dupes = 0
        now = self._clock()
        with self._lock:
            index = self.index
            for page, key, _seq in found:
                old = index.recovered(key, page)
                if old is not None:  # a move cut short by a crash; keep the newest
                    self.slots.clear(np.asarray([old], dtype=np.int64))
                    dupes += 1
            index.landed(list(index.ready), now, used=False)
            kept = self._alloc.recover(np.asarray(index.keyed_pages(), dtype=np.int64))
            if self.pool.canary is not None:  # fingerprints of the pages kept stay
                every = np.arange(self.pool.page_num, dtype=np.int64)
                kept_mask = self._alloc.is_allocated(every) | self._alloc.is_keyed(every)
                self.pool.canary.forget(every[~kept_mask])
        self.recovered_keys = len(self.index.ready)
        return {"keys": len(self.index.ready), "raw_pages": kept["raw"], "damaged": damaged,
                "duplicates": dupes}

    # -- queries ---------------------------------------------------------------------------

    @property
    def key_count(self) -> int:
        """Ready keys (read without the lock: one dict length, for metrics too)."""
        return len(self.index.ready)

    @property
    def eviction_margin(self) -> float:
        """How many capacities longer a reused page is kept than one used once (the
        ``reuse`` policy's learnt ``theta``; 0 under ``lru``). Read without the lock."""
        return self.index.margin

    def snapshot(self) -> list[bytes]:
        with self._lock:
            return list(self.index.ready)  # in the order they became ready: chains stay together

    def books(self) -> dict[str, int]:
        """The sizes of what the cache keeps per session and per removal (the soak and
        ``hicache_table_entries`` watch them stay flat): holds, the sessions holding,
        hold deadlines, last-Lookup books, removals kept for writers out; and the event
        log's keys kept for replay, a ring that fills to its size (``event_keys_max``)."""
        with self._lock:
            table = self.holds.table
            books = {"holds": table.total, "hold_owners": len(table.owners()),
                     "hold_deadlines": table.deadlines, "lookup_books": table.lookups,
                     "removals": self.removals.kept}
        # a ring, bounded by its size: kept for WatchEvents' replay (its own lock)
        books["event_keys"] = self.events.kept_keys
        books["event_keys_max"] = self.events.max_keys
        return books

    def lookup(self, keys: Sequence[bytes],
               below: Callable[[list[bytes]], list[int]] | None = None,
               count: bool = True, touch: bool = False) -> tuple[int, bytes]:
        """(leading keys found in any tier, one tier byte per key: 1 host, 2/3 below, 0).
        ``below`` (the cluster tier) is asked, outside the lock, for the tier bytes of the
        keys no tier of this node holds. ``count``: a Lookup (not a failed load's report).
        ``touch``: the keys host memory has become the most recently used."""
        hit_prefix, tiers, _ = self._lookup(keys, below, count, None, touch)
        return hit_prefix, tiers

    def lookup_held(self, keys: Sequence[bytes], holder: Holder,
                    below: Callable[[list[bytes]], list[int]] | None = None,
                    touch: bool = False) -> tuple[int, bytes, int]:
        """``lookup``, and in the same step the leading keys host memory has are held for
        ``holder`` (up to its quota): (hit prefix, tier bytes, keys held). Keys it holds
        already take this Lookup's deadline. Keys below host memory are held once promoted
        (``HeldPages.promoted``)."""
        return self._lookup(keys, below, True, holder, touch)

    def _lookup(self, keys: Sequence[bytes], below: Callable[[list[bytes]], list[int]] | None,
                count: bool, holder: Holder | None, touch: bool = False
                ) -> tuple[int, bytes, int]:
        """``lookup``; with ``holder`` also holds what host memory has of the hit prefix,
        in the same step (``held.HeldKeys``): (hit prefix, tiers, keys held)."""
        lower, index = self.lower, self.index
        held = 0
        tiers = bytearray()
        for at in range(0, max(len(keys), 1), LOOKUP_CHUNK):
            # a long batch takes the lock a chunk at a time: other calls go in between
            if at:
                seams.reached("lookup.chunk")
                time.sleep(0)  # and the interpreter: a waiting call's thread runs now
            if holder is not None and at + LOOKUP_CHUNK >= len(keys):
                seams.reached("lookup.hold")
            with self._lock:
                chunk = keys[at:at + LOOKUP_CHUNK]
                found = bytearray(map(index.ready.__contains__, chunk))
                if touch:
                    index.touch(list(itertools.compress(chunk, found)), self._clock())
                if lower is not None and found.count(0):
                    for i in (i for i, f in enumerate(found) if not f):
                        if lower.contains(chunk[i]):
                            found[i] = lower.tier
                tiers += found
                if holder is not None and at + LOOKUP_CHUNK >= len(keys):
                    # what an earlier chunk saw may have left since: holds stop at a key
                    # host memory no longer has (``HeldPages.take``)
                    held = self.holds.take(holder, keys, tiers,
                                           self._clock() + holder.seconds)
        if below is not None and 0 in tiers:
            absent = [i for i, t in enumerate(tiers) if not t]
            for i, t in zip(absent, below([keys[i] for i in absent]), strict=True):
                tiers[i] = t
        hits = len(keys) - tiers.count(0)
        if count:
            with self._lock:
                self.stats.lookups += 1
                self.stats.lookup_hits += hits
                self.stats.lookup_misses += len(keys) - hits
        hit_prefix = tiers.find(0)
        return (len(keys) if hit_prefix < 0 else hit_prefix), bytes(tiers), held

    # -- store -----------------------------------------------------------------------------

    def begin_store(self, keys: list[bytes], reason: str = "store") -> StoreTicket:
        status = bytearray(len(keys))
        self.holds.expire()  # pages whose holds ran out are evictable again
        now = self._clock()
        index = self.index
        with self._lock:
            new: list[int] = []
            there: list[bytes] = []
            for i, k in enumerate(keys):
                if k in index.ready:
                    status[i] = PRESENT
                    there.append(k)
                elif k in index.writing:
                    status[i] = PRESENT
                else:
                    new.append(i)
            if there:
                index.touch(there, now)
            short = len(new) - self._alloc.free_pages
            if self.sizing.grow(short):
                short = len(new) - self._alloc.free_pages
            if short > 0:
                self._evict(short, reason, now)
            grant = min(len(new), self._alloc.free_pages)
            pages = self._alloc.alloc_pages(grant) if grant else np.zeros(0, np.int64)
            for i, page in zip(new[:grant], pages.tolist(), strict=True):
                index.write(keys[i], page)
            for i in new[grant:]:
                status[i] = NO_SPACE
            self.stats.already_present += status.count(PRESENT)
            self.stats.no_space += len(new) - grant
        return StoreTicket(keys, status, np.asarray(new[:grant], dtype=np.int64), pages,
                           reason=reason)

    def finish_store(self, ticket: StoreTicket, ok: bool | Sequence[bool]) -> None:
        """The copy of ``ticket.pages`` completed (``ok``) or failed; or, one bool per page,
        which of them completed (a read from another tier)."""
        if not ticket.pages.size:
            return
        oks = [ok] * ticket.pages.size if isinstance(ok, bool) else list(ok)
        stored: list[bytes] = []
        stored_pages: list[int] = []
        drop: list[int] = []
        now = self._clock()
        with self._lock:
            for i, page, good in zip(ticket.positions.tolist(), ticket.pages.tolist(), oks,
                                     strict=True):
                key = ticket.keys[i]
                if self.index.written(key, page, good):
                    ticket.status[i] = STORED
                    stored.append(key)
                    stored_pages.append(page)
                else:  # failed, or removed or cleared meanwhile
                    drop.append(page)
            if isinstance(ok, bool):  # one outcome for the whole copy (a Store's)
                self._alloc.release(ticket.pages, write=True,
                                    layers=self._all_layers if ok else None)
            else:
                done = np.asarray(oks, dtype=bool)
                self._alloc.release(ticket.pages[done], write=True, layers=self._all_layers)
                self._alloc.release(ticket.pages[~done], write=True)
            # a promotion was read up for a load: used already, the most recent
            self.index.landed(stored, now, used=ticket.reason == "promotion")
            self.slots.ready(stored_pages, stored)  # their bytes are complete: a restart keeps them
            self._drop_pages(np.asarray(drop, dtype=np.int64))
            self.stats.stored += len(stored)
            self.events.append(EventKind.STORED, stored, chain=ticket.chain)
            self._landed.notify_all()
        if stored:
            self.on_stored(stored)

    def wait_landed(self, keys: Sequence[bytes], timeout: float) -> bool:
        """Wait until none of ``keys`` is being written (a promotion in flight); False at
        ``timeout``."""
        with self._landed:
            writing = self.index.writing
            return self._landed.wait_for(lambda: not any(k in writing for k in keys), timeout)

    # -- load ------------------------------------------------------------------------------

    def begin_load(self, keys: Sequence[bytes], count_miss: bool = True, owner: int = 0
                   ) -> np.ndarray:
        """The pages of ``keys``, read-held for the copy; every key must be ready, or held
        by ``owner`` (a held key removed meanwhile is still loaded from its held page): else
        ``KEY_NOT_FOUND`` and nothing changes (a refusal is counted in ``load_misses`` unless
        ``count_miss`` is False: a try before a retry). The owner's holds of these keys pass
        to the load: they end when ``finish_load`` does."""
        with self._lock:
            held = self.holds.for_load(owner, keys)
            ready = self.index.ready
            pages = [held[k].page if k in held else ready.get(k, -1) for k in keys]
            if -1 in pages:
                first = pages.index(-1)
                missing = pages.count(-1)
                self.stats.load_misses += count_miss
                raise KeyNotFound(
                    f"{missing} of {len(keys)} key(s) are not in the cache (never stored, "
                    f"evicted, removed or still being written); first at position {first}; "
                    f"nothing was loaded",
                    metadata={"first_missing_position": first, "hit_prefix": first,
                              "missing": missing, "field": "keys"})
            out = np.asarray(pages, dtype=np.int64)
            if not held:
                self._alloc.acquire(out, write=False, unique=False)
                for k, page in zip(keys, pages, strict=True):
                    self.index.read_more(page, k)
                return out
            # each position gets one reader: a consumed hold's own for the first use of
            # its key, a shared one (the page may be released already: removed) for repeats
            self.holds.loaded(owner, held)
            unused = set(held)
            fresh: list[tuple[bytes, int]] = []
            repeat: list[tuple[bytes, int]] = []
            for k, page in zip(keys, pages, strict=True):
                if k in unused:
                    unused.discard(k)
                    continue
                (repeat if self.index.readers(page) else fresh).append((k, page))
            if fresh:
                self._alloc.acquire(np.asarray([p for _, p in fresh], dtype=np.int64),
                                    write=False, unique=False)
            if repeat:
                self._alloc.share(np.asarray([p for _, p in repeat], dtype=np.int64))
            for k, page in fresh + repeat:
                self.index.read_more(page, k)
        return out

    def finish_load(self, pages: np.ndarray) -> None:
        with self._lock:
            self._alloc.release(pages, write=False, unique=False)
            self.index.read_less(pages.tolist(), self._clock())

    # -- removal ---------------------------------------------------------------------------

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop ``keys`` (ready or being written) from every tier of this node; returns how
        many were there."""
        return len(self.remove_keys(keys))

    def remove_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """``remove``, returning the keys that were there."""
        with self._lock:
            unique, lower = list(dict.fromkeys(keys)), self.lower
            self.removals.record(unique)  # before any tier hears of it
            index = self.index
            gone = self._forget([k for k in unique if k in index.ready or k in index.writing])
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
            self.removals.record(None)  # before any tier hears of it
            gone = self._forget([*self.index.ready, *self.index.writing])
            lower = self.lower
            slots = lower.forget(None) if lower is not None else []
            self.stats.removed += len(gone)
            self.events.append(EventKind.REMOVED, gone)
        if lower is not None:
            lower.erase(slots)
        return len(gone)

    # -- internals (lock held) -------------------------------------------------------------

    def _forget(self, keys: list[bytes]) -> list[bytes]:
        self._drop_pages(np.asarray(self.index.forget(keys), dtype=np.int64))
        return keys

    def _evict(self, n: int, reason: str, now: float) -> int:
        used: list[float] = []
        keys, pages = self.index.evict(n, used)
        st = self.stats
        st.evicted_by[reason] += len(keys)
        for last in used:
            age = max(now - last, 0.0)
            st.evicted_age_sum += age
            st.evicted_age[bisect.bisect_left(EVICTED_AGE_BUCKETS, age)] += 1
        kept = self.kept_below or (self.lower.contains if self.lower is not None else None)
        if kept is not None:  # being written below counts as below: it lands there
            st.spill_dropped += sum(not (self.index.spilling(k) or kept(k)) for k in keys)
        self._drop_pages(np.asarray(pages, dtype=np.int64))
        st.evicted += len(keys)
        self.events.append(EventKind.EVICTED, keys)
        return len(keys)

    def _drop_pages(self, pages: np.ndarray) -> None:
        if pages.size:
            self.slots.clear(pages)
            if self.pool.canary is not None:
                self.pool.canary.forget(pages)
            self._alloc.release_pages(pages)

    # -- raw pages -------------------------------------------------------------------------

    def alloc_raw(self, num_tokens: int, owner: int = 0) -> np.ndarray:
        """Raw pages (``Alloc``), evicting least recently used ready keys when the pool is
        full: a cache gives way. All or nothing: ``POOL_EXHAUSTED`` evicts nothing."""
        with self._lock:
            need = max(num_tokens, 0) // self.pool.page_size
            short = need - self._alloc.free_pages
            if num_tokens % self.pool.page_size == 0 and self.sizing.grow(short):
                short = need - self._alloc.free_pages
            if 0 < short <= self.index.evictable and num_tokens % self.pool.page_size == 0:
                self._evict(short, "alloc", self._clock())
            return self._alloc.alloc(num_tokens, owner)
