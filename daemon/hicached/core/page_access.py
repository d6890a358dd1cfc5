"""Who may touch a host page now: one writer or any number of readers, never both.

``PageAccess`` is the part of ``allocator.PageAllocator`` that copies go through; the allocator
inherits it and shares its lock and tables with it.

- ``acquire(pages, write, unique, generations)``: hold pages for a copy that writes
  (exclusive) or reads (shared). A conflicting request is refused with ``PAGE_BUSY`` (nothing
  is waited for, nothing moves); a page that is no longer allocated, or (with
  ``generations``, a raw copy's) no longer the raw page of that generation, with
  ``PAGE_NOT_ALLOCATED``.
- ``share(pages)``: more readers of pages already read (allowed for a page freed meanwhile).
- ``release(pages, write, unique, layers)``: end a copy; a writer that completed marks the
  layers written. A page freed while held returns to the free stack when its last holder lets
  go, so a copy in flight never touches a page handed to someone else.
"""

from __future__ import annotations

import threading

import numpy as np

from hicache.errors import PageBusy, PageNotAllocated

ALLOCATED = 1
RELEASING = 2
"""Page states (0 is free): freed while held by a copy, a page returns to the free stack
when its last holder lets go."""
RAW = 1
"""Kind of a page handed out by ``alloc``: named by host indices."""
SMALL_BATCH = 16
"""Holds of up to this many pages are taken and given back page by page."""


class PageAccess:
    # the allocator's, which sets them
    page_size: int
    _lock: threading.Lock
    _state: np.ndarray
    _kind: np.ndarray
    _generation: np.ndarray
    _written: np.ndarray
    _readers: np.ndarray
    _writer: np.ndarray
    _releasing: int

    def _put(self, pages: np.ndarray) -> None:
        raise NotImplementedError

    def acquire(self, pages: np.ndarray, write: bool, unique: bool = True,
                generations: np.ndarray | None = None) -> None:
        """Hold ``pages`` for a copy that writes (exclusive) or reads (shared). They must be
        allocated (a concurrent free may have released one since validation, so it is checked
        again here) and, with ``generations`` (a raw copy's, from ``raw_state``), still the
        raw pages of those generations; no conflicting copy may hold them: else
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
        the whole loop at this size); False, holding nothing, when a page is not free to
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

