"""The copy engine: backup (device -> host pool) and load (host pool -> device).

Primitives:

- ``TransferEngine(threads)``: ``backup(...)`` and ``load(...)`` of raw pages by host indices,
  over all layers or a layer range, for every kind, layout and pool group; returns a
  ``TransferResult``; host and device batches given as ``hicache.indices.PageIds`` name page
  ids (the fast path's form, validated by ``page_batch``), anything else token indices.
  ``check_keyed`` / ``transfer_pages`` validate and copy keyed pages the cache holds. CPU
  buffers are copied by the CPU runner (``cpu.execute``); GPU buffers through the session's
  ``PlanRunner``.
- ``PlanRunner``: runs the copy plans elsewhere (``hicached.cuda.runner.CudaRunner``), either
  to completion or, for loads that signal per-layer events, asynchronously with a completion
  callback.
- ``TransferResult``: op, bytes, pages, seconds spent validating and copying, ``pending``.

Order of a transfer: check the worker buffers (cached) and the whole index batch
(``core.validation``); acquire the host pages (a backup exclusively, a load shared:
``PAGE_BUSY`` on conflict; raw pages only if still the very pages validated, by their
generation: ``PAGE_NOT_ALLOCATED`` for a page freed meanwhile); on load, verify canary
fingerprints; copy each component (``plan``); on backup, record fingerprints and mark the
layers written; release. Any rejection happens before a byte moves.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from hicache import seams
from hicache.indices import PageIds
from hicached.copy.cpu import BACKUP_STREAMING_BYTES, STREAMING_BYTES, execute
from hicached.copy.native import KERNEL
from hicached.copy.page_batch import scan, validate_keyed_pages, validate_page_transfer
from hicached.copy.plan import CopyPlan, PlanTemplate, Side
from hicached.core.pool import ComponentStorage, HostPool
from hicached.core.registrations import Registrations
from hicached.core.system import default_copy_threads
from hicached.core.validation import (
    IndexArray,
    TransferBatch,
    validate_keyed,
    validate_transfer,
)
from hicached.core.worker_buffers import WorkerBuffers


class Op(enum.Enum):
    BACKUP = "backup"
    LOAD = "load"


@dataclass(frozen=True)
class TransferResult:
    op: Op
    bytes: int
    pages: int
    validate_seconds: float
    copy_seconds: float
    pending: bool = False
    """The copies were enqueued on a GPU and are still running (per-layer event loads)."""

    @property
    def seconds(self) -> float:
        return self.validate_seconds + self.copy_seconds


class PlanRunner(Protocol):
    def run(self, loading: bool, plans: Sequence[CopyPlan], layers: range, layer_num: int,
            wait: bool, done: Callable[[], None], registrations: Registrations) -> None:
        """Run ``plans`` and call ``done`` once the bytes landed: before returning when
        ``wait``, otherwise later from another thread. When it raises, ``done`` never runs and
        nothing is left in flight. ``registrations``: the host pool's (the driver refuses a
        copy whose host side spans two page-locked registrations)."""
        ...


def host_side(cs: ComponentStorage) -> Side:
    """The copy planner's view of one host component."""
    a = cs.addressing
    return Side(layer_bases=cs.layer_bases, layer_limits=cs.layer_limits,
                page_pitch=a.page_pitch, unit_stride=a.unit_stride)


class TransferEngine:
    def __init__(self, threads: int = 0, spin_us: int = 0) -> None:
        """``threads`` per copy (0: ``default_copy_threads``); ``spin_us``: how long copy
        threads spin after a job before sleeping (0: they sleep at once; spinning saves a
        wake-up on the next copy and takes a CPU meanwhile). The spin is the process's."""
        self.threads = default_copy_threads(threads)
        if KERNEL is not None:
            KERNEL.set_copy_spin(spin_us * 1000)

    def backup(self, pool: HostPool, buffers: WorkerBuffers, host_indices: object,
               device_indices: object, layer_begin: int = 0, layer_end: int = 0,
               runner: PlanRunner | None = None) -> TransferResult:
        """Copy device pages into host pages (all layers unless a range is given). Always
        complete when it returns: an acknowledged backup is in the pool. Both batches
        ``PageIds``, or both token indices."""
        return self._transfer(Op.BACKUP, pool, buffers, host_indices, device_indices,
                              layer_begin, layer_end, runner, True, None)

    def load(self, pool: HostPool, buffers: WorkerBuffers, host_indices: object,
             device_indices: object, layer_begin: int = 0, layer_end: int = 0,
             runner: PlanRunner | None = None, wait: bool = True,
             on_complete: Callable[[], None] | None = None) -> TransferResult:
        """Copy host pages into device pages (all layers unless a range is given). With a
        runner and ``wait=False`` it may return ``pending``; ``on_complete`` then runs once the
        bytes landed (and never for a result that is not pending). Batches as ``backup``."""
        return self._transfer(Op.LOAD, pool, buffers, host_indices, device_indices,
                              layer_begin, layer_end, runner, wait, on_complete)

    def check_keyed(self, op: Op, pool: HostPool, buffers: WorkerBuffers, keys: int,
                    device_indices: object, layer_begin: int = 0, layer_end: int = 0
                    ) -> tuple[IndexArray, range]:
        """Validate the worker side of a Store (``BACKUP``) or LoadKeys (``LOAD``) of ``keys``
        keys before the cache commits to anything; returns (device pages, layers).
        ``device_indices``: token indices, or ``PageIds``."""
        pool._check_open()
        device_tokens = buffers.check_against(pool.spec)
        if isinstance(device_indices, PageIds):
            return validate_keyed_pages(
                keys=keys, device_pages=device_indices.ids,
                device_page_num=device_tokens // pool.page_size,
                layer_num=pool.spec.max_layers, layer_begin=layer_begin, layer_end=layer_end,
                writes_host=op is Op.BACKUP)
        return validate_keyed(
            keys=keys, device_indices=device_indices, page_size=pool.page_size,
            device_tokens=device_tokens, layer_num=pool.spec.max_layers,
            layer_begin=layer_begin, layer_end=layer_end, writes_host=op is Op.BACKUP)

    def transfer_pages(self, op: Op, pool: HostPool, buffers: WorkerBuffers,
                       host_pages: IndexArray, device_pages: IndexArray, layers: range,
                       runner: PlanRunner | None = None, wait: bool = True,
                       on_complete: Callable[[], None] | None = None) -> TransferResult:
        """Copy whole keyed pages the caller holds (the cache acquired them: written for a
        store, read for a load) to or from device pages ``check_keyed`` accepted, pairwise.
        The caller releases the pages after the call returns, or from ``on_complete`` when the
        result is ``pending``."""
        t0 = time.perf_counter()
        # one native pass each: the extremes, and whether a load reads a page twice
        found, host_bounds = scan(host_pages, pool.page_num, "host_pages", op is Op.LOAD)
        device_bounds = scan(device_pages, 1 << 62, "device_pages", False)[1]
        batch = TransferBatch(host_pages, device_pages, layers, not found,
                              bounds=(host_bounds, device_bounds))
        return self._run(op, pool, buffers, batch, t0, runner, wait, on_complete, hold=False)

    def _transfer(self, op: Op, pool: HostPool, buffers: WorkerBuffers, host_indices: object,
                  device_indices: object, layer_begin: int, layer_end: int,
                  runner: PlanRunner | None, wait: bool,
                  on_complete: Callable[[], None] | None) -> TransferResult:
        t0 = time.perf_counter()
        pool._check_open()
        device_tokens = buffers.check_against(pool.spec)
        if isinstance(host_indices, PageIds) or isinstance(device_indices, PageIds):
            assert isinstance(host_indices, PageIds) and isinstance(device_indices, PageIds), \
                "page ids on one side, token indices on the other"
            batch = validate_page_transfer(
                host_pages=host_indices.ids, device_pages=device_indices.ids,
                allocator=pool.allocator,
                device_page_num=device_tokens // pool.page_size,
                layer_num=pool.spec.max_layers, layer_begin=layer_begin, layer_end=layer_end,
                writes_host=op is Op.BACKUP)
            return self._run(op, pool, buffers, batch, t0, runner, wait, on_complete, hold=True)
        batch = validate_transfer(
            host_indices=host_indices, device_indices=device_indices,
            page_size=pool.page_size, host_tokens=pool.size_tokens, device_tokens=device_tokens,
            layer_num=pool.spec.max_layers, layer_begin=layer_begin, layer_end=layer_end,
            writes_host=op is Op.BACKUP, raw_state=pool.allocator.raw_state,
        )
        return self._run(op, pool, buffers, batch, t0, runner, wait, on_complete, hold=True)

    def _run(self, op: Op, pool: HostPool, buffers: WorkerBuffers, batch: TransferBatch,
             t0: float, runner: PlanRunner | None, wait: bool,
             on_complete: Callable[[], None] | None, hold: bool) -> TransferResult:
        """Plan, (``hold``: acquire the host pages,) verify the canary, copy, record it,
        (release). Anything raised leaves nothing held and nothing in flight."""
        assert (runner is None) == (buffers.location == "cpu"), "GPU buffers need a runner"
        bounds = batch.page_bounds()
        pool.begin_copy()  # POOL_CLOSED once closing; the memory stays mapped until end_copy
        try:
            plans = [self._plan(op, pool, buffers, cs, batch, bounds) for cs in pool.components]
            canary, allocator, writes = pool.canary, pool.allocator, op is Op.BACKUP
            if hold:  # raw pages: held only if still the pages validated (generations)
                seams.reached("raw.checked")
                allocator.acquire(batch.host_pages, writes, batch.host_unique,
                                  batch.generations)
        except BaseException:
            pool.end_copy()
            raise
        t1 = time.perf_counter()

        def release(completed: bool) -> None:
            try:
                if hold:
                    allocator.release(batch.host_pages, writes, batch.host_unique,
                                      layers=batch.layers if completed else None)
            finally:
                pool.end_copy()

        def landed() -> None:
            try:
                if writes and canary is not None and batch.num_pages:
                    canary.record(batch.host_pages, batch.layers,
                                  pool.fingerprints(batch.host_pages, batch.layers))
            finally:
                release(True)

        blocking = runner is None or wait or writes

        def done() -> None:
            try:
                landed()
            finally:
                if not blocking and on_complete is not None:
                    on_complete()

        try:
            if not writes and canary is not None and batch.num_pages:
                canary.verify(batch.host_pages, batch.layers,
                              pool.fingerprints(batch.host_pages, batch.layers))
            if runner is None:
                streaming = BACKUP_STREAMING_BYTES if writes else STREAMING_BYTES
                nbytes = sum(execute(p, self.threads, streaming) for p in plans)
            else:
                nbytes = sum(p.nbytes for p in plans)
                runner.run(not writes, plans, batch.layers, pool.spec.max_layers, blocking,
                           done, pool.registrations)
        except BaseException:
            release(False)
            raise
        if runner is None:
            landed()
        t2 = time.perf_counter()
        return TransferResult(op, nbytes, batch.num_pages, t1 - t0, t2 - t1, not blocking)

    def _plan(self, op: Op, pool: HostPool, buffers: WorkerBuffers, cs: ComponentStorage,
              batch: TransferBatch, bounds: tuple[tuple[int, int], tuple[int, int]]
              ) -> CopyPlan:
        key = (id(cs), op, batch.layers.start, batch.layers.stop)
        cached = buffers.plan_cache.get(key)
        if cached is None or cached[0] is not cs:
            if len(buffers.plan_cache) > 256:
                buffers.plan_cache.clear()
            cached = buffers.plan_cache[key] = (cs, self._template(op, pool, buffers, cs,
                                                                   batch.layers))
        template: PlanTemplate = cached[1]
        if op is Op.BACKUP:
            return template.plan(batch.host_pages, batch.device_pages, bounds)
        return template.plan(batch.device_pages, batch.host_pages, (bounds[1], bounds[0]))

    @staticmethod
    def _template(op: Op, pool: HostPool, buffers: WorkerBuffers, cs: ComponentStorage,
                  layers: range) -> PlanTemplate:
        """What every plan of this component, direction and layer range shares."""
        ub = cs.comp.unit_bytes
        units = cs.comp.units_per_page(pool.page_size)
        starts, ends = buffers.extents(cs.member, cs.comp.role)
        dev = Side(layer_bases=starts, layer_limits=ends, page_pitch=units * ub, unit_stride=ub)
        host, clipped = host_side(cs), cs.clip(layers)
        if op is Op.BACKUP:
            return PlanTemplate.make(dst=host, src=dev, layers=clipped, unit_bytes=ub,
                                     units=units)
        return PlanTemplate.make(dst=dev, src=host, layers=clipped, unit_bytes=ub, units=units)
