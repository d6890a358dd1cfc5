"""Which page holds which key of one pool, each key's state, and the order eviction takes.

A key is *writing* from the moment a Store takes a page for it until its copy ends, then
*ready* (or gone: the copy failed, or the key was removed meanwhile). A page with readers
(loads in flight, holds) is out of the eviction order until its last reader ends. A key a
spiller is writing below is evicted last: its page comes back only when the spill ends.

The index keeps no lock and no memory: its owner, the pool cache, holds its own lock around
every call, and frees the pages the index says are no longer any key's.

Primitives:

- ``KeyIndex(evictable)``: over an eviction policy (``lru.LRU`` or ``reuse_lru.ReuseLRU``).
- ``ready`` (key -> page) and ``writing`` (key -> page): read by the cache's queries, changed
  only here; ``owner(page)``, ``keyed_pages()``; ``margin``: what the ``reuse`` policy learnt.
- A store: ``write(key, page)``, then ``written(key, page, ok)`` (False: the page is no
  key's now) and ``landed(keys, now, used)`` (into the eviction order).
- Readers: ``read_more(page, key)``, ``readers(page)``, ``read_less(pages, now)``.
- The eviction order: ``touch(keys, now)``, ``evict(n, used)`` -> (keys, pages),
  ``evictable`` (how many), ``oldest_use()``.
- Spills: ``to_spill(n, window, written)``, ``spill_begun(keys)``, ``spill_ended(keys)``,
  ``spilling(key)``.
- ``forget(keys)`` -> the pages of those ready (a writing key's page is freed when its store
  ends); ``movable(page)`` / ``moved(key, old, new)`` (a shrinking pool's move);
  ``recovered(key, page)`` (a key found again after a restart).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from hicached.cache.lru import LRU
from hicached.cache.reuse_lru import ReuseLRU


class KeyIndex:
    """One pool's keys and pages (see the module's docstring); its owner's lock held."""

    def __init__(self, evictable: LRU | ReuseLRU) -> None:
        self.ready: dict[bytes, int] = {}
        """Ready keys and their pages, in the order they became ready."""
        self.writing: dict[bytes, int] = {}
        """Keys a Store is writing, and the page each was given."""
        self._page_key: dict[int, bytes] = {}
        """The key of every page a key has (ready or writing)."""
        self._reading: dict[int, int] = {}
        """Readers per page that keep it out of the eviction order: loads in flight, holds."""
        self._evictable = evictable
        """The evictable keys, in the order the pool's eviction policy takes them."""
        self._spilling: Counter[bytes] = Counter()
        """Keys a spiller is writing below (two spillers may write one key)."""

    # -- queries ---------------------------------------------------------------------------

    def owner(self, page: int) -> bytes | None:
        """The key whose page ``page`` is (ready or writing), or None."""
        return self._page_key.get(page)

    def keyed_pages(self) -> list[int]:
        """Every page a key has."""
        return list(self._page_key)

    @property
    def margin(self) -> float:
        """How many capacities longer a reused page is kept than one used once (the ``reuse``
        policy's learnt ``theta``; 0 under ``lru``). Read without the lock."""
        ev = self._evictable
        return ev.theta if isinstance(ev, ReuseLRU) else 0.0

    @property
    def evictable(self) -> int:
        """How many keys eviction could take now."""
        return len(self._evictable)

    def oldest_use(self) -> float | None:
        """When the first key eviction would take was last used (None: there is none)."""
        return self._evictable.oldest_use()

    # -- a store ---------------------------------------------------------------------------

    def write(self, key: bytes, page: int) -> None:
        """A Store writes ``key`` into ``page``."""
        self.writing[key] = page
        self._page_key[page] = key

    def written(self, key: bytes, page: int, ok: bool) -> bool:
        """The copy of ``key`` into ``page`` ended (``ok``: complete): whether the key is
        ready now. False: the copy failed, or the key was removed or cleared meanwhile; the
        page is no key's any more (its owner frees it)."""
        if self.writing.get(key) != page:  # removed or cleared meanwhile
            del self._page_key[page]
            return False
        del self.writing[key]
        if not ok:
            del self._page_key[page]
            return False
        self.ready[key] = page
        return True

    def landed(self, keys: Sequence[bytes], now: float, used: bool) -> None:
        """Keys that became ready enter the eviction order; ``used``: read up for a load, so
        used already (the most recent)."""
        if used:
            self._evictable.back(keys, now)
        else:
            self._evictable.add(keys, now)

    # -- readers ---------------------------------------------------------------------------

    def read_more(self, page: int, key: bytes) -> None:
        """One more reader of ``page``: out of the eviction order while it has any."""
        n = self._reading.get(page, 0)
        if n == 0:
            self._evictable.discard(key)
        self._reading[page] = n + 1

    def readers(self, page: int) -> int:
        return self._reading.get(page, 0)

    def read_less(self, pages: list[int], now: float) -> None:
        """One reader of each of ``pages`` ended: the keys, in order, that have none left and
        still name their page are evictable again, as used at ``now``."""
        back: list[bytes] = []
        reading, page_key, ready = self._reading, self._page_key, self.ready
        for page in pages:
            n = reading[page] - 1
            if n:
                reading[page] = n
                continue
            del reading[page]
            key = page_key.get(page)
            if key is not None and ready.get(key) == page:
                back.append(key)
        self._evictable.back(back, now)

    # -- the eviction order ----------------------------------------------------------------

    def touch(self, keys: Sequence[bytes], now: float) -> None:
        """``keys`` were used at ``now`` (those that are evictable)."""
        self._evictable.touch(keys, now)

    def evict(self, n: int, used: list[float]) -> tuple[list[bytes], list[int]]:
        """Up to ``n`` keys the policy takes first, gone, with their pages (``used`` gets
        when each was last used). Keys being spilled go last: their pages come back only when
        the spill ends, so evicting them first would free nothing."""
        keys = self._evictable.pop_oldest(n, self._spilling, used)
        pages = [self.ready.pop(k) for k in keys]
        for page in pages:
            del self._page_key[page]
        return keys, pages

    # -- spills ----------------------------------------------------------------------------

    def to_spill(self, n: int, window: int, written: Callable[[bytes], bool]) -> list[bytes]:
        """Up to ``n`` of the ``window`` keys eviction would take first that no spiller is
        writing and the tier below has not ``written``."""
        return [k for k in self._evictable.oldest(window)
                if k not in self._spilling and not written(k)][:n]

    def spill_begun(self, keys: Sequence[bytes]) -> None:
        self._spilling.update(keys)

    def spill_ended(self, keys: Sequence[bytes]) -> None:
        self._spilling.subtract(keys)
        self._spilling += Counter()  # drop the keys no spiller writes any more

    def spilling(self, key: bytes) -> bool:
        return key in self._spilling

    # -- removal, moves, recovery ----------------------------------------------------------

    def forget(self, keys: Sequence[bytes]) -> list[int]:
        """``keys`` are gone; the pages of those that were ready (a writing key's page is
        freed when its store ends: ``written`` says False)."""
        pages = []
        for k in keys:
            page = self.ready.pop(k, None)
            if page is None:
                self.writing.pop(k, None)
                continue
            self._evictable.discard(k)
            del self._page_key[page]
            pages.append(page)
        return pages

    def movable(self, page: int) -> bytes | None:
        """The ready key of ``page`` if nothing is using it (no reader, no spill), else
        None (a writing key's or a raw page, too)."""
        key = self._page_key.get(page)
        if (key is None or self.ready.get(key) != page or page in self._reading
                or key in self._spilling):
            return None
        return key

    def moved(self, key: bytes, old: int, new: int) -> None:
        """``key``'s bytes were copied from ``old`` into ``new``: it names ``new`` now."""
        self.ready[key] = new
        self._page_key[new] = key
        del self._page_key[old]

    def recovered(self, key: bytes, page: int) -> int | None:
        """``key`` is ready in ``page`` again (the pool's state re-attached); the page it had
        already (a move a crash cut short: the newest slot wins), which is no key's now."""
        old = self.ready.get(key)
        if old is not None:
            del self._page_key[old]
        self.ready[key] = page
        self._page_key[page] = key
        return old
