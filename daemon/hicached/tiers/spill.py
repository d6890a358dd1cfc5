"""Writing a pool's oldest keys to its lower tier before host memory has to evict them.

Eviction must never wait on a disk, so the tier is filled ahead of it: a ``Spiller`` thread
per pool keeps the ``window`` least recently used ready keys written below, taking them in
small batches with their pages busy for reading (an eviction meanwhile takes the key out of
host memory, but the page is not reused until the write is done). Eviction then drops a key
whose page is below already or on its way (it stays found, tier 2), or,
when stores outrun the disk and the window was not written in time, drops it for good and
counts it (``CacheStats.spill_dropped``): a bounded queue that overflows by dropping, never by
blocking a store. A key removed while its page is being written below is not committed there
(``Lending.removed_since``, asked at the commit): a removed key never comes back.

Primitives:

- ``Spiller(pool, cache, tier, window, batch)``: over any ``SpillTarget`` (the disk, or the
  cluster store), a ``writer.TierWriter`` (backed off while the tier fails); ``start()``,
  ``nudge()`` (new keys were stored), ``close()``; ``spilled`` counts.
- ``promote(pool, cache, tier, keys)``: the way back up: keys only the tier holds are read
  into fresh host pages (checksums checked) and become ready there; returns how many. A read
  that fails drops that key below and promotes none of the batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from hicache import seams
from hicached.cache.pool_cache import PoolCache
from hicached.core.pool import HostPool
from hicached.tiers.disk import DiskTier
from hicached.tiers.writer import IDLE, STOP, WROTE, Failed, Outcome, TierWriter

log = logging.getLogger(__name__)


class SpillTarget(Protocol):
    """A tier a ``Spiller`` writes to: the disk, or the cluster store (``evict`` policy).
    ``write_many`` keeps a key only if ``still_wanted(key)`` holds when it commits it (the
    disk: asked under its lock; the cluster: the put is undone otherwise); ``pages`` name the
    pages the views are of. ``errors`` counts the writes that failed with an error of the
    tier (not a refusal), ``last_error`` says the latest."""

    last_error: str

    @property
    def errors(self) -> int: ...

    def contains(self, key: bytes) -> bool: ...

    def write_many(self, items: Sequence[tuple[bytes, Sequence[memoryview]]],
                   still_wanted: Callable[[bytes], bool] | None = None,
                   pages: Sequence[int] = ()) -> list[bool]: ...


class Spiller(TierWriter):
    def __init__(self, pool: HostPool, cache: PoolCache, tier: SpillTarget, window: int,
                 batch: int = 16, tier_name: str = "disk") -> None:
        super().__init__(pool.spec.name, tier_name)
        self.pool, self.cache, self.tier = pool, cache, tier
        self.window, self.batch = window, batch
        self.spilled = 0

    def _batch(self) -> Outcome | Failed:
        try:
            keys, pages, epoch = self.cache.lending.spill_candidates(self.batch, self.window,
                                                             self.tier.contains)
        except Exception:  # the pool closed under us
            log.debug("spill of pool %s stopped", self.pool.spec.name, exc_info=True)
            return STOP
        if not keys:
            return IDLE
        errors = self.tier.errors
        try:
            done = self.tier.write_many(
                [(k, self.pool.page_views(p)) for k, p in zip(keys, pages.tolist(),
                                                             strict=True)],
                self.cache.lending.still_wanted(epoch), pages.tolist())
        finally:
            self.cache.lending.finish_spill(keys, pages, epoch)
        self.spilled += sum(done)
        if any(done):
            return WROTE
        if self.tier.errors > errors:
            return Failed(self.tier.last_error or "every write of a batch failed")
        return IDLE  # no room below for now (every slot being read), or keys removed


def promote(pool: HostPool, cache: PoolCache, tier: DiskTier, keys: Sequence[bytes]) -> int:
    below = [k for k in cache.lending.not_ready(keys) if tier.contains(k)]
    if not below:
        return 0
    ticket = cache.begin_store(below, "promotion")  # present or in flight elsewhere: left alone
    ticket.chain = False
    ok = False
    try:
        ok = all(tier.read_many([
            (ticket.keys[i], pool.page_views(page))
            for i, page in zip(ticket.positions.tolist(), ticket.pages.tolist(), strict=True)]))
        seams.reached("promote.read")
    finally:
        cache.finish_store(ticket, ok)
    return int(ticket.pages.size) if ok else 0

