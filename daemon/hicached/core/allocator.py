"""Page allocator of a host pool: whole pages out and back, which are busy (a copy is using
them), what they hold.

Primitives:

- ``PageAllocator(page_num, page_size, layer_num)``: per-page state, kind, owner, access and
  written bits; free pages sit on a stack, so ``alloc`` and ``free`` cost O(pages moved), never
  O(free pages), and the pages freed last are handed out first: memory written a moment ago
  is written again faster than memory that went cold (measured in bench_cache.py). A fresh
  pool hands out pages 0, 1, 2, ... in order.
- Raw pages (``Alloc`` / ``Free``): ``alloc(num_tokens, owner)`` hands out page-aligned token
  indices or ``POOL_EXHAUSTED``; ``free(indices)`` returns them (double free, never-allocated,
  keyed and partial pages are errors, found for the whole batch before anything changes);
  ``free_owned(owner)`` frees every raw page a session owned.
- Keyed pages (the cache): ``alloc_pages(n)`` hands out page numbers busy for writing,
  ``release_pages(pages)`` gives them back.
- Access (the copies'): ``acquire(pages, write, unique, generations)`` / ``share`` /
  ``release``: one writer or any number of readers per page, never both; a conflicting
  request is refused with ``PAGE_BUSY`` (nothing waits), a page no longer allocated (or, with
  ``generations``, no longer the raw page of that generation) with ``PAGE_NOT_ALLOCATED``;
  a page freed while busy returns to the free stack when the last copy using it ends, so a copy
  in flight never touches a page handed to someone else.
- ``raw_state(pages, layers)``: in one step, which pages are allocated raw pages, which had
  every layer of ``layers`` written since (a load of anything else is ``PAGE_NOT_WRITTEN``),
  and their generations (bumped on every allocation). A raw copy passes those generations to
  ``acquire``, which refuses (``PAGE_NOT_ALLOCATED``) a page freed, and perhaps handed to
  someone else, since it was checked: a raw copy never writes or reads another's page.
- ``limit`` / ``set_limit(pages)``: pages are handed out below ``limit`` only (the pool's
  share of the memory budget: the pages above it are not to be touched, their memory may be
  given back); a free page above it is *parked*, off the free stack, and a page freed above
  it is parked too. ``top()``: one past the highest page in use (what the limit can drop to).
- ``memcheck()``: verifies every invariant (the tests call it after every operation).
- ``table_specs`` / ``tables=`` / ``recover(keep_keyed)``: state, kind, owner and written bits
  may live in a state file (``core.state_file``), so that a later daemon finds the raw pages
  nobody owned and the pages of complete keys again; every table write is ordered so that a
  process killed at any instant leaves nothing a restart would misread.

Thread-safe: every public method holds the allocator's lock. Work is vectorized with numpy.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hicache.errors import (
    AllocSizeNotPageAligned,
    DoubleFree,
    PageBusy,
    PageNotAllocated,
    PoolExhausted,
    Violation,
    raise_violations,
)
from hicache.locks import lock
from hicached.core.state_file import TableSpec
from hicached.core.validation import (
    IndexArray,
    check_duplicate_pages,
    check_page_runs,
    check_range,
    page_numbers,
    to_index_array,
)

FREE = 0
ALLOCATED = 1
RELEASING = 2
"""Page states (0 is free): freed while busy (a copy reads or writes it), a page returns to
the free stack when the last copy using it ends."""
RAW = 1
"""Kind of a page handed out by ``alloc``: named by host indices."""
SMALL_BATCH = 16
"""Busy marks on up to this many pages are taken and given back page by page."""


KEYED = 2
"""Kind of a page handed out by ``alloc_pages``: named by a content key (``RAW``: by host
indices, handed out by ``alloc``)."""


def table_specs(page_num: int, layer_num: int) -> list[TableSpec]:
    """The tables a restart needs (state, kind, owner, written bits), for a state file."""
    return [TableSpec("alloc_state", "i1", (page_num,)),
            TableSpec("alloc_kind", "i1", (page_num,)),
            TableSpec("alloc_owner", "<i8", (page_num,)),
            TableSpec("alloc_written", "?", (page_num, layer_num))]


class PageAllocator:
    def __init__(self, page_num: int, page_size: int, layer_num: int = 1,
                 tables: Mapping[str, np.ndarray] | None = None) -> None:
        """``tables``: where the state, kind, owner and written bits live (``table_specs``;
        views of a state file, so they outlive the process); zeroed arrays when None. Tables
        saved by an earlier process are taken as they are: call ``recover`` next."""
        assert page_num >= 0 and page_size >= 1 and layer_num >= 1
        self.page_num = page_num
        self.page_size = page_size
        self.layer_num = layer_num
        self._lock = lock("allocator")
        self._stack = np.arange(page_num - 1, -1, -1, dtype=np.int64)
        self._nfree = page_num
        t = tables or {}
        self._state = t.get("alloc_state", np.zeros(page_num, dtype=np.int8))
        self._kind = t.get("alloc_kind", np.zeros(page_num, dtype=np.int8))
        self._owner = t.get("alloc_owner", np.zeros(page_num, dtype=np.int64))
        self._written = t.get("alloc_written", np.zeros((page_num, layer_num), dtype=bool))
        self._readers = np.zeros(page_num, dtype=np.int32)
        self._writer = np.zeros(page_num, dtype=bool)
        self._generation = np.zeros(page_num, dtype=np.uint32)
        self._releasing = 0
        self._limit = page_num
        self._parked = 0
        self.alloc_failures = 0

    # -- queries ---------------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        with self._lock:
            return self._nfree

    @property
    def used_pages(self) -> int:
        """Pages allocated (or being released): neither on the free stack nor parked."""
        with self._lock:
            return self.page_num - self._nfree - self._parked

    @property
    def limit(self) -> int:
        """Pages are handed out below this page number only."""
        return self._limit

    def set_limit(self, pages: int) -> int:
        """Hand out pages below ``pages`` only (clamped to ``0..page_num``); returns the limit.
        Lowering it parks the free pages above it (pages in use there stay in use, and are
        parked when freed); raising it puts the parked pages below it back on the free stack,
        under the pages freed last (those are warm)."""
        pages = min(max(int(pages), 0), self.page_num)
        with self._lock:
            old, self._limit = self._limit, pages
            if pages < old:
                stack = self._stack[:self._nfree]
                keep = stack[stack < pages]
                self._parked += self._nfree - int(keep.size)
                self._stack[:keep.size] = keep
                self._nfree = int(keep.size)
            elif pages > old:
                back = old + np.flatnonzero(self._state[old:pages] == FREE)
                n = int(back.size)
                self._stack[n:self._nfree + n] = self._stack[:self._nfree].copy()
                self._stack[:n] = back[::-1]
                self._nfree += n
                self._parked -= n
            return pages

    def in_use_from(self, first: int) -> np.ndarray:
        """The pages from ``first`` on that are not free, ascending (vectorized: a shrink
        asks this instead of walking its keys)."""
        with self._lock:
            return first + np.flatnonzero(self._state[first:] != FREE)

    def top(self) -> int:
        """One past the highest page that is not free (0 when every page is)."""
        with self._lock:
            used = np.flatnonzero(self._state != FREE)
            return int(used[-1]) + 1 if used.size else 0

    def counts(self, locked: bool = True) -> dict[str, int]:
        """Pages by kind, how many are busy (a copy reads or writes them) and how many are
        used (``used_pages``) right now.
        ``locked=False`` (a metrics scrape) reads the tables without the lock: it never waits
        for, nor delays, a copy, and the figures may straddle an update made meanwhile."""
        if not locked:
            return self._counts()
        with self._lock:
            return self._counts()

    def _counts(self) -> dict[str, int]:
        live = self._state == ALLOCATED
        return {"raw": int((live & (self._kind == RAW)).sum()),
                "keyed": int((live & (self._kind == KEYED)).sum()),
                "busy": int(((self._readers > 0) | self._writer).sum()),
                "releasing": self._releasing, "free": self._nfree, "parked": self._parked,
                "used": self.page_num - self._nfree - self._parked}

    @staticmethod
    def bytes_per_page(layer_num: int) -> int:
        """Host bytes of the allocator's tables per page (free stack, state, kind, owner,
        readers, writer, generation, a written bit per layer)."""
        return 8 + 1 + 1 + 8 + 4 + 1 + 4 + layer_num

    @property
    def metadata_bytes(self) -> int:
        """Host bytes of the allocator's own tables."""
        return sum(a.nbytes for a in (self._stack, self._state, self._kind, self._owner,
                                      self._readers, self._writer, self._written,
                                      self._generation))

    def is_allocated(self, pages: np.ndarray) -> np.ndarray:
        """Boolean mask: which of ``pages`` (in range) are raw pages allocated now."""
        return self.raw_state(pages, None)[0]

    def is_keyed(self, pages: np.ndarray) -> np.ndarray:
        with self._lock:
            return np.asarray(self._kind[pages] == KEYED, dtype=bool)

    def raw_state(self, pages: np.ndarray, layers: range | None
                  ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """In one step: which of ``pages`` are allocated raw pages, which had every layer of
        ``layers`` written since their allocation (None without ``layers``), their
        generations."""
        with self._lock:
            raw = (self._state[pages] == ALLOCATED) & (self._kind[pages] == RAW)
            written = (None if layers is None else np.asarray(
                self._written[pages, layers.start:layers.stop].all(axis=1), dtype=bool))
            return np.asarray(raw, dtype=bool), written, self._generation[pages].copy()

    # -- raw pages -------------------------------------------------------------------------

    def alloc(self, num_tokens: int, owner: int = 0) -> np.ndarray:
        """Token indices of ``num_tokens // page_size`` fresh raw pages (each a full run),
        owned by ``owner`` (0: nobody; freed only by ``free``)."""
        ps = self.page_size
        if num_tokens < 0 or num_tokens % ps:
            up = -(-max(num_tokens, 0) // ps) * ps
            raise AllocSizeNotPageAligned(
                f"cannot allocate {num_tokens} tokens: not a non-negative multiple of "
                f"page_size {ps}; ask for {up}",
                metadata={"num_tokens": num_tokens, "page_size": ps, "aligned_size": up},
            )
        with self._lock:
            pages = self._take(num_tokens // ps, RAW, owner)
        return (pages[:, None] * ps + np.arange(ps, dtype=np.int64)).reshape(-1)

    def free(self, indices: object, *, field: str = "host_indices") -> np.ndarray:
        """Return the raw pages of ``indices`` (whole page runs); returns their page numbers."""
        idx = to_index_array(indices, field)
        pages = self._pages_of(idx, field)
        with self._lock:
            bad = np.flatnonzero((self._state[pages] != ALLOCATED) | (self._kind[pages] != RAW))
            if bad.size:
                pos = int(bad[0])
                page = int(pages[pos])
                keyed = bool(self._kind[page] == KEYED and self._state[page] == ALLOCATED)
                ever = bool(self._generation[page] > 0) and not keyed
                why = (" (a keyed cache page: remove its key instead)" if keyed
                       else " (already freed)" if ever else " (never allocated)")
                raise_violations([Violation(
                    field, DoubleFree.reason if ever else PageNotAllocated.reason,
                    f"{bad.size} page(s) are not allocated raw pages; first is page {page} "
                    f"(token {page * self.page_size}) at page position {pos}{why}",
                    {"page": page, "position": pos * self.page_size, "count": int(bad.size)},
                )])
            self._give_back(pages)
        return pages

    def free_owned(self, owner: int) -> int:
        """Free every raw page ``owner`` holds (a session that ended); returns how many."""
        if owner == 0:
            return 0
        with self._lock:
            pages = np.flatnonzero((self._owner == owner) & (self._state == ALLOCATED)
                                   & (self._kind == RAW))
            self._give_back(pages)
        return int(pages.size)

    # -- keyed pages -----------------------------------------------------------------------

    def alloc_pages(self, n: int) -> np.ndarray:
        """``n`` fresh keyed pages, busy for writing by the caller (``release(write=True)``
        ends the write)."""
        with self._lock:
            pages = self._take(n, KEYED)
            if n <= SMALL_BATCH:
                writer = self._writer
                for p in pages.tolist():
                    writer[p] = True
            else:
                self._writer[pages] = True
        return pages

    def release_pages(self, pages: np.ndarray) -> None:
        """Give keyed pages back (released once no copy uses them)."""
        with self._lock:
            if pages.size <= SMALL_BATCH:  # page by page: fancy indexing costs more here
                state, kind = self._state, self._kind
                listed = pages.tolist()
                assert all(state[p] == ALLOCATED and kind[p] == KEYED for p in listed)
                self._give_back_small(listed)
                return
            assert np.all((self._state[pages] == ALLOCATED) & (self._kind[pages] == KEYED))
            self._give_back(pages)

    # -- internals (lock held) -------------------------------------------------------------

    def _take(self, n: int, kind: int, owner: int = 0) -> np.ndarray:
        if n > self._nfree:
            self.alloc_failures += 1
            raise PoolExhausted(
                f"pool has {self._nfree} free pages, {n} requested",
                metadata={"requested_pages": n, "free_pages": self._nfree,
                          "page_num": self.page_num, "page_size": self.page_size},
            )
        pages = self._stack[self._nfree - n:self._nfree][::-1].copy()
        self._nfree -= n
        # what a restart reads (``recover``) is written state last: a page is never seen
        # allocated with an earlier owner's written bits or owner
        if n <= SMALL_BATCH:  # page by page: fancy indexing costs more at this size
            written, owners, kinds = self._written, self._owner, self._kind
            state, generation = self._state, self._generation
            for p in pages.tolist():
                written[p] = False
                owners[p] = owner
                kinds[p] = kind
                state[p] = ALLOCATED
                generation[p] += 1
            return pages
        self._written[pages] = False
        self._owner[pages] = owner
        self._kind[pages] = kind
        self._state[pages] = ALLOCATED
        self._generation[pages] += 1
        return pages

    def _put(self, pages: np.ndarray) -> None:
        """Pages back on the free stack, so that the next ``_take`` of as many returns them in
        this order. State first: a restart never keeps a page being freed."""
        self._state[pages] = FREE
        self._kind[pages] = 0
        self._owner[pages] = 0
        if self._limit < self.page_num:  # those above the limit are parked
            above = pages >= self._limit
            self._parked += int(above.sum())
            pages = pages[~above]
        n = int(pages.size)
        self._stack[self._nfree:self._nfree + n] = pages[::-1]
        self._nfree += n

    def recover(self, keep_keyed: np.ndarray) -> dict[str, int]:
        """After a restart, from tables an earlier process left: raw pages nobody owned stay
        allocated with their written bits (their holders may still name them); keyed pages
        stay only where ``keep_keyed`` (the pages of complete keys) says; owned raw pages
        (their sessions died with that process), releasing pages and the rest are freed.
        Returns how many raw and keyed pages were kept."""
        with self._lock:
            live = self._state == ALLOCATED  # RELEASING pages were freed already
            raw = live & (self._kind == RAW) & (self._owner == 0)
            keyed = np.zeros(self.page_num, dtype=bool)
            keyed[keep_keyed] = True
            keyed &= live & (self._kind == KEYED)
            keep = raw | keyed
            drop = ~keep
            self._state[drop] = FREE
            self._kind[drop] = 0
            self._owner[drop] = 0
            self._written[drop] = False
            self._state[keep] = ALLOCATED
            free = np.flatnonzero(drop)
            below = free[free < self._limit]
            self._parked = int(free.size - below.size)
            self._nfree = int(below.size)
            self._stack[:self._nfree] = below[::-1]
            self._readers[:] = 0
            self._writer[:] = False
            self._releasing = 0
            self._generation[keep] = 1
            return {"raw": int(raw.sum()), "keyed": int(keyed.sum())}

    def _give_back(self, pages: np.ndarray) -> None:
        held = (self._readers[pages] > 0) | self._writer[pages]
        self._state[pages[held]] = RELEASING
        self._releasing += int(held.sum())
        self._put(pages[~held])

    def _give_back_small(self, pages: list[int]) -> None:
        """``_give_back`` page by page, with the same order on the free stack."""
        readers, writer, state = self._readers, self._writer, self._state
        free = []
        for p in pages:
            if readers[p] > 0 or writer[p]:
                state[p] = RELEASING
                self._releasing += 1
            else:
                free.append(p)
        kinds, owners, stack = self._kind, self._owner, self._stack
        for p in free:  # state first: a restart never keeps a page being freed
            state[p] = FREE
            kinds[p] = 0
            owners[p] = 0
        limit = self._limit
        for p in reversed(free):
            if p >= limit:  # above the limit: parked
                self._parked += 1
                continue
            stack[self._nfree] = p
            self._nfree += 1

    def _pages_of(self, idx: IndexArray, field: str) -> np.ndarray:
        ps = self.page_size
        violations = check_page_runs(idx, ps, field) + check_range(idx, self.page_num * ps, field)
        pages = page_numbers(idx, ps)
        if not violations:
            violations = check_duplicate_pages(pages, ps, field)
        raise_violations(violations)
        return pages

    # -- access: who may touch a page now ------------------------------------------------

    def acquire(self, pages: np.ndarray, write: bool, unique: bool = True,
                generations: np.ndarray | None = None) -> None:
        """Hold ``pages`` for a copy that writes (exclusive) or reads (shared). They must be
        allocated (a concurrent free may have released one since validation, so it is checked
        again here) and, with ``generations`` (a raw copy's, from ``raw_state``), still the
        raw pages of those generations; no conflicting copy may be using them: else
        ``PAGE_BUSY``."""
        with self._lock:
            if pages.size <= SMALL_BATCH and self._acquire_small(
                    pages.tolist(), write, None if generations is None else generations.tolist()):
                return
            gone = self._state[pages] != ALLOCATED
            if generations is not None:
                gone |= (self._kind[pages] != RAW) | (self._generation[pages] != generations)
            bad = np.flatnonzero(gone)
            if bad.size:
                page = int(pages[bad[0]])
                raise PageNotAllocated(
                    f"{bad.size} page(s) were freed (and perhaps reused) after the transfer "
                    f"was checked; first page {page} at page position {int(bad[0])}; nothing "
                    "was copied",
                    metadata={"page": page, "count": int(bad.size),
                              "first_bad_position": int(bad[0]) * self.page_size},
                )
            busy = self._writer[pages]
            if write:
                busy = busy | (self._readers[pages] > 0)
            hit = np.flatnonzero(busy)
            if hit.size:
                page = int(pages[hit[0]])
                doing = "written" if self._writer[page] else "read"
                raise PageBusy(
                    f"{hit.size} page(s) are being {doing} by another request; first page "
                    f"{page} at page position {int(hit[0])}; retry once it finished",
                    metadata={"page": page, "count": int(hit.size),
                              "first_bad_position": int(hit[0]) * self.page_size,
                              "held_for": doing},
                )
            if write:
                self._writer[pages] = True
            elif unique:
                self._readers[pages] += 1
            else:
                np.add.at(self._readers, pages, 1)

    def _acquire_small(self, pages: list[int], write: bool, gens: list[int] | None) -> bool:
        """``acquire`` of a few pages, page by page (numpy's fancy indexing costs more than
        the whole loop at this size); False, marking nothing busy, when a page is not free to
        take: the caller's batch path then names the fault."""
        state, writer, readers = self._state, self._writer, self._readers
        for p in pages:
            if state[p] != ALLOCATED or writer[p] or (write and readers[p] > 0):
                return False
        if gens is not None:
            kind, generation = self._kind, self._generation
            for p, g in zip(pages, gens, strict=True):
                if kind[p] != RAW or generation[p] != g:
                    return False
        if write:
            if len(set(pages)) != len(pages):
                return False
            for p in pages:
                writer[p] = True
        else:
            for p in pages:
                readers[p] += 1
        return True

    def share(self, pages: np.ndarray) -> None:
        """More readers of pages already read-held (each still has a reader): allowed even
        for a page freed meanwhile, which its readers keep until the last lets go."""
        with self._lock:
            assert (self._readers[pages] > 0).all(), "share() of a page nobody reads"
            np.add.at(self._readers, pages, 1)

    def release(self, pages: np.ndarray, write: bool, unique: bool = True,
                layers: range | None = None) -> None:
        """End a copy: a writer that completed marks ``layers`` of its pages written."""
        with self._lock:
            if pages.size <= SMALL_BATCH and not self._releasing:
                written = self._written
                for p in pages.tolist():
                    if write:
                        self._writer[p] = False
                        if layers is not None:
                            written[p, layers.start:layers.stop] = True
                    else:
                        self._readers[p] -= 1
                return
            if write:
                self._writer[pages] = False
                if layers is not None:
                    self._written[pages, layers.start:layers.stop] = True
            elif unique:
                self._readers[pages] -= 1
            else:
                np.add.at(self._readers, pages, -1)
            if self._releasing:
                done = np.unique(pages[(self._state[pages] == RELEASING)
                                       & (self._readers[pages] == 0) & ~self._writer[pages]])
                if done.size:
                    self._releasing -= int(done.size)
                    self._put(done)

    # -- invariants ------------------------------------------------------------------------

    def memcheck(self) -> None:
        """Raise AssertionError when any invariant is broken (the tests call it after every
        operation): the free stack holds each free page below the limit once and nothing else,
        the pages above it are counted parked; busy pages
        have one writer or readers, never both; free pages keep no kind, owner, reader or writer;
        keyed pages have no owner; the releasing count is right."""
        with self._lock:
            n = self.page_num
            stack = self._stack[:self._nfree]
            assert stack.size == np.unique(stack).size, "a page is on the free stack twice"
            assert np.all((stack >= 0) & (stack < n)), "free stack holds a bad page id"
            assert np.all(self._state[stack] == FREE), "a free-stack page is not in FREE state"
            assert np.all(stack < self._limit), "a page above the limit is on the free stack"
            free = self._state == FREE
            parked = int(free[self._limit:].sum())
            assert parked == self._parked, "the parked count is off"
            assert int(free.sum()) == stack.size + parked, "a FREE page is not on the stack"
            assert np.all(self._readers >= 0), "negative reader count"
            assert not np.any(self._writer & (self._readers > 0)), "a page read while written"
            assert np.all(self._readers[free] == 0) and not self._writer[free].any(), \
                "a free page is held"
            assert np.all(self._kind[free] == 0) and np.all(self._owner[free] == 0), \
                "a free page keeps its kind or owner"
            assert np.all(self._kind[~free] > 0), "a live page has no kind"
            assert np.all(self._owner[self._kind == KEYED] == 0), "a keyed page has an owner"
            releasing = self._state == RELEASING
            assert np.all((self._readers[releasing] > 0) | self._writer[releasing]), \
                "a releasing page is not held"
            assert int(releasing.sum()) == self._releasing, "releasing count is off"
