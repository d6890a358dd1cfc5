"""Promotion at Lookup time: a held hit below host memory is read up before its LoadKeys.

A Lookup that holds its hit (``session_id``, ``hold_ms``) holds at once what host memory has;
the keys of its hit prefix that only the disk or the cluster has are handed to a
``Prefetcher``, whose thread promotes them (``TierStack.promote``) and then holds them for the
session (``HeldPages.promoted``). The Lookup never waits for it; a LoadKeys that needs a
key still being promoted waits for that promotion (``PoolCache.wait_landed``). Until the
promotion ends, the disk keeps the keys it had of the hit (``DiskTier.hold``; the job's
``release`` ends that): a spill meanwhile does not evict the promise from under it. When the
hold after the promotion takes fewer keys than were promised (a Store evicted a promoted key
before it could be held, or another load's promotion landed it and it left again), the disk
keeps them until the promise's own deadline instead (``release`` runs then): the session's
LoadKeys promotes them itself, from a disk that still has them.

The queue is bounded (``MAX_QUEUED``): past it a prefetch is dropped, and the
LoadKeys promotes what it needs itself, as without holds.

Primitives: ``Prefetcher(promote, hold, name, clock)``: ``submit(keys, holder, release)``
(False when dropped: ``release`` is then the caller's to call), ``close()`` (every release
still due runs); ``done`` / ``deferred`` counts.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from hicached.cache.holds import Holder

log = logging.getLogger(__name__)

MAX_QUEUED = 64
"""Prefetches waiting for the thread; more are dropped (the load promotes for itself)."""

_Job = tuple[list[bytes], Holder, Callable[[], None]]


class Prefetcher:
    def __init__(self, promote: Callable[[Sequence[bytes]], int],
                 hold: Callable[[Holder, Sequence[bytes]], int], name: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``promote(keys)`` reads what the lower tiers hold into host memory; ``hold(holder,
        keys)`` then holds what host memory has for the session (how many leading keys it
        holds; none once the session has ended)."""
        self._promote, self._hold, self._clock = promote, hold, clock
        self._q: queue.Queue[_Job | None] = queue.Queue(MAX_QUEUED)
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        """Releases kept until a promise's deadline (a heap; the prefetch thread's own)."""
        self._seq = itertools.count()
        self.done = 0
        self.deferred = 0
        """Promotions whose keys were not all held after: their release waited for the
        promise's deadline."""
        self._thread = threading.Thread(target=self._run, name=f"prefetch-{name}",
                                        daemon=True)
        self._thread.start()

    def submit(self, keys: Sequence[bytes], holder: Holder,
               release: Callable[[], None] = lambda: None) -> bool:
        """Promote then hold ``keys`` for ``holder``; ``release`` is called once that is over
        (whatever came of it)."""
        try:
            self._q.put_nowait((list(keys), holder, release))
            return True
        except queue.Full:
            return False

    def _run(self) -> None:
        while True:
            self._release_due()
            wait = max(self._due[0][0] - self._clock(), 0.0) if self._due else None
            try:
                job = self._q.get(timeout=wait)
            except queue.Empty:
                continue
            if job is None:
                return
            keys, holder, release = job
            held = 0
            try:
                self._promote(keys)
                held = self._hold(holder, keys)
                self.done += 1
            except Exception:  # a tier that failed: the load promotes (or refuses) itself
                log.warning("prefetch of %d key(s) failed", len(keys), exc_info=True)
            finally:
                if held >= len(keys):
                    release()
                else:  # the disk keeps them for the load until the promise ends
                    self.deferred += 1
                    heapq.heappush(self._due, (self._clock() + holder.seconds,
                                               next(self._seq), release))

    def _release_due(self) -> None:
        now = self._clock()
        while self._due and self._due[0][0] <= now:
            heapq.heappop(self._due)[2]()

    def close(self) -> None:
        try:
            self._q.put(None, timeout=1)
        except queue.Full:
            pass
        self._thread.join(10)
        for *_, release in self._due:  # promises the daemon no longer keeps
            release()
        self._due.clear()
        while True:  # jobs never run: their holds below end too
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job[2]()
