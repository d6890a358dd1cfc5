"""CUDA copies of a plan: the fewest 1-D / 2-D async copies, submitted in one native call.

A plan's pages become as few driver copies as the layouts allow, computed with vectorized numpy
(never a Python loop over pages): runs of pages consecutive on both sides coalesce; a run whose
rows sit at a fixed pitch on both sides (a ``page_first`` host page of one layer) is one 2-D copy
instead of one copy per row. The native module submits the batch in one call (GIL released);
without it a ctypes loop does the same, slower.

The driver refuses a copy whose host side spans two page-locked registrations, or locked and
unlocked memory (``CUDA_ERROR_INVALID_VALUE``), and a pool is locked in several (1 GiB chunks,
or the units an elastic pool's locked part follows its share by): ``split_at`` cuts each copy
that crosses a place where one registration may end and the next begin.

Primitives:

- ``Segments``: copies (dst, src, dst pitch, src pitch, width, height), layer-major, with
  where each layer's copies end.
- ``plan_segments(plan)``: the segments of one ``CopyPlan``.
- ``split_at(segments, registrations, host_is_dst)``: the same copies, none whose host side
  spans two registrations.
- ``submit(driver, stream, segments)``: enqueue them; a driver error is ``CudaCallFailed``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hicache.cuda_driver import CudaCallFailed, CudaDriver
from hicached.copy import native
from hicached.copy.plan import CopyPlan
from hicached.core.registrations import Registrations

MAX_PITCH = (1 << 31) - 1
"""Pitches above this go row by row (CUDA's 2-D copies cap the pitch)."""


@dataclass(frozen=True)
class Segments:
    dst: np.ndarray
    src: np.ndarray
    dpitch: np.ndarray
    spitch: np.ndarray
    width: np.ndarray
    height: np.ndarray
    layer_ends: np.ndarray
    """One past each layer's last segment (int64, one entry per layer, ascending)."""

    @property
    def count(self) -> int:
        return int(self.dst.size)

    @property
    def layers(self) -> int:
        return int(self.layer_ends.size)

    @property
    def nbytes(self) -> int:
        return int((self.width * self.height).sum())

    def layer(self, i: int) -> Segments:
        lo, hi = (int(self.layer_ends[i - 1]) if i else 0), int(self.layer_ends[i])
        sl = slice(lo, hi)
        return Segments(self.dst[sl], self.src[sl], self.dpitch[sl], self.spitch[sl],
                        self.width[sl], self.height[sl], np.asarray([hi - lo], np.int64))

    @staticmethod
    def concat(parts: Sequence[Segments]) -> Segments:
        parts = [p for p in parts if p.count]
        if not parts:
            z = np.zeros(0, dtype=np.int64)
            return Segments(z, z, z, z, z, z, z)
        d, s, dp, sp, w, h = (np.concatenate([getattr(p, f) for p in parts])
                              for f in _FIELDS)
        return Segments(d, s, dp, sp, w, h, np.asarray([d.size], np.int64))


_FIELDS = ("dst", "src", "dpitch", "spitch", "width", "height")


def plan_segments(plan: CopyPlan) -> Segments:
    """The fewest 1-D/2-D copies that move ``plan`` (layer-major)."""
    d, s = plan.dst_pages.astype(np.int64), plan.src_pages.astype(np.int64)
    ub, units = plan.unit_bytes, plan.units
    page_bytes = ub * units
    if d.size == 0 or plan.dst_base.size == 0:
        return Segments.concat([])
    brk = np.flatnonzero((np.diff(d) != 1) | (np.diff(s) != 1)) + 1
    starts = np.concatenate(([0], brk)).astype(np.int64)
    lens = np.diff(np.concatenate((starts, [d.size]))).astype(np.int64)
    rows_d, rows_s = plan.dst_stride == ub, plan.src_stride == ub
    regular = (plan.dst_pitch == units * plan.dst_stride
               and plan.src_pitch == units * plan.src_stride)
    if regular and rows_d and rows_s:
        # runs are contiguous on both sides: one 1-D copy per run
        doff, soff = d[starts] * plan.dst_pitch, s[starts] * plan.src_pitch
        width, height = lens * page_bytes, np.ones_like(lens)
        dp = sp = width
    elif regular:
        # a run is lens * units rows at fixed strides on both sides: one 2-D copy
        doff, soff = d[starts] * plan.dst_pitch, s[starts] * plan.src_pitch
        width, height = np.full_like(lens, ub), lens * units
        dp, sp = np.full_like(lens, plan.dst_stride), np.full_like(lens, plan.src_stride)
    elif rows_d and rows_s:
        # pages contiguous but a page pitch apart: one 2-D copy per run, a page per row
        doff, soff = d[starts] * plan.dst_pitch, s[starts] * plan.src_pitch
        width, height = np.full_like(lens, page_bytes), lens
        dp, sp = np.full_like(lens, plan.dst_pitch), np.full_like(lens, plan.src_pitch)
    else:
        # strided rows and irregular pages: one 2-D copy per page
        doff, soff = d * plan.dst_pitch, s * plan.src_pitch
        width, height = np.full_like(d, ub), np.full_like(d, units)
        dp, sp = np.full_like(d, plan.dst_stride), np.full_like(d, plan.src_stride)
    if height.max() > 1 and max(int(dp.max()), int(sp.max())) > MAX_PITCH:
        doff, soff, width, dp, sp, height = _rows(doff, soff, width, dp, sp, height)
    nl, per = plan.dst_base.size, doff.size
    dst = (plan.dst_base.astype(np.int64)[:, None] + doff[None, :]).ravel()
    src = (plan.src_base.astype(np.int64)[:, None] + soff[None, :]).ravel()
    return Segments(dst, src, np.tile(dp, nl), np.tile(sp, nl), np.tile(width, nl),
                    np.tile(height, nl), np.arange(1, nl + 1, dtype=np.int64) * per)


def _rows(doff: np.ndarray, soff: np.ndarray, width: np.ndarray, dp: np.ndarray,
          sp: np.ndarray, height: np.ndarray) -> tuple[np.ndarray, ...]:
    """Every 2-D copy as ``height`` 1-D copies."""
    rep = height
    first = np.repeat(np.cumsum(rep) - rep, rep)
    r = np.arange(int(rep.sum()), dtype=np.int64) - first
    d = np.repeat(doff, rep) + r * np.repeat(dp, rep)
    s = np.repeat(soff, rep) + r * np.repeat(sp, rep)
    w = np.repeat(width, rep)
    return d, s, w, w.copy(), w.copy(), np.ones_like(w)


def split_at(segs: Segments, regs: Registrations, host_is_dst: bool) -> Segments:
    """``segs`` with each copy whose host side (``dst`` when ``host_is_dst``, else ``src``)
    spans two of ``regs``' registrations cut at their seams, in the same order: a 1-D copy in
    pieces (vectorized), a 2-D copy's rows grouped by the registration they lie in, a row that
    spans two as a 1-D copy cut the same way. Copies within one registration stay as they
    are."""
    if not regs or segs.count == 0:
        return segs
    host, hpitch = (segs.dst, segs.dpitch) if host_is_dst else (segs.src, segs.spitch)
    first = regs.index(host)
    last = regs.index(host + (segs.height - 1) * hpitch + segs.width - 1)
    crossing = first != last
    if not crossing.any():
        return segs
    flat = np.flatnonzero(crossing & (segs.height == 1))
    rows = np.flatnonzero(crossing & (segs.height > 1))
    counts = np.ones(segs.count, dtype=np.int64)
    counts[flat] = last[flat] - first[flat] + 1
    two_d = [_cut_rows([int(getattr(segs, f)[i]) for f in _FIELDS], regs, host_is_dst)
             for i in rows.tolist()]
    for i, pieces in zip(rows.tolist(), two_d, strict=True):
        counts[i] = pieces[0].size
    ends = np.cumsum(counts)
    at = ends - counts  # where each copy's first piece goes
    cols = [getattr(segs, f) for f in _FIELDS]
    out = [np.empty(int(ends[-1]), dtype=np.int64) for _ in _FIELDS]
    keep = np.flatnonzero(~crossing)
    for o, c in zip(out, cols, strict=True):
        o[at[keep]] = c[keep]
    if flat.size:  # piece j of copy i runs from seam first+j-1 (or its start) to the next
        n = counts[flat]
        which = np.repeat(np.arange(flat.size), n)
        j = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        idx = flat[which]
        seam = first[idx] + j
        lo = np.where(j == 0, 0, regs.seams[np.maximum(seam - 1, 0)] - host[idx])
        hi = np.where(j == n[which] - 1, segs.width[idx],
                      regs.seams[np.minimum(seam, regs.seams.size - 1)] - host[idx])
        pos = at[idx] + j
        out[0][pos], out[1][pos] = segs.dst[idx] + lo, segs.src[idx] + lo
        out[2][pos] = out[3][pos] = out[4][pos] = hi - lo
        out[5][pos] = 1
    for i, pieces in zip(rows.tolist(), two_d, strict=True):
        for o, piece in zip(out, pieces, strict=True):
            o[at[i]:at[i] + piece.size] = piece
    d, s, dp, sp, w, h = out
    cut = Segments(d, s, dp, sp, w, h, np.concatenate(([0], ends))[segs.layer_ends])
    # rows of 2-D copies that span a seam came out as 1-D copies: cut them like the others
    return split_at(cut, regs, host_is_dst) if rows.size else cut


def _cut_rows(copy: list[int], regs: Registrations, host_is_dst: bool
              ) -> tuple[np.ndarray, ...]:
    """One 2-D copy (dst, src, dst pitch, src pitch, width, height) as runs of rows each
    within one registration, and each row that spans two as a 1-D copy (``split_at``)."""
    dst, src, dpitch, spitch, width, height = copy
    rows = np.arange(height, dtype=np.int64)
    start = (dst + rows * dpitch) if host_is_dst else (src + rows * spitch)
    first = regs.index(start)
    end = regs.index(start + width - 1)
    # a run of whole rows in one registration is one piece; a row spanning two is its own
    key = np.where(first == end, first, -1 - rows)
    starts = np.concatenate(([0], np.flatnonzero(np.diff(key)) + 1)).tolist()
    stops = [*starts[1:], height]
    pieces: list[tuple[int, int, int, int, int, int]] = []
    for r0, r1 in zip(starts, stops, strict=True):
        d0, s0 = dst + r0 * dpitch, src + r0 * spitch
        if first[r0] == end[r0]:
            pieces.append((d0, s0, dpitch, spitch, width, r1 - r0))
        else:
            pieces.append((d0, s0, width, width, width, 1))
    return tuple(np.asarray(col, dtype=np.int64) for col in zip(*pieces, strict=True))


def submit(driver: CudaDriver, stream: int, segs: Segments, use_native: bool = True) -> None:
    """Enqueue every segment on ``stream`` (the caller holds the device's context)."""
    if segs.count == 0:
        return
    arrays = [np.ascontiguousarray(a, dtype=np.int64)
              for a in (segs.dst, segs.src, segs.dpitch, segs.spitch, segs.width, segs.height)]
    kernel = native.KERNEL
    if use_native and kernel is not None:
        done, rc = kernel.cuda_submit(driver.fn_address("cuMemcpyAsync"),
                                       driver.fn_address("cuMemcpy2DAsync"), stream, *arrays)
        if rc != 0:
            call = "cuMemcpyAsync" if int(arrays[5][done]) == 1 else "cuMemcpy2DAsync"
            raise CudaCallFailed(call, int(rc), driver.error_name(int(rc)))
        return
    dst, src, dp, sp, w, h = (a.tolist() for a in arrays)
    for i in range(len(dst)):
        if h[i] == 1:
            driver.memcpy_async(dst[i], src[i], w[i], stream)
        else:
            driver.memcpy_2d_async(dst[i], dp[i], src[i], sp[i], w[i], h[i], stream)
