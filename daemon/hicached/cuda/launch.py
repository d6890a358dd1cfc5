"""The page kernel's side of a copy: a batch's plans as one launch table, and its launches.

``pages.cu`` (the kernel) reads a table of int64 words in page-locked host memory mapped into
the device: a header, one descriptor per plan (its per-layer bases, its page lists, its
geometry) and the arrays they point at (as word offsets into the table, so the table is the
same at any address). A launch moves layers ``[lo, hi)`` of every plan: a whole batch in one
launch, or one launch per layer group where a load signals per-layer events.

Primitives:

- ``build_table(plans)``: the table of a batch's ``CopyPlan``s (int64 words); every plan names
  the same number of pages (a batch's pages are the same for each component); equal page
  lists are stored once.
- ``fragments(table, lo, hi)``: the fragments (a page of a plan at a layer) a launch over
  ``[lo, hi)`` covers, what its grid is sized by.
- ``TableRing(driver, slots, slot_bytes)``: page-locked, mapped slots for tables, each taken
  from ``put`` to ``done`` and written again only once the launches that read it are done
  (an event recorded after them); ``put(table)`` -> (slot, the device address of the
  table's copy), ``done(slot, stream)``; safe for overlapping calls.
- ``PageKernel(driver, ordinal, function)``: ``launch(stream, table_address, lo, hi,
  fragments)``: the grid and block the kernel runs with, one driver call.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hicache.cuda_driver import DEV_ATTR_MULTIPROCESSOR_COUNT, CudaDriver
from hicache.locks import condition
from hicached.copy.plan import CopyPlan

MAGIC = 0x3150434843
"""``HC_TABLE_MAGIC`` of pages.cu ("HCP1")."""
HEADER_WORDS = 4
PLAN_WORDS = 12
BLOCK = 128
"""Threads per block: a 2 KiB fragment (one token of 8 heads x 128 bf16) is one 16-byte
chunk per thread."""
BLOCKS_PER_SM = 4


def build_table(plans: Sequence[CopyPlan]) -> np.ndarray:
    """The launch table of ``plans`` (see the module's docstring and pages.cu)."""
    if not plans:
        raise ValueError("a launch table needs a plan")
    pages = int(plans[0].dst_pages.size)
    if any(int(p.dst_pages.size) != pages or int(p.src_pages.size) != pages for p in plans):
        raise ValueError("every plan of a launch names the same number of pages")
    arrays: list[np.ndarray] = []
    offsets: list[int] = []
    at = HEADER_WORDS + PLAN_WORDS * len(plans)

    def place(a: np.ndarray) -> int:
        nonlocal at
        for prior, off in zip(arrays, offsets, strict=True):
            if prior.size == a.size and (prior is a or np.array_equal(prior, a)):
                return off
        arrays.append(a)
        offsets.append(at)
        at += int(a.size)
        return offsets[-1]

    descriptors = []
    for p in plans:
        descriptors.append([
            place(p.dst_base), place(p.src_base), place(p.dst_pages), place(p.src_pages),
            int(p.dst_base.size), p.unit_bytes, p.units, p.dst_pitch, p.src_pitch,
            p.dst_stride, p.src_stride, 0])
    table = np.empty(at, dtype=np.int64)
    table[:HEADER_WORDS] = (MAGIC, len(plans), pages, 0)
    table[HEADER_WORDS:HEADER_WORDS + PLAN_WORDS * len(plans)] = np.asarray(
        descriptors, dtype=np.int64).ravel()
    for a, off in zip(arrays, offsets, strict=True):
        table[off:off + a.size] = a
    return table


def fragments(table: np.ndarray, lo: int, hi: int) -> int:
    """Fragments a launch over layers ``[lo, hi)`` covers (those of plans with fewer layers
    included: the kernel skips them)."""
    return max(hi - lo, 0) * int(table[1]) * int(table[2])


class TableRing:
    """Page-locked, mapped memory for launch tables: ``slots`` slots of ``slot_bytes``. A slot
    is taken by ``put`` and stays taken until ``done`` has recorded the event after the
    launches that read it; it is written again only once that event has completed. Several
    threads may use one ring (a session's calls can overlap): one lock, and a ``put`` that
    finds every slot taken waits for one."""

    def __init__(self, driver: CudaDriver, slots: int, slot_bytes: int) -> None:
        self._driver = driver
        self.slot_bytes = slot_bytes
        self._host = driver.host_alloc(slots * slot_bytes)
        self._device = driver.host_device_pointer(self._host)
        self._events = [driver.event_create() for _ in range(slots)]
        self._recorded = [False] * slots
        """An event was recorded after the slot's last launches (wait for it to reuse)."""
        self._taken = [False] * slots
        """Between ``put`` and ``done``: no other batch may have it."""
        self._next = 0
        self._cond = condition("cuda.launch")

    def fits(self, table: np.ndarray) -> bool:
        return table.nbytes <= self.slot_bytes

    def put(self, table: np.ndarray) -> tuple[int, int]:
        """(slot, the device address of ``table``'s copy in it); the caller records
        ``done(slot, stream)`` after the last launch that reads it."""
        if not self.fits(table):
            raise ValueError(f"a {table.nbytes}-byte table exceeds the {self.slot_bytes}-byte "
                             "slot")
        n = len(self._events)
        with self._cond:
            while all(self._taken):
                self._cond.wait()
            slot = next(i % n for i in range(self._next, self._next + n)
                        if not self._taken[i % n])
            self._next = (slot + 1) % n
            self._taken[slot] = True
            wait = self._recorded[slot]
        try:
            if wait:  # its last launches read it until this completes (usually long done)
                self._driver.event_synchronize(self._events[slot])
            ctypes.memmove(self._host + slot * self.slot_bytes, table.ctypes.data,
                           table.nbytes)
        except BaseException:  # not handed out: free again, as it was
            with self._cond:
                self._taken[slot] = False
                self._cond.notify()
            raise
        return slot, self._device + slot * self.slot_bytes

    def done(self, slot: int, stream: int) -> None:
        try:
            self._driver.event_record(self._events[slot], stream)
            recorded = True
        except Exception:  # no event to wait for: the slot is free once the stream is
            recorded = False
            try:
                self._driver.stream_synchronize(stream)
            except Exception:  # a failed stream reads nothing more
                pass
            raise
        finally:
            with self._cond:
                self._recorded[slot] = recorded
                self._taken[slot] = False
                self._cond.notify()

    def close(self) -> None:
        """Once every stream that read the tables has drained."""
        for e in self._events:
            self._driver.event_destroy(e)
        self._driver.host_free(self._host)


@dataclass
class PageKernel:
    """``hicache_copy_pages`` loaded on one device."""

    driver: CudaDriver
    ordinal: int
    function: int
    sms: int = 0

    def __post_init__(self) -> None:
        if not self.sms:
            self.sms = self.driver.attribute(DEV_ATTR_MULTIPROCESSOR_COUNT, self.ordinal)

    def grid(self, count: int) -> int:
        """Blocks for ``count`` fragments: one each, at most a few per SM (the rest taken
        grid-stride)."""
        return max(1, min(count, self.sms * BLOCKS_PER_SM))

    def launch(self, stream: int, table_address: int, lo: int, hi: int, count: int) -> None:
        """Layers ``[lo, hi)`` of the table at ``table_address`` (``count`` fragments); the
        caller holds the device's context."""
        if count <= 0:
            return
        args = (ctypes.c_uint64(table_address), ctypes.c_int64(lo), ctypes.c_int64(hi))
        params = (ctypes.c_void_p * 3)(*(ctypes.cast(ctypes.byref(a), ctypes.c_void_p)
                                         for a in args))
        self.driver.launch(self.function, self.grid(count), BLOCK, stream, params)
