"""Running copy plans on a GPU: the per-session runner and the thread that completes loads.

Primitives:

- ``CudaRunner``: the ``PlanRunner`` the copy engine calls for a session on a GPU: waits for
  the worker's ready event, enqueues every plan on the backup or load stream (``segments``),
  records the worker's per-layer events (loads, by ``hicache.layer_groups``), then either
  synchronizes or hands completion to the ``Completer``.
- ``Completer``: one thread that waits for enqueued work to finish, then runs its callback
  (releasing busy host pages, letting a session release its mappings).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hicache import layer_groups
from hicache.cuda_driver import CudaCallFailed, CudaDriver
from hicache.errors import CudaFailure
from hicached.copy.plan import CopyPlan
from hicached.core.registrations import Registrations
from hicached.cuda.segments import Segments, plan_segments, split_at, submit

log = logging.getLogger(__name__)


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
        return layer_groups.group_of(layer, layer_num, len(self.layer_events))

    def run(self, loading: bool, plans: Sequence[CopyPlan], layers: range, layer_num: int,
            wait: bool, done: Callable[[], None], registrations: Registrations) -> None:
        """Enqueue ``plans`` (their layers start at ``layers.start``); ``done`` runs here after
        a stream synchronize when ``wait``, else on the completer thread. No copy's host side
        spans two of the host pool's ``registrations`` (``segments.split_at``)."""
        stream = self.load_stream if loading else self.backup_stream
        segs = [split_at(plan_segments(p), registrations, not loading) for p in plans]
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
