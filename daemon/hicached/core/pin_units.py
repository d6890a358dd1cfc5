"""Page-locking a pool in units that follow its share of the memory budget.

A pool whose share of the budget grows and shrinks (``[budget] elastic``) on a host that
page-locks pool memory for DMA can neither lock its whole region (that memory could never be
given back) nor give back memory that is locked (the device keeps the physical pages it was
given: the process would see fresh zero pages where the GPU still reads and writes the old
ones). So its region is cut into *units*, OS-page-aligned byte ranges each locked by a
registration of its own, and the units locked are always those holding a byte of some page
below a frontier:

- a unit's *first page* is the lowest pool page any of its bytes belongs to (a page's bytes lie
  in one run per component, and per layer in a layer-first pool; a unit boundary that falls
  inside a page's bytes makes the page belong to two units);
- ``pin_below(pages)`` locks, in first-page order, every unit whose first page is below
  ``pages``: then every byte of every page below ``pages`` is locked, since each unit holding
  one of its bytes has a first page at or below it;
- ``unpin_from(pages)`` unlocks, in the reverse order, every unit whose first page is at or
  above ``pages`` and gives its memory back: each of its bytes belongs to a page at or above
  ``pages``, which the caller guarantees no copy uses (the allocator hands out pages below its
  limit only, and the limit is at or below ``pages``).

So the locked units are always a prefix of that order, and what is locked is never released.
Units are cut at each run's start and at even page steps inside each run, rounded down to OS
pages: at most ``MAX_UNITS`` per pool and about ``unit_bytes`` or more each (fewer, larger
registrations, each a driver call that locks its pages).

Primitives: ``tile(runs, page_num, nbytes, unit_bytes)`` (the units: starts, ends, first
pages, in locking order); ``PinUnits(memory, pinner, runs, page_num, unit_bytes)``:
``pin_below(pages)``, ``unpin_from(pages)``, ``frontier``, ``units``, ``seams`` (where two
units meet), ``locked`` (the bytes locked are the region's: ``HostMemory.pinned_bytes``).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Callable

import numpy as np

from hicache.errors import PinFailed
from hicache.locks import lock
from hicached.core.memory import OS_PAGE, HostMemory, Pinner

log = logging.getLogger(__name__)

MAX_UNITS = 4096
"""The most registrations one pool is cut into."""
UNIT_BYTES = 2 << 20
"""The smallest unit a run is cut into, where the run is large enough (a huge page)."""
RETRY_SECONDS = 1.0
"""After the driver refused to lock a unit, how long no other is tried."""


def tile(runs: list[tuple[int, int]], page_num: int, nbytes: int, unit_bytes: int = UNIT_BYTES,
         max_units: int = MAX_UNITS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The units of a region of ``nbytes`` whose pages' bytes lie in ``runs`` ((offset,
    length) of pages ``0 .. page_num - 1``, in order, each ``length // page_num`` bytes a
    page): (start, end, first page) arrays, in the order units are locked (first page, then
    start). A unit holding no page's byte has first page ``page_num`` (never locked)."""
    mapped = -(-nbytes // OS_PAGE) * OS_PAGE
    runs = sorted((off, length) for off, length in runs if length > 0)
    cuts = {0, mapped}
    per_run = max(max_units // max(len(runs), 1), 1)
    for off, length in runs:
        pitch = length // page_num
        splits = max(min(per_run, length // unit_bytes, page_num), 1)
        for j in range(splits):
            cuts.add((off + (j * page_num // splits) * pitch) // OS_PAGE * OS_PAGE)
    bounds = sorted(c for c in cuts if 0 <= c <= mapped)
    starts = np.asarray(bounds[:-1], dtype=np.int64)
    ends = np.asarray(bounds[1:], dtype=np.int64)
    first = np.full(starts.size, page_num, dtype=np.int64)
    run_starts = [off for off, _ in runs]
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        j = max(bisect.bisect_right(run_starts, a) - 1, 0)
        while j < len(runs) and runs[j][0] < b:
            off, length = runs[j]
            if off + length > a:
                page = (max(a, off) - off) // (length // page_num)
                first[i] = min(first[i], page)
            j += 1
    order = np.lexsort((starts, first))
    return starts[order], ends[order], first[order]


class PinUnits:
    """The locked units of one pool's region (see the module's docstring); one lock."""

    def __init__(self, memory: HostMemory, pinner: Pinner, runs: list[tuple[int, int]],
                 page_num: int, unit_bytes: int = UNIT_BYTES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._memory = memory
        self._pinner = pinner
        self._page_num = page_num
        self._starts, self._ends, self._first = tile(runs, page_num, memory.nbytes, unit_bytes)
        self._locked = 0
        """Units locked: the first ``_locked`` of the order."""
        self._refused_until = 0.0
        """After the driver refused a unit, none is tried again before this (monotonic)."""
        self._clock = clock
        self._lock = lock("pin_units")

    @property
    def units(self) -> int:
        return int(self._starts.size)

    @property
    def seams(self) -> np.ndarray:
        """Where one unit ends and the next begins (addresses, ascending): no copy may cross
        one, each unit being a registration of its own."""
        return self._memory.address + np.sort(self._starts)[1:]

    @property
    def locked(self) -> int:
        """How many units are locked now."""
        return self._locked

    @property
    def frontier(self) -> int:
        """Every byte of every page below this is locked."""
        with self._lock:
            return self._frontier()

    def _frontier(self) -> int:
        # a unit's first page is page_num at most (one holding no page's byte)
        return int(self._first[self._locked]) if self._locked < self._first.size \
            else self._page_num

    def pin_below(self, pages: int) -> bool:
        """Lock every unit holding a byte of a page below ``pages`` (their memory faulted in
        first). False where the driver refuses (the locked-memory limit): what this call
        locked is unlocked again and given back, so the frontier is where it was; for
        ``RETRY_SECONDS`` after, a call that needs another unit is refused without trying
        (a full pool's every Store would otherwise fault in memory only to give it back)."""
        with self._lock:
            before = self._locked
            if self._frontier() >= pages:
                return True
            if self._clock() < self._refused_until:
                return False
            try:
                while self._locked < self._first.size and self._first[self._locked] < pages:
                    i = self._locked
                    start, end = int(self._starts[i]), int(self._ends[i])
                    self._memory.pin_range(self._pinner, start, end - start)
                    self._locked += 1
            except PinFailed as exc:
                log.warning("page-locking a pool's memory up to page %d failed (no more is "
                            "tried for %.0f s): %s", pages, RETRY_SECONDS, exc)
                self._refused_until = self._clock() + RETRY_SECONDS
                self._unlock_down_to(before)
                return False
            return True

    def unpin_from(self, pages: int) -> int:
        """Unlock every unit whose bytes all belong to pages at or above ``pages`` (none of
        them in use by a copy: the caller's promise) and give its memory back; the bytes
        given back."""
        with self._lock:
            keep = self._locked
            while keep > 0 and self._first[keep - 1] >= pages:
                keep -= 1
            return self._unlock_down_to(keep)

    def _unlock_down_to(self, keep: int) -> int:
        unlocked = []
        while self._locked > keep:
            i = self._locked - 1
            start, end = int(self._starts[i]), int(self._ends[i])
            try:
                self._memory.unpin_range(start)
            except Exception as exc:  # it stays locked, and its memory stays too
                log.warning("unlocking %d bytes of a pool's memory failed: %s", end - start, exc)
                break
            unlocked.append((start, end - start))
            self._locked -= 1
        return self._memory.release(unlocked)  # one pass over what stays locked
