"""Write-through to the cluster tier: every stored key put shortly after its Store, and put
again while the store fails, until the key is too old to be worth it.

A ``ClusterWriter`` (a ``writer.TierWriter``: backed off while the store fails) keeps a queue
of keys to put; its thread takes a batch, borrows the pages of those still in host memory
(read-held, with the epoch that lets a removal meanwhile undo the put), puts them and gives
the pages back. A key the store did not take goes back to the end of the queue and is tried
again, with the writer's back-off between failed batches, until ``retry_seconds`` after its
first try: an outage shorter than that (a peer's segment that the master has not yet dropped,
a master restart) loses nothing. A key is not put (``dropped``, logged rate-limited) when it
left host memory before its turn, when the queue was full (``max_keys``), or when it was
still failing ``retry_seconds`` after its first try.

Primitives: ``ClusterWriter(cache, tier, max_keys, batch, retry_seconds)``: ``offer(keys)``
(after a Store), ``waiting``, ``put`` / ``dropped`` counts, and the writer's
``start`` / ``nudge`` / ``close`` / ``failing``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from hicache.locks import lock
from hicache.log_limit import LimitedLog
from hicached.cache.pool_cache import PoolCache
from hicached.tiers.cluster import ClusterTier
from hicached.tiers.writer import IDLE, STOP, WROTE, Failed, Outcome, TierWriter

log = logging.getLogger(__name__)
_limited = LimitedLog(log, 30.0)

PUT_RETRY_SECONDS = 30.0
"""How long a key the store does not take is tried again (about three of Mooncake's default
``client_ttl`` of 10 s: the time the master keeps placing puts on a dead node's segment)."""


class ClusterWriter(TierWriter):
    def __init__(self, cache: PoolCache, tier: ClusterTier, max_keys: int, batch: int = 16,
                 retry_seconds: float = PUT_RETRY_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(cache.pool.spec.name, "cluster")
        self.cache, self.tier = cache, tier
        self.max_keys, self.batch, self.retry_seconds = max_keys, batch, retry_seconds
        self._clock = clock
        self.put = 0
        self.dropped = 0
        self._queue: deque[tuple[bytes, float]] = deque()
        """(key, when it was first tried; 0: not yet)."""
        self._lock = lock("tier.cluster_writer")

    def offer(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            room = max(self.max_keys - len(self._queue), 0)
            take = [k for k in keys if not self.tier.written(k)]
            self._queue.extend((k, 0.0) for k in take[:room])
            full = max(len(take) - room, 0)
            self.dropped += full
        if full:
            _limited.warning("pool %s: %d stored key(s) not put to the cluster tier: %d are "
                             "waiting (queue_bytes)", self.pool_name, full, self.max_keys,
                             key=f"full {self.pool_name}")
        self.nudge()

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._queue)

    def _take(self) -> list[tuple[bytes, float]]:
        with self._lock:
            n = min(self.batch, len(self._queue))
            return [self._queue.popleft() for _ in range(n)]

    def _batch(self) -> Outcome | Failed:
        items = self._take()
        if not items:
            return IDLE
        now = self._clock()
        first = {k: t or now for k, t in items}
        try:
            held, pages, epoch = self.cache.lending.borrow(list(first))
        except Exception:  # the pool closed under us
            log.debug("cluster writer of %s stopped", self.pool_name, exc_info=True)
            return STOP
        self.dropped += len(first) - len(held)  # evicted or removed before their turn
        try:
            ok = (self.tier.put_pages(held, pages, self.cache.lending.still_wanted(epoch))
                  if held else [])
        finally:
            self.cache.lending.give_back(pages, epoch)
        self.put += sum(ok)
        failed = [k for k, done in zip(held, ok, strict=True) if not done]
        again = [k for k in failed if now - first[k] < self.retry_seconds]
        if len(again) < len(failed):
            gone = len(failed) - len(again)
            self.dropped += gone
            _limited.warning("pool %s: %d key(s) dropped from the cluster tier's queue after "
                             "%.0f s of failed puts (%s)", self.pool_name, gone,
                             self.retry_seconds, self.tier.last_error,
                             key=f"dropped {self.pool_name}")
        if again:
            with self._lock:  # behind what waits: one failing key does not starve the rest
                self._queue.extend((k, first[k]) for k in again)
        if failed and not any(ok):
            return Failed(self.tier.last_error or "every put of a batch failed")
        return WROTE
