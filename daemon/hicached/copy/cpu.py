"""The CPU runner: copy plans executed on host memory at memcpy speed.

The native kernel copies every (layer, page) of a plan in one call, with the GIL released and
the work split over threads, coalescing runs of pages consecutive on both sides into single
copies; per-page Python overhead would otherwise dominate page_size 1..16.

Primitives:

- ``execute(plan, threads, streaming_bytes)``: run a plan with the native kernel, or a slow
  ctypes fallback with the same algorithm when the kernel is not built (``native.KERNEL`` is
  None; tests set it so).
  The kernel copies under a SIGBUS guard: memory that vanished under the copy (a worker's
  truncated shm file) raises ``BUFFER_FAULT`` instead of killing the process; the fallback
  has no such guard.
- ``MIN_PARALLEL_BYTES`` / ``STREAMING_BYTES`` / ``BACKUP_STREAMING_BYTES``: when the kernel
  goes parallel and when it uses non-temporal stores (into device buffers; into the pool).
"""

from __future__ import annotations

import ctypes

from hicache.errors import BufferFault
from hicached.copy import native
from hicached.copy.plan import CopyPlan

MIN_PARALLEL_BYTES = 1 << 20
"""Smaller plans run on the calling thread alone."""
STREAMING_BYTES = 32 << 20
"""Plans at least this large use non-temporal stores (they would only flush the caches)."""
BACKUP_STREAMING_BYTES = 256 << 10
"""The same for copies into the pool (Store, Backup): nothing reads a pool page again until a
later load, so past a core's share of L2 its lines would only evict the caller's, and the
read-for-ownership of every destination line is a third of the memory traffic saved. A 2 MiB
copy into the pool took 92-114 us so against 154-184 us with ``memcpy`` (a 64-page Store of
64 KiB pages on the 2-vCPU development VM; benchmarks/RESULTS.md)."""


def execute(plan: CopyPlan, threads: int, streaming_bytes: int = STREAMING_BYTES) -> int:
    """Copy every page at every layer, with non-temporal stores when the plan is at least
    ``streaming_bytes``; returns bytes copied."""
    if plan.dst_pages.size == 0 or plan.dst_base.size == 0:
        return 0
    kernel = native.KERNEL
    if kernel is not None:
        try:
            return int(kernel.copy_pages(
                plan.dst_base, plan.src_base, plan.dst_pages, plan.src_pages, plan.unit_bytes,
                plan.units, plan.dst_pitch, plan.src_pitch, plan.dst_stride, plan.src_stride,
                threads, MIN_PARALLEL_BYTES, streaming_bytes, plan.layer_inner))
        except kernel.BufferFault as exc:
            raise BufferFault(str(exc)) from None
    return _execute_python(plan)


def _execute_python(plan: CopyPlan) -> int:
    """The kernel's algorithm in Python (one memmove per run, page or row): slow, exact."""
    ub, units = plan.unit_bytes, plan.units
    page_bytes = ub * units
    rows_contig = plan.dst_stride == ub and plan.src_stride == ub
    whole_runs = rows_contig and plan.dst_pitch == page_bytes and plan.src_pitch == page_bytes
    dpages, spages = plan.dst_pages.tolist(), plan.src_pages.tolist()
    memmove = ctypes.memmove
    for dbase, sbase in zip(plan.dst_base.tolist(), plan.src_base.tolist(), strict=True):
        i = 0
        while i < len(dpages):
            end = i + 1
            while (end < len(dpages) and dpages[end] == dpages[end - 1] + 1
                   and spages[end] == spages[end - 1] + 1):
                end += 1
            d = dbase + dpages[i] * plan.dst_pitch
            s = sbase + spages[i] * plan.src_pitch
            if whole_runs:
                memmove(d, s, (end - i) * page_bytes)
            else:
                for k in range(end - i):
                    dp, sp = d + k * plan.dst_pitch, s + k * plan.src_pitch
                    if rows_contig:
                        memmove(dp, sp, page_bytes)
                    else:
                        for r in range(units):
                            memmove(dp + r * plan.dst_stride, sp + r * plan.src_stride, ub)
            i = end
    return plan.nbytes
