"""Copy plans: validated page lists turned into strided page copies of one component.

A page is ``units`` rows of ``unit_bytes`` at one layer of one component. A plan says, for a
set of layers, which pages go where; a runner moves them (``cpu`` on host memory, the CUDA
runner on a GPU).

Primitives:

- ``Side``: one side's addressing (per-layer bases, page pitch, unit stride, bounds).
- ``CopyPlan``: one component over a set of layers.
- ``PlanTemplate``: a plan in two steps: ``make`` (what is fixed for a session's buffers, a
  component and a layer range; engines cache it) and ``plan(pages)``, its extreme pages
  checked against both buffers (an internal invariant: validation already guaranteed it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
    """Copy page ``dst_pages[i]`` <- ``src_pages[i]`` at each layer of one component."""

    dst_base: np.ndarray
    src_base: np.ndarray
    dst_pages: np.ndarray
    src_pages: np.ndarray
    unit_bytes: int
    units: int
    dst_pitch: int
    src_pitch: int
    dst_stride: int
    src_stride: int
    layer_inner: bool = False
    """Walk row by row across layers (a source that interleaves layers per row is then read
    sequentially); otherwise layer by layer, coalescing page runs."""

    @property
    def nbytes(self) -> int:
        return self.dst_base.size * self.dst_pages.size * self.units * self.unit_bytes


@dataclass(frozen=True)
class PlanTemplate:
    """What a plan of one component, one direction and one layer range always has: made once
    per session (``make``), it turns page lists into plans with a few integer checks."""

    dst_base: np.ndarray
    src_base: np.ndarray
    unit_bytes: int
    units: int
    dst_pitch: int
    src_pitch: int
    dst_stride: int
    src_stride: int
    layer_inner: bool
    dst_room: int
    """Bytes every layer's destination buffer has from its base (the smallest of them)."""
    src_room: int
    empty: bool
    """No layer in range."""

    @staticmethod
    def make(*, dst: Side, src: Side, layers: range, unit_bytes: int, units: int
             ) -> PlanTemplate:
        sl = slice(layers.start, layers.stop)
        # reading a source that interleaves layers per row (a page_first host) row by row
        # across layers streams it; writes scattered to many layers are cheap with streaming
        # stores, scattered reads are not (measured: page_first load 0.56 -> 0.92 of memcpy)
        interleaved = (src.layer_bases.size > 1
                       and int(src.layer_bases[1] - src.layer_bases[0]) == unit_bytes)
        empty = len(layers) == 0
        rooms = [0 if empty else int((side.layer_limits[sl] - side.layer_bases[sl]).min())
                 for side in (dst, src)]
        return PlanTemplate(dst.layer_bases[sl], src.layer_bases[sl], unit_bytes, units,
                            dst.page_pitch, src.page_pitch, dst.unit_stride, src.unit_stride,
                            interleaved and len(layers) > 1, rooms[0], rooms[1], empty)

    def plan(self, dst_pages: np.ndarray, src_pages: np.ndarray,
             page_bounds: tuple[tuple[int, int], tuple[int, int]] | None = None) -> CopyPlan:
        """The plan of these pages; the extreme pages checked against both buffers."""
        if dst_pages.size and not self.empty:
            if page_bounds is None:
                page_bounds = ((int(dst_pages.min()), int(dst_pages.max())),
                               (int(src_pages.min()), int(src_pages.max())))
            tail = (self.units - 1) * self.dst_stride + self.unit_bytes
            (dlo, dhi), (slo, shi) = page_bounds
            if (dlo < 0 or slo < 0 or dhi * self.dst_pitch + tail > self.dst_room
                    or shi * self.src_pitch + (self.units - 1) * self.src_stride
                    + self.unit_bytes > self.src_room):
                raise AssertionError("copy plan leaves its buffer; validation missed a bad index")
        return CopyPlan(self.dst_base, self.src_base, dst_pages, src_pages, self.unit_bytes,
                        self.units, self.dst_pitch, self.src_pitch, self.dst_stride,
                        self.src_stride, layer_inner=self.layer_inner)
