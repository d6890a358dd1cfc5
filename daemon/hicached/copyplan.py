"""Copy plans: validated page lists turned into strided segments, executed at memcpy speed.

A segment is a run of consecutive pages on both sides at one layer; a page is ``units`` rows of
``unit_bytes``. Coalescing runs turns a batch of consecutive pages into a few large copies, and
the native kernel (``hicached._copykernel``) executes thousands of small segments in one call
with the GIL released and the work split over threads — what makes page_size 1..16 affordable.

Primitives:

- ``page_runs(src_pages, dst_pages)``: run starts and lengths (vectorized).
- ``Side``: one side's addressing (per-layer bases, page pitch, unit stride, bounds).
- ``CopyPlan.build(...)``: segment arrays for one component over a set of layers, bounds-checked
  against both buffers (an internal invariant: validation already guaranteed it).
- ``execute(plan, threads)``: run it with the native kernel, or a slow ctypes fallback when the
  kernel is not built (logged once).
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from types import ModuleType

import numpy as np

log = logging.getLogger(__name__)

MIN_PARALLEL_BYTES = 1 << 20


def _load_kernel() -> ModuleType | None:
    if os.environ.get("HICACHED_DISABLE_NATIVE") == "1":
        return None
    try:
        from hicached import _copykernel  # type: ignore[attr-defined]
    except ImportError:
        log.warning("native copy kernel not built; using the slow pure-Python copy path")
        return None
    return _copykernel  # type: ignore[no-any-return]


_KERNEL = _load_kernel()


def native_available() -> bool:
    return _KERNEL is not None


def page_runs(src_pages: np.ndarray, dst_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and lengths of maximal runs where both sides advance by one page."""
    n = src_pages.size
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    brk = np.flatnonzero((np.diff(src_pages) != 1) | (np.diff(dst_pages) != 1)) + 1
    starts = np.concatenate([np.zeros(1, np.int64), brk.astype(np.int64)])
    lengths = np.diff(np.concatenate([starts, np.array([n], np.int64)]))
    return starts, lengths


@dataclass(frozen=True)
class Side:
    """Addressing of one side of a copy: row (l, p, u) is at base[l] + p*pitch + u*stride."""

    layer_bases: np.ndarray
    """Base address of each layer (int64, indexed by layer)."""
    layer_limits: np.ndarray
    """One past the last valid byte of each layer's buffer (int64)."""
    page_pitch: int
    unit_stride: int


@dataclass(frozen=True)
class CopyPlan:
    dst: np.ndarray
    src: np.ndarray
    npages: np.ndarray
    unit_bytes: int
    units: int
    dst_pitch: int
    src_pitch: int
    dst_stride: int
    src_stride: int

    @property
    def nbytes(self) -> int:
        return int(self.npages.sum()) * self.units * self.unit_bytes

    @staticmethod
    def build(*, dst: Side, src: Side, dst_pages: np.ndarray, src_pages: np.ndarray,
              layers: range, unit_bytes: int, units: int) -> CopyPlan:
        starts, lengths = page_runs(src_pages, dst_pages)
        lay = np.arange(layers.start, layers.stop, dtype=np.int64)[:, None]
        d = (dst.layer_bases[lay] + dst_pages[starts][None, :] * dst.page_pitch).reshape(-1)
        s = (src.layer_bases[lay] + src_pages[starts][None, :] * src.page_pitch).reshape(-1)
        npages = np.broadcast_to(lengths, (len(layers), lengths.size)).reshape(-1)
        plan = CopyPlan(np.ascontiguousarray(d), np.ascontiguousarray(s),
                        np.ascontiguousarray(npages, dtype=np.int64), unit_bytes, units,
                        dst.page_pitch, src.page_pitch, dst.unit_stride, src.unit_stride)
        plan._check_bounds(dst, src, lay[:, 0], lengths.size)
        return plan

    def _check_bounds(self, dst: Side, src: Side, layers: np.ndarray, runs: int) -> None:
        if self.npages.size == 0:
            return
        seg_layer = np.repeat(layers, runs)
        for side, addr, pitch, stride in ((dst, self.dst, self.dst_pitch, self.dst_stride),
                                          (src, self.src, self.src_pitch, self.src_stride)):
            end = addr + (self.npages - 1) * pitch + (self.units - 1) * stride + self.unit_bytes
            lo_ok = addr >= side.layer_bases[seg_layer]
            hi_ok = end <= side.layer_limits[seg_layer]
            if not (lo_ok.all() and hi_ok.all()):
                raise AssertionError("copy plan leaves its buffer; validation missed a bad index")


def execute(plan: CopyPlan, threads: int) -> int:
    """Copy every segment; returns bytes copied."""
    if plan.npages.size == 0:
        return 0
    if _KERNEL is not None:
        return int(_KERNEL.copy_segments(
            plan.dst, plan.src, plan.npages, plan.unit_bytes, plan.units, plan.dst_pitch,
            plan.src_pitch, plan.dst_stride, plan.src_stride, threads, MIN_PARALLEL_BYTES))
    return _execute_python(plan)


def _execute_python(plan: CopyPlan) -> int:
    ub, units = plan.unit_bytes, plan.units
    page_bytes = ub * units
    rows_contig = plan.dst_stride == ub and plan.src_stride == ub
    memmove = ctypes.memmove
    for d, s, n in zip(plan.dst.tolist(), plan.src.tolist(), plan.npages.tolist(), strict=True):
        if rows_contig and plan.dst_pitch == page_bytes and plan.src_pitch == page_bytes:
            memmove(d, s, n * page_bytes)
            continue
        for i in range(n):
            dp, sp = d + i * plan.dst_pitch, s + i * plan.src_pitch
            if rows_contig:
                memmove(dp, sp, page_bytes)
            else:
                for r in range(units):
                    memmove(dp + r * plan.dst_stride, sp + r * plan.src_stride, ub)
    return plan.nbytes
