"""The CUDA copy path: copy plans as batches of 1-D / 2-D async copies on a session's streams.

A plan's pages become as few driver copies as the layouts allow, computed with vectorized numpy
(never a Python loop over pages): runs of pages consecutive on both sides coalesce; a run whose
rows sit at a fixed pitch on both sides (a ``page_first`` host page of one layer) is one 2-D copy
instead of one copy per row. The native module submits the batch in one call (GIL released);
without it a ctypes loop does the same, slower.

Primitives:

- ``Segments``: copies (dst, src, dst pitch, src pitch, width, height), layer-major, with the
  number per layer.
- ``plan_segments(plan)``: the segments of one ``CopyPlan``.
- ``submit(driver, stream, segments)``: enqueue them; a driver error is ``CudaCallFailed``.
- ``CudaRunner``: the per-session runner the transfer engine calls for a session on a GPU:
  waits for the worker's ready event, enqueues every plan on the backup or load stream, records
  the worker's per-layer events (loads), then either synchronizes or hands completion to the
  ``Completer`` thread.
- ``Completer``: one thread that waits for enqueued work to finish, then runs its callback
  (unpinning host pages, letting a session release its mappings).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from hicached.copyplan import CopyPlan
from hicached.cudadriver import CudaCallFailed, CudaDriver
from hicached.errors import CudaFailure

log = logging.getLogger(__name__)

MAX_PITCH = (1 << 31) - 1
"""Pitches above this go row by row (CUDA's 2-D copies cap the pitch)."""


def _load_native() -> ModuleType | None:
    try:
        from hicached import _copykernel  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _copykernel if hasattr(_copykernel, "cuda_submit") else None  # type: ignore[no-any-return]


_NATIVE = _load_native()


@dataclass(frozen=True)
class Segments:
    dst: np.ndarray
    src: np.ndarray
    dpitch: np.ndarray
    spitch: np.ndarray
    width: np.ndarray
    height: np.ndarray
    per_layer: int
    """Segments of each layer (every layer of a plan has the same number)."""
    layers: int

    @property
    def count(self) -> int:
        return int(self.dst.size)

    @property
    def nbytes(self) -> int:
        return int((self.width * self.height).sum())

    def layer(self, i: int) -> Segments:
        sl = slice(i * self.per_layer, (i + 1) * self.per_layer)
        return Segments(self.dst[sl], self.src[sl], self.dpitch[sl], self.spitch[sl],
                        self.width[sl], self.height[sl], self.per_layer, 1)

    @staticmethod
    def concat(parts: Sequence[Segments]) -> Segments:
        parts = [p for p in parts if p.count]
        if not parts:
            z = np.zeros(0, dtype=np.int64)
            return Segments(z, z, z, z, z, z, 0, 0)
        d, s, dp, sp, w, h = (np.concatenate([getattr(p, f) for p in parts])
                              for f in ("dst", "src", "dpitch", "spitch", "width", "height"))
        return Segments(d, s, dp, sp, w, h, per_layer=int(d.size), layers=1)


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
                    np.tile(height, nl), per_layer=per, layers=nl)


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


def layer_group_size(layer_num: int, events: int) -> int:
    """Layers per event: event g covers layers [g * size, (g + 1) * size). The daemon records
    by it and workers wait by it, so both sides import this one rule."""
    return -(-layer_num // events)


def native_available() -> bool:
    return _NATIVE is not None


def submit(driver: CudaDriver, stream: int, segs: Segments, use_native: bool = True) -> None:
    """Enqueue every segment on ``stream`` (the caller holds the device's context)."""
    if segs.count == 0:
        return
    arrays = [np.ascontiguousarray(a, dtype=np.int64)
              for a in (segs.dst, segs.src, segs.dpitch, segs.spitch, segs.width, segs.height)]
    if use_native and _NATIVE is not None:
        done, rc = _NATIVE.cuda_submit(driver.fn_address("cuMemcpyAsync"),
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


class Completer:
    """Waits, in order, for enqueued GPU work and then runs its callback."""

    def __init__(self, driver: CudaDriver) -> None:
        self._driver = driver
        self._q: queue.Queue[tuple[int, int, Callable[[], None]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="cuda-completer", daemon=True)
        self._thread.start()

    def add(self, ordinal: int, event: int, callback: Callable[[], None]) -> None:
        """``event`` (owned by the completer from now on) was recorded after the work."""
        self._q.put((ordinal, event, callback))

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            ordinal, event, callback = item
            try:
                with self._driver.context(ordinal):
                    try:
                        self._driver.event_synchronize(event)
                    finally:
                        self._driver.event_destroy(event)
            except Exception:
                log.exception("waiting for a GPU transfer failed")
            try:
                callback()
            except Exception:
                log.exception("a transfer completion callback failed")

    def close(self) -> None:
        """Finish everything queued, then stop."""
        self._q.put(None)
        self._thread.join(timeout=60)


@dataclass
class CudaRunner:
    """Runs copy plans for one session on its device."""

    driver: CudaDriver
    ordinal: int
    backup_stream: int
    load_stream: int
    completer: Completer
    layer_events: Sequence[int] = ()
    """Imported worker events, recorded after each layer group of a load."""
    ready_event: int = 0
    """Imported worker event the daemon's streams wait on before each copy (0 = none)."""

    def group_of(self, layer: int, layer_num: int) -> int:
        return layer // layer_group_size(layer_num, len(self.layer_events))

    def run(self, loading: bool, plans: Sequence[CopyPlan], layers: range, layer_num: int,
            wait: bool, done: Callable[[], None]) -> None:
        """Enqueue ``plans`` (their layers start at ``layers.start``); ``done`` runs here after
        a stream synchronize when ``wait``, else on the completer thread."""
        stream = self.load_stream if loading else self.backup_stream
        segs = [plan_segments(p) for p in plans]
        try:
            with self.driver.context(self.ordinal):
                if self.ready_event:
                    self.driver.stream_wait_event(stream, self.ready_event)
                if loading and self.layer_events:
                    self._by_layer(stream, segs, layers, layer_num)
                else:
                    submit(self.driver, stream, Segments.concat(segs))
                if wait:
                    self.driver.stream_synchronize(stream)
                else:
                    # the completer sleeps on it rather than spinning a core per load
                    event = self.driver.event_create(blocking=True)
                    self.driver.event_record(event, stream)
        except CudaCallFailed as exc:
            self._drain(stream)
            raise CudaFailure(f"GPU copy failed: {exc}",
                              metadata={"call": exc.call, "cuda_error": exc.name}) from None
        if wait:
            done()
        else:
            self.completer.add(self.ordinal, event, done)

    def _by_layer(self, stream: int, segs: list[Segments], layers: range,
                  layer_num: int) -> None:
        for i, layer in enumerate(layers):
            submit(self.driver, stream,
                   Segments.concat([s.layer(i) for s in segs if i < s.layers]))
            g = self.group_of(layer, layer_num)
            if layer == layers.stop - 1 or self.group_of(layer + 1, layer_num) != g:
                self.driver.event_record(self.layer_events[g], stream)

    def _drain(self, stream: int) -> None:
        try:
            with self.driver.context(self.ordinal):
                self.driver.stream_synchronize(stream)
        except CudaCallFailed:
            log.exception("GPU stream did not drain after a failed copy")
