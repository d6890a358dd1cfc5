"""Running copy plans on a GPU: the per-session runner and the thread that completes loads.

Primitives:

- ``DeviceCopies``: what one device offers a batch: the DMA path always, ``cuMemcpyBatchAsync``
  where the driver has it, the page kernel where it loaded (``kernels``), and the rates the
  ways measured there (``paths.CopyPaths``); shared by the device's sessions.
- ``CudaRunner``: the ``PlanRunner`` the copy engine calls for a session on a GPU: waits for
  the worker's ready event, enqueues a batch on the backup or load stream by the way its
  device's ``CopyPaths`` chooses, records the worker's per-layer events after each layer
  group of a load (``hicache.layer_groups``: each group's copies are enqueued, or launched,
  before its event), then either synchronizes or hands completion to the ``Completer``.
  Where ways compete, or the kernel runs, two timed events around the batch measure it.
- ``Completer``: one thread that waits for enqueued work to finish, then runs its callback
  (releasing busy host pages, letting a session release its mappings).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from hicache import layer_groups
from hicache.cuda_driver import CudaCallFailed, CudaDriver
from hicache.errors import CudaFailure
from hicache.locks import lock
from hicached.copy.plan import CopyPlan
from hicached.core.registrations import Registrations
from hicached.cuda.launch import PageKernel, TableRing, build_table, fragments
from hicached.cuda.paths import CopyPaths, Path
from hicached.cuda.segments import Segments, plan_segments, split_at, submit

log = logging.getLogger(__name__)

TABLE_SLOTS = 2
"""Launch tables a session's runner has in flight at most (a slot waits for its launches)."""
TABLE_SLOT_BYTES = 256 << 10
"""One launch table's most bytes: a batch of about 16,000 pages of two components; a larger
one takes another way."""


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
class DeviceCopies:
    """The ways one device moves a batch, and what they measured."""

    paths: CopyPaths = field(default_factory=lambda: CopyPaths((Path.DMA,)))
    kernel: PageKernel | None = None
    batch: bool = False
    """The driver has ``cuMemcpyBatchAsync``."""

    @property
    def usable(self) -> tuple[Path, ...]:
        return (Path.DMA, *((Path.BATCH,) if self.batch else ()),
                *((Path.KERNEL,) if self.kernel is not None else ()))

    @property
    def measured(self) -> bool:
        """Whether batches are timed: more than one allowed way is usable here (the choice
        reads the rates), or the kernel is (its rate is the SM time it takes from the
        engine's own kernels, a metric)."""
        ways = [p for p in self.paths.allowed if p in self.usable]
        return len(ways) > 1 or Path.KERNEL in ways


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
    device: DeviceCopies = field(default_factory=DeviceCopies)
    _tables: dict[int, TableRing] = field(default_factory=dict)
    """A table ring per stream, made on the stream's first kernel batch."""
    _tables_lock: threading.Lock = field(default_factory=lambda: lock("cuda.runner.tables"))

    def group_of(self, layer: int, layer_num: int) -> int:
        return layer_groups.group_of(layer, layer_num, len(self.layer_events))

    def run(self, loading: bool, plans: Sequence[CopyPlan], layers: range, layer_num: int,
            wait: bool, done: Callable[[], None], registrations: Registrations) -> None:
        """Enqueue ``plans`` (their layers start at ``layers.start``); ``done`` runs here after
        a stream synchronize when ``wait``, else on the completer thread. No DMA copy's host
        side spans two of the host pool's ``registrations`` (``segments.split_at``)."""
        stream = self.load_stream if loading else self.backup_stream
        plans = [p for p in plans if p.dst_pages.size and p.dst_base.size]
        fragment = plans[0].unit_bytes * plans[0].units if plans else 0
        path = self.device.paths.choose(loading, fragment, self.device.usable)
        table = build_table(plans) if path is Path.KERNEL and plans else None
        if table is not None and table.nbytes > TABLE_SLOT_BYTES:
            path, table = Path.DMA, None
        groups = self._groups(loading, plans, layers, layer_num)
        timed = self.device.measured and bool(plans)
        start = end = event = 0
        try:
            with self.driver.context(self.ordinal):
                if self.ready_event:
                    self.driver.stream_wait_event(stream, self.ready_event)
                if timed:
                    start = self.driver.event_create(timed=True)
                    end = self.driver.event_create(timed=True, blocking=True)
                    self.driver.event_record(start, stream)
                if table is not None:
                    self._launch(stream, table, groups)
                else:
                    segs = [split_at(plan_segments(p), registrations, not loading)
                            for p in plans]
                    self._enqueue(stream, segs, groups, path is Path.BATCH)
                if timed:
                    self.driver.event_record(end, stream)
                if wait:
                    self.driver.stream_synchronize(stream)
                else:
                    # the completer sleeps on it rather than spinning a core per load
                    event = self.driver.event_create(blocking=True)
                    self.driver.event_record(event, stream)
        except CudaCallFailed as exc:
            self._drain(stream)
            self._destroy(start, end)
            raise CudaFailure(f"GPU copy failed: {exc}",
                              metadata={"call": exc.call, "cuda_error": exc.name,
                                        "path": path.value}) from None
        nbytes = sum(p.nbytes for p in plans)
        self.device.paths.count(path, loading, nbytes)

        def landed() -> None:
            try:
                if timed:
                    self._measure(path, loading, fragment, nbytes, start, end)
            finally:  # a failed measurement never keeps the batch from completing
                done()

        if wait:
            landed()
        else:
            self.completer.add(self.ordinal, event, landed)

    def _groups(self, loading: bool, plans: Sequence[CopyPlan], layers: range,
                layer_num: int) -> list[tuple[int, int, int]]:
        """(first, last + 1 (relative to ``layers.start``), the event to record after them or
        -1): one group, or a load's layer groups where it signals per-layer events."""
        count = max((int(p.dst_base.size) for p in plans), default=0)
        if not (loading and self.layer_events):
            return [(0, count, -1)]
        out: list[tuple[int, int, int]] = []
        lo = 0
        for i, layer in enumerate(layers):
            g = self.group_of(layer, layer_num)
            if layer == layers.stop - 1 or self.group_of(layer + 1, layer_num) != g:
                out.append((lo, i + 1, g))
                lo = i + 1
        return out

    def _record(self, stream: int, event: int) -> None:
        if event >= 0:
            self.driver.event_record(self.layer_events[event], stream)

    def _enqueue(self, stream: int, segs: list[Segments],
                 groups: list[tuple[int, int, int]], batched: bool) -> None:
        for lo, hi, event in groups:
            part = Segments.concat([s.layer(i) for i in range(lo, hi) for s in segs
                                    if i < s.layers])
            if batched:
                self._batch(stream, part)
            else:
                submit(self.driver, stream, part)
            self._record(stream, event)

    def _batch(self, stream: int, segs: Segments) -> None:
        """Every copy of ``segs`` (its 2-D copies as their rows) in one batch call."""
        if not segs.count:
            return
        rep = segs.height
        first = np.repeat(np.cumsum(rep) - rep, rep)
        r = np.arange(int(rep.sum()), dtype=np.int64) - first
        dst = np.ascontiguousarray(np.repeat(segs.dst, rep) + r * np.repeat(segs.dpitch, rep),
                                   dtype=np.uint64)
        src = np.ascontiguousarray(np.repeat(segs.src, rep) + r * np.repeat(segs.spitch, rep),
                                   dtype=np.uint64)
        size = np.ascontiguousarray(np.repeat(segs.width, rep), dtype=np.uint64)
        self.driver.memcpy_batch_async(dst.ctypes.data, src.ctypes.data, size.ctypes.data,
                                       int(dst.size), stream)

    def _launch(self, stream: int, table: np.ndarray,
                groups: list[tuple[int, int, int]]) -> None:
        kernel = self.device.kernel
        assert kernel is not None
        with self._tables_lock:  # a session's calls may run at once (a retry beside the
            ring = self._tables.get(stream)  # call it gave up on): one ring per stream
            if ring is None:
                ring = self._tables[stream] = TableRing(self.driver, TABLE_SLOTS,
                                                        TABLE_SLOT_BYTES)
        slot, address = ring.put(table)
        try:
            for lo, hi, event in groups:
                kernel.launch(stream, address, lo, hi, fragments(table, lo, hi))
                self._record(stream, event)
        finally:
            ring.done(slot, stream)

    def _measure(self, path: Path, loading: bool, fragment: int, nbytes: int, start: int,
                 end: int) -> None:
        try:
            with self.driver.context(self.ordinal):
                self.driver.event_synchronize(end)
                ms = self.driver.event_elapsed_ms(start, end)
            self.device.paths.record(path, loading, fragment, nbytes, ms / 1e3)
        except Exception:
            log.exception("timing a GPU copy failed")
        finally:
            self._destroy(start, end)

    def _destroy(self, *events: int) -> None:
        for e in events:
            if e:
                try:
                    with self.driver.context(self.ordinal):
                        self.driver.event_destroy(e)
                except CudaCallFailed:
                    log.exception("destroying a timing event failed")

    def _drain(self, stream: int) -> None:
        try:
            with self.driver.context(self.ordinal):
                self.driver.stream_synchronize(stream)
        except CudaCallFailed:
            log.exception("GPU stream did not drain after a failed copy")

    def close(self) -> None:
        """Once the session's streams have drained: the launch tables' memory goes."""
        with self._tables_lock:
            rings, self._tables = list(self._tables.values()), {}
        with self.driver.context(self.ordinal):
            for ring in rings:
                ring.close()
