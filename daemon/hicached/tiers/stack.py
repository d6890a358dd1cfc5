"""The tiers below one pool's host memory, as the daemon's keyed calls see them.

Host memory (tier 1), the node's disk (tier 2, with its spiller) and the cluster store
(tier 3, with the writer of its policy), each optional. Lookup asks the node's tiers under
the cache's lock and the cluster, for what they lack, outside it (bounded in time: a store
that is down answers nothing and costs nothing). LoadKeys promotes from disk, then from the
cluster in one batch call, into fresh host pages, and then holds every page or fails whole
with ``KEY_NOT_FOUND``. Removal reaches every tier.

Primitives:

- ``TierStack(pool, cache, disk, cluster, policy, window)``: ``start()`` wires the cache's
  lower tier and its stored-keys cue, and starts the threads; ``close(remove_files)``.
- ``lookup(keys, holder)`` -> (hit prefix, tier bytes, keys held for ``holder``, if given:
  what host memory has at once, what is below it once a ``Prefetcher`` promoted it);
  ``hold_for_load(keys, on_promoted, owner)`` -> host pages busy for reading (the owner's held
  keys never refused; a promotion in flight waited for); ``promote(keys)``;
  ``remove(keys)`` -> keys that were in some tier; ``clear()`` -> keys dropped from this node;
  ``contents()``: the keys each tier holds (host memory, the disk, what this daemon put to
  the cluster), for a KV event resync. Every tier tells the pool's event log what it gains
  and loses.
- ``disk``, ``spiller``, ``cluster``, ``writer``, ``cluster_spiller``: the parts, for metrics;
  ``failing()``: per tier, whether its writes fail now (``hicache_tier_failing``).
- ``build_stack(pool, cache, disk_config, budget, observe_disk, store)``: what the config
  gives a pool.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import numpy as np

from hicache.errors import KeyNotFound
from hicached.cache.events import CLUSTER, DISK, HOST
from hicached.cache.holds import Holder
from hicached.cache.pool_cache import PoolCache
from hicached.core.pool import HostPool
from hicached.core.state_file import spec_to_dict
from hicached.tiers.cluster import ClusterTier, promote_cluster
from hicached.tiers.cluster_writer import PUT_RETRY_SECONDS, ClusterWriter
from hicached.tiers.config import DiskTierConfig
from hicached.tiers.disk import DiskTier
from hicached.tiers.disk_io import DiskTierUnavailable
from hicached.tiers.mooncake import MooncakeStore
from hicached.tiers.prefetch import Prefetcher
from hicached.tiers.spill import Spiller, promote
from hicached.tiers.writer import TierWriter

log = logging.getLogger(__name__)

LANDING_WAIT_SECONDS = 2.0
"""How long a LoadKeys waits for keys still being written (a promotion its Lookup started)."""


def _nothing() -> None:
    pass


class TierStack:
    def __init__(self, pool: HostPool, cache: PoolCache, disk: DiskTier | None = None,
                 spill_window: int = 1, cluster: ClusterTier | None = None,
                 policy: str = "through", queue_pages: int = 1024, batch: int = 16,
                 put_retry_seconds: float = PUT_RETRY_SECONDS, disk_unavailable: str = ""
                 ) -> None:
        """``spill_window``: pages kept written to disk ahead of eviction; ``policy``:
        ``through`` (the writer puts every stored key, trying one the store refused for
        ``put_retry_seconds``) or ``evict`` (a spiller puts the oldest ``queue_pages`` ahead
        of eviction); ``queue_pages`` bounds either. ``disk_unavailable``: why the disk tier
        the config gives the pool could not be opened ("" if it could or there is none)."""
        self.pool, self.cache = pool, cache
        self.disk, self.cluster = disk, cluster
        for tier in (disk, cluster):
            if tier is not None:
                tier.events = cache.events
        # a key's chain is kept until it leaves the lowest tier the node watches evict
        cache.events.chains.last_tier = (DISK if disk is not None
                                         else CLUSTER if cluster is not None else HOST)
        self.disk_unavailable = disk_unavailable
        self.spiller = Spiller(pool, cache, disk, spill_window) if disk is not None else None
        self.writer: ClusterWriter | None = None
        self.cluster_spiller: Spiller | None = None
        if cluster is not None and policy == "through":
            self.writer = ClusterWriter(cache, cluster, queue_pages, batch, put_retry_seconds)
        elif cluster is not None:
            self.cluster_spiller = Spiller(pool, cache, cluster, queue_pages, batch, "cluster")
        self.prefetcher: Prefetcher | None = None
        if disk is not None or cluster is not None:
            self.prefetcher = Prefetcher(self.promote, cache.holds.promoted, pool.spec.name)

    def start(self) -> None:
        self.cache.lower = self.disk
        self.cache.on_stored = self._stored
        if self.disk is None and self.cluster_spiller is not None and self.cluster is not None:
            self.cache.kept_below = self.cluster.written  # the cluster is the tier spilled to
        for t in (self.spiller, self.writer, self.cluster_spiller):
            if t is not None:
                t.start()

    def failing(self) -> dict[str, bool]:
        """Per tier below host memory the pool has (``disk``, ``cluster``): whether its writes
        fail now (a disk tier that could not be opened counts as failing)."""
        out: dict[str, bool] = {}
        if self.disk is not None or self.disk_unavailable:
            out["disk"] = bool(self.disk_unavailable) or bool(
                self.spiller is not None and self.spiller.failing)
        writer: TierWriter | None = self.writer or self.cluster_spiller
        if writer is not None:
            out["cluster"] = writer.failing
        return out

    def contents(self) -> dict[int, list[bytes]]:
        """Per tier (``HOST``, ``DISK``, ``CLUSTER``), the keys it holds now."""
        out = {HOST: self.cache.snapshot()}
        if self.disk is not None:
            out[DISK] = self.disk.snapshot()
        if self.cluster is not None:
            out[CLUSTER] = self.cluster.snapshot()
        return out

    def _stored(self, keys: list[bytes]) -> None:
        for s in (self.spiller, self.cluster_spiller):
            if s is not None:
                s.nudge()
        if self.cluster is not None:
            self.cluster.revive(keys)
        if self.writer is not None:
            self.writer.offer(keys)

    def close(self, remove_files: bool = False) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        for t in (self.spiller, self.writer, self.cluster_spiller):
            if t is not None:
                t.close()
        if self.disk is not None:
            self.disk.close()
            if remove_files:
                self.disk.remove_files()
        if self.cluster is not None:
            self.cluster.close()

    # -- keyed calls ----------------------------------------------------------------------

    def _below(self) -> Callable[[list[bytes]], list[int]] | None:
        r = self.cluster
        return r.exists if r is not None and r.store.up else None

    def lookup(self, keys: Sequence[bytes], holder: Holder | None = None, touch: bool = False
               ) -> tuple[int, bytes, int, int]:
        """(hit prefix, tier bytes, keys held, keys promised): with a ``holder``, what host
        memory has of the hit prefix is held now, and the keys only a lower tier has right
        after them, as many as the holder's share of the pool still allows, are promised: the
        disk keeps those it has until a promotion has read them up and held them (a load that
        comes first promotes them itself); ``touch``: the host pages of the hit count as used
        now."""
        if holder is None:
            hit_prefix, tiers = self.cache.lookup(keys, self._below(), touch=touch)
            return hit_prefix, tiers, 0, 0
        hit_prefix, tiers, held = self.cache.lookup_held(keys, holder, self._below(),
                                                         touch=touch)
        if held == hit_prefix or self.prefetcher is None or tiers[held] <= 1:
            return hit_prefix, tiers, held, held
        room = self.cache.holds.room(holder)
        end = held
        while end < hit_prefix and tiers[end] > 1 and end - held < room:
            end += 1
        if end == held:
            return hit_prefix, tiers, held, held
        below = keys[held:end]
        disk, kept = self.disk, []
        if disk is not None:
            kept = disk.hold([k for k, t in zip(below, tiers[held:end], strict=True)
                              if t == DISK])
        release = (functools.partial(disk.release, kept) if disk is not None and kept
                   else _nothing)
        if not self.prefetcher.submit(below, holder, release):
            release()  # the queue is full: the load promotes for itself, nothing promised
            return hit_prefix, tiers, held, held
        return hit_prefix, tiers, held, end

    def promote(self, keys: Sequence[bytes]) -> int:
        """Read what host memory lacks of ``keys`` up from the disk, then the cluster."""
        n = 0
        if self.disk is not None:
            n += promote(self.pool, self.cache, self.disk, keys)
        if self.cluster is not None:
            n += promote_cluster(self.cache, self.cluster, keys)
        return n

    def hold_for_load(self, keys: Sequence[bytes],
                      on_promoted: Callable[[int], None] = lambda n: None, owner: int = 0
                      ) -> np.ndarray:
        """The host pages of ``keys`` busy for reading, promoting from disk and then from
        the cluster what host memory lacks (first waiting for promotions in flight); once
        more if that did not hold them all (a promotion evicted a key of this very batch, or
        found no free page). Keys ``owner`` holds are never refused. ``KEY_NOT_FOUND`` when
        a key is in no tier (nothing held)."""
        if self.disk is None and self.cluster is None:
            return self.cache.begin_load(keys, owner=owner)
        try:
            return self.cache.begin_load(keys, count_miss=False, owner=owner)
        except KeyNotFound:
            pass
        for attempt in (0, 1):
            self.cache.wait_landed(keys, LANDING_WAIT_SECONDS)
            n = self.promote(keys)
            if n:
                on_promoted(n)
            try:
                return self.cache.begin_load(keys, count_miss=bool(attempt), owner=owner)
            except KeyNotFound as exc:  # once more: a promotion may have evicted a key of
                if attempt:  # this batch, or found every page held by a spiller for a moment
                    raise self._not_found(keys, exc) from None
        raise AssertionError("unreachable")

    def _not_found(self, keys: Sequence[bytes], exc: KeyNotFound) -> KeyNotFound:
        """The refusal, naming the first key in no tier (host memory alone would name the
        first key it lacks, though the disk or the cluster holds it)."""
        hit_prefix, tiers = self.cache.lookup(keys, self._below(), count=False)
        first = tiers.find(0)
        if first < 0:  # every key is somewhere, but could not all be held at once
            return exc
        missing = tiers.count(0)
        return KeyNotFound(
            f"{missing} of {len(keys)} key(s) are in no tier (never stored, evicted, removed, "
            f"still being written, or gone from the disk or the cluster); first at position "
            f"{first}; nothing was loaded",
            metadata={"first_missing_position": first, "hit_prefix": hit_prefix,
                      "missing": missing, "field": "keys"})

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop ``keys`` from every tier; returns how many some tier of this node held, or
        the cluster store held."""
        unique = list(dict.fromkeys(keys))
        gone = set(self.cache.remove_keys(unique))
        if self.cluster is not None:
            gone.update(self.cluster.remove(unique))
        return len(gone)

    def clear(self) -> int:
        """Drop every key of the pool from this node, and its namespace from the cluster."""
        n = self.cache.clear()
        if self.cluster is not None:
            removed = self.cluster.clear()
            log.info("pool %s: %d key(s) removed from the cluster store", self.pool.spec.name,
                     removed)
        return n


def build_stack(pool: HostPool, cache: PoolCache, disk: DiskTierConfig | None,
                budget_bytes: int, observe_disk: Callable[[str, float], None],
                store: MooncakeStore | None) -> TierStack:
    """The tiers the daemon's config gives a pool: its share of the disk (its saved index,
    or a cold one) and its part of the cluster store. Not started."""
    spec = pool.spec
    tier, window, unavailable = None, 1, ""
    if disk is not None and pool.nbytes:
        pages = disk.share(pool.nbytes, budget_bytes, spec.page_bytes)
        if pages < 1:
            log.warning("pool %s gets no disk tier: its share of %d bytes is under a page",
                        spec.name, disk.capacity_bytes)
        else:
            tier = DiskTier(disk.path, spec.name, {"spec": spec_to_dict(spec)},
                            spec.page_bytes, pages, o_direct=disk.o_direct, fsync=disk.fsync,
                            observe=observe_disk, io_threads=disk.io_threads,
                            preallocate=disk.preallocate)
            try:
                outcome = tier.open()
            except DiskTierUnavailable as exc:
                log.error("pool %s serves without its disk tier: %s", spec.name, exc.strerror)
                unavailable, tier = str(exc.strerror), None
            else:
                log.info("pool %s: disk tier %s, %d pages (%d keys)", spec.name, outcome,
                         pages, tier.keys)
                window = max(disk.spill_ahead_bytes // spec.page_bytes, 1)
    cluster = None
    if store is not None and pool.nbytes:
        c = store.config
        cluster = ClusterTier(pool, store, c.key_prefix)
        log.info("pool %s: cluster tier under %s (write policy %s)", spec.name, cluster.prefix,
                 c.write_policy)
    queue = max(store.config.queue_bytes // spec.page_bytes, 1) if store is not None else 1
    return TierStack(pool, cache, tier, window, cluster,
                     store.config.write_policy if store is not None else "through", queue,
                     store.config.batch_pages if store is not None else 16,
                     store.config.put_retry_seconds if store is not None
                     else PUT_RETRY_SECONDS, unavailable)
