"""Page allocator of a host pool: whole pages out, whole pages back, nothing lost or doubled.

Primitives:

- ``PageAllocator(page_num, page_size)``: a FIFO free list of page ids (like SGLang's host
  allocator) plus per-page state, pin counts and allocation generations.
- ``alloc(num_tokens)``: page-aligned token indices of fresh pages, or ``POOL_EXHAUSTED``.
- ``free(indices)``: returns pages and their page numbers; double free, never-allocated pages
  and partial pages are errors, found for the whole batch before anything changes.
- ``pin(pages)`` / ``unpin(pages)``: reference counts; a pinned page that is freed is released
  only when its last pin drops, so a copy in flight never reads a page handed to someone else.
- ``memcheck()``: verifies every invariant (the tests call it after every operation).

Thread-safe: every public method holds the allocator's lock. Work is vectorized with numpy.
"""

from __future__ import annotations

import threading

import numpy as np

from hicache.errors import (
    AllocSizeNotPageAligned,
    DoubleFree,
    PageNotAllocated,
    PoolExhausted,
    Violation,
    raise_violations,
)
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
"""Freed by its owner while pinned: returns to the free list when the last pin drops."""


class PageAllocator:
    def __init__(self, page_num: int, page_size: int) -> None:
        assert page_num >= 0 and page_size >= 1
        self.page_num = page_num
        self.page_size = page_size
        self._lock = threading.Lock()
        self._free = np.arange(page_num, dtype=np.int64)
        self._free_head = 0
        self._state = np.zeros(page_num, dtype=np.int8)
        self._pins = np.zeros(page_num, dtype=np.int32)
        self._generation = np.zeros(page_num, dtype=np.uint32)
        self._releasing = 0
        self.alloc_failures = 0

    # -- queries ---------------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        with self._lock:
            return len(self._free) - self._free_head

    @property
    def used_pages(self) -> int:
        return self.page_num - self.free_pages

    def is_allocated(self, pages: np.ndarray) -> np.ndarray:
        """Boolean mask: which of ``pages`` (in range) are currently allocated to an owner."""
        with self._lock:
            return np.asarray(self._state[pages] == ALLOCATED, dtype=bool)

    def generation(self, pages: np.ndarray) -> np.ndarray:
        with self._lock:
            return np.array(self._generation[pages], dtype=np.uint32)

    # -- mutations -------------------------------------------------------------------------

    def alloc(self, num_tokens: int) -> np.ndarray:
        """Token indices of ``num_tokens // page_size`` fresh pages (each page a full run)."""
        ps = self.page_size
        if num_tokens < 0 or num_tokens % ps:
            up = -(-max(num_tokens, 0) // ps) * ps
            raise AllocSizeNotPageAligned(
                f"cannot allocate {num_tokens} tokens: not a non-negative multiple of "
                f"page_size {ps}; ask for {up}",
                metadata={"num_tokens": num_tokens, "page_size": ps, "aligned_size": up},
            )
        need = num_tokens // ps
        with self._lock:
            have = len(self._free) - self._free_head
            if need > have:
                self.alloc_failures += 1
                raise PoolExhausted(
                    f"pool has {have} free pages, {need} requested",
                    metadata={"requested_pages": need, "free_pages": have,
                              "page_num": self.page_num, "page_size": ps},
                )
            pages = self._free[self._free_head:self._free_head + need].copy()
            self._free_head += need
            if self._free_head > len(self._free) // 2 and self._free_head > 4096:
                self._free = self._free[self._free_head:].copy()
                self._free_head = 0
            self._state[pages] = ALLOCATED
            self._generation[pages] += 1
        return (pages[:, None] * ps + np.arange(ps, dtype=np.int64)).reshape(-1)

    def free(self, indices: object, *, field: str = "host_indices") -> np.ndarray:
        """Return the pages of ``indices`` (whole page runs); returns their page numbers."""
        idx = to_index_array(indices, field)
        pages = self._pages_of(idx, field)
        with self._lock:
            state = self._state[pages]
            bad = np.flatnonzero(state != ALLOCATED)
            if bad.size:
                pos = int(bad[0])
                page = int(pages[pos])
                ever = bool(self._generation[page] > 0)
                cls_reason = DoubleFree.reason if ever else PageNotAllocated.reason
                raise_violations([Violation(
                    field, cls_reason,
                    f"{bad.size} page(s) are not allocated; first is page {page} "
                    f"(token {page * self.page_size}) at page position {pos}"
                    + (" (already freed)" if ever else " (never allocated)"),
                    {"page": page, "position": pos * self.page_size, "count": int(bad.size)},
                )])
            pinned = self._pins[pages] > 0
            self._state[pages[pinned]] = RELEASING
            self._releasing += int(pinned.sum())
            released = pages[~pinned]
            self._state[released] = FREE
            self._push_free(released)
        return pages

    def pin(self, pages: np.ndarray, unique: bool = False) -> None:
        """Take a reference on ``pages``; all must be allocated (a concurrent free may have
        released one since validation, so this is checked again under the lock)."""
        with self._lock:
            bad = np.flatnonzero(self._state[pages] != ALLOCATED)
            if bad.size:
                page = int(pages[bad[0]])
                raise PageNotAllocated(
                    f"{bad.size} page(s) were freed before the transfer started; first {page}",
                    metadata={"page": page, "count": int(bad.size)},
                )
            if unique:
                self._pins[pages] += 1
            else:
                np.add.at(self._pins, pages, 1)

    def unpin(self, pages: np.ndarray, unique: bool = False) -> None:
        with self._lock:
            if unique:
                self._pins[pages] -= 1
            else:
                np.add.at(self._pins, pages, -1)
            if not self._releasing:
                return
            done = np.unique(pages[(self._pins[pages] == 0) & (self._state[pages] == RELEASING)])
            if done.size:
                self._state[done] = FREE
                self._releasing -= int(done.size)
                self._push_free(done)

    def _push_free(self, pages: np.ndarray) -> None:
        if pages.size:
            self._free = np.concatenate([self._free[self._free_head:], pages])
            self._free_head = 0

    def _pages_of(self, idx: IndexArray, field: str) -> np.ndarray:
        ps = self.page_size
        violations = check_page_runs(idx, ps, field) + check_range(idx, self.page_num * ps, field)
        pages = page_numbers(idx, ps)
        if not violations:
            violations = check_duplicate_pages(pages, ps, field)
        raise_violations(violations)
        return pages

    # -- invariants ------------------------------------------------------------------------

    def memcheck(self) -> None:
        """Raise AssertionError when any invariant is broken."""
        with self._lock:
            free = self._free[self._free_head:]
            assert free.size == np.unique(free).size, "a page is on the free list twice"
            assert np.all((free >= 0) & (free < self.page_num)), "free list holds a bad page id"
            assert np.all(self._state[free] == FREE), "a listed free page is not in FREE state"
            assert int((self._state == FREE).sum()) == free.size, "a FREE page is not listed"
            assert np.all(self._pins >= 0), "negative pin count"
            assert np.all(self._pins[self._state == FREE] == 0), "a free page is pinned"
            releasing = self._state == RELEASING
            assert np.all(self._pins[releasing] > 0), "a releasing page has no pins"
            assert int(releasing.sum()) == self._releasing, "releasing count is off"
