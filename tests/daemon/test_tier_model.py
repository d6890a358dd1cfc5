"""Host memory and the disk tier together, driven by a state machine against a small model.

A real ``HostPool`` (8 pages) with its ``PoolCache``, a real ``DiskTier`` on disk with room for
every key (so the disk never evicts), and the real spill and promotion steps
(``spill_candidates`` / ``write_many`` / ``finish_spill``, ``TierStack.hold_for_load`` as LoadKeys),
called as rules in any order with stores, loads, removals, clears, a corrupted disk page and a
reopened disk index; a spill also stays open across other steps (its pages taken, its write
later), as the spiller's thread leaves it while stores and loads go on.

The model: each key stored and not removed has a tag its bytes are made of, and whether a copy
of it went to disk. What must hold after every step: a key found (tier 1 or 2) loads exactly
its tag's bytes; a removed or cleared key is never found; a key spilled to disk and not
removed, cleared or corrupted is never lost, whatever host memory evicted.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache.errors import KeyNotFound
from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicached.cache.holds import Holder, HoldPolicy
from hicached.cache.pool_cache import PoolCache
from hicached.core.pool import HostPool, MemoryOptions
from hicached.tiers.disk import DiskTier
from hicached.tiers.stack import TierStack

PS = 4
SPEC = PoolSpec("tm", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 1, 8), PS,
                size_tokens=PS * 8)
KEYS = [b"key-%d" % i for i in range(24)]


def fill(pool: HostPool, page: int, tag: int) -> None:
    for v in pool.page_views(page):
        np.frombuffer(v, dtype=np.uint8)[:] = tag


def tag_of(pool: HostPool, page: int) -> set[int]:
    return {int(x) for v in pool.page_views(page) for x in np.unique(np.frombuffer(v, np.uint8))}


class Tiers(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="hicache-tm-", dir="/var/tmp")
        self.pool = HostPool(SPEC, MemoryOptions(hugepages=False, reserve_bytes=0))
        self.cache = PoolCache(self.pool)
        self.disk = self._open_disk()
        self.tags: dict[bytes, int] = {}
        self.on_disk: set[bytes] = set()
        self.next_tag = 1
        self.open_spill: tuple[list[bytes], np.ndarray, int] | None = None

    def _open_disk(self) -> DiskTier:
        d = DiskTier(self.dir, "tm", {"spec": "tm"}, SPEC.page_bytes, len(KEYS) + 4)
        d.open()
        self.cache.lower = d
        return d

    def teardown(self) -> None:
        if self.open_spill is not None:
            self.cache.lending.finish_spill(*self.open_spill)
        self.disk.close()
        self.pool.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    def store(self, keys: list[bytes]) -> None:
        t = self.cache.begin_store(keys)
        for i, page in zip(t.positions.tolist(), t.pages.tolist(), strict=True):
            tag = self.tags.get(keys[i]) or self.next_tag  # a key's bytes never change
            self.next_tag = self.next_tag % 250 + 1
            fill(self.pool, page, tag)
            self.tags[keys[i]] = tag
        self.cache.finish_store(t, ok=True)

    @rule(n=st.integers(1, 8))
    def spill(self, n: int) -> None:
        self._write_spill(*self.cache.lending.spill_candidates(n, 8, self.disk.contains))

    def _write_spill(self, keys: list[bytes], pages: np.ndarray, epoch: int) -> None:
        """The spiller's write of a batch it took, then its release."""
        try:
            done = self.disk.write_many([(k, self.pool.page_views(p))
                                         for k, p in zip(keys, pages.tolist(), strict=True)],
                                        lambda k: not self.cache.lending.removed_since(k, epoch))
            self.on_disk |= {k for k, ok in zip(keys, done, strict=True) if ok}
        finally:
            self.cache.lending.finish_spill(keys, pages, epoch)

    @precondition(lambda self: self.open_spill is None)
    @rule(n=st.integers(1, 4))
    def spill_begins(self, n: int) -> None:
        """The spiller takes its batch; its write comes in a later step."""
        self.open_spill = self.cache.lending.spill_candidates(n, 8, self.disk.contains)

    @precondition(lambda self: self.open_spill is not None)
    @rule()
    def spill_ends(self) -> None:
        assert self.open_spill is not None
        taken, self.open_spill = self.open_spill, None
        self._write_spill(*taken)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True))
    def load(self, keys: list[bytes]) -> None:
        try:
            pages = TierStack(self.pool, self.cache, self.disk).hold_for_load(keys)  # as LoadKeys
        except KeyNotFound:
            # only a key in no tier fails a load: never one written to disk intact
            assert not set(keys) <= self.on_disk, "a load failed though every key was on disk"
            return
        try:
            for k, page in zip(keys, pages.tolist(), strict=True):
                assert tag_of(self.pool, page) == {self.tags[k]}, f"{k!r}: wrong bytes"
        finally:
            self.cache.finish_load(pages)

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key: bytes) -> None:
        self.cache.remove([key])
        self.tags.pop(key, None)
        self.on_disk.discard(key)

    @rule()
    def clear(self) -> None:
        self.cache.clear()
        self.tags.clear()
        self.on_disk.clear()

    @precondition(lambda self: bool(self.on_disk))
    @rule(data=st.data())
    def corrupt(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.on_disk)))
        slot = self.disk._index.get(key)
        if slot is None:
            return
        with open(self.disk.pages_path, "r+b") as f:
            f.seek(slot * self.disk.slot_bytes)
            f.write(b"\xff\xfe")  # no tag is 255: the page no longer matches its checksum
        self.on_disk.discard(key)  # may be lost now (if host memory no longer has it)

    @rule()
    def reopen_disk(self) -> None:
        self.disk.close()
        self.disk = self._open_disk()

    @invariant()
    def found_keys_are_exact_and_spilled_keys_are_never_lost(self) -> None:
        _, tiers = self.cache.lookup(KEYS)
        for key, tier in zip(KEYS, tiers, strict=True):
            if key not in self.tags:
                assert tier == 0, f"{key!r} was removed but is found in tier {tier}"
            elif key in self.on_disk:
                assert tier in (1, 2), f"{key!r} was written to disk but is lost"
        self.pool.allocator.memcheck()


TestTiers = Tiers.TestCase
TestTiers.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_a_promotion_that_evicts_a_key_of_its_own_batch_is_retried() -> None:
    m = Tiers()
    try:
        for i in range(0, 12, 4):  # 12 keys through 8 host pages, each batch spilled
            m.store(KEYS[i:i + 4])
            m.spill(8)
        m.spill(8)
        _, tiers = m.cache.lookup(KEYS[:12])
        oldest_host = KEYS[tiers.index(1)]  # host's least recently used key
        disk_only = KEYS[tiers.index(2)]
        # promoting disk_only evicts oldest_host, which this same load needs
        pages = TierStack(m.pool, m.cache, m.disk).hold_for_load([oldest_host, disk_only])
        assert pages.size == 2
        m.cache.finish_load(pages)
    finally:
        m.teardown()


def test_a_store_during_a_spill_evicts_pages_it_can_have_now() -> None:
    """A full pool whose four oldest keys a spill has taken: a Store of two new keys evicts
    the two oldest keys not being spilled (their pages free at once) and is granted both;
    the spill's keys stay, and go first once it ends."""
    m = Tiers()
    try:
        m.store(KEYS[:4])
        m.store(KEYS[4:8])  # the pool's 8 pages, KEYS[0] the oldest
        m.open_spill = m.cache.lending.spill_candidates(4, 8, m.disk.contains)
        assert m.open_spill[0] == KEYS[:4]
        t = m.cache.begin_store(KEYS[8:10])
        assert t.pages.size == 2, "a Store refused pages while the pool had pages to give"
        m.cache.finish_store(t, ok=True)
        _, tiers = m.cache.lookup(KEYS[:10])
        assert list(tiers) == [1, 1, 1, 1, 0, 0, 1, 1, 1, 1]  # KEYS[4:6] went, not the spill's
        m.spill_ends()
        t = m.cache.begin_store(KEYS[10:11])
        m.cache.finish_store(t, ok=True)
        _, tiers = m.cache.lookup(KEYS[:11])
        assert list(tiers) == [2, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1]  # now the oldest, kept below
    finally:
        m.teardown()


def test_a_load_during_a_spill_promotes_what_is_on_disk() -> None:
    """Keys only the disk has, loaded while a spill holds the host's oldest pages: the
    promotion evicts what it can free now and the load gets every key (the promise of the
    Lookup that found them)."""
    m = Tiers()
    try:
        m.store(KEYS[:4])
        m.spill(4)  # KEYS[:4] on disk too
        m.store(KEYS[4:8])
        m.store(KEYS[8:12])  # evicts KEYS[:4] from host: on disk only
        _, tiers = m.cache.lookup(KEYS[:12])
        assert list(tiers[:4]) == [2, 2, 2, 2]
        m.open_spill = m.cache.lending.spill_candidates(4, 8, m.disk.contains)  # KEYS[4:8] taken
        pages = TierStack(m.pool, m.cache, m.disk).hold_for_load(KEYS[:3])
        assert pages.size == 3
        for k, page in zip(KEYS[:3], pages.tolist(), strict=True):
            assert tag_of(m.pool, page) == {m.tags[k]}
        m.cache.finish_load(pages)
    finally:
        m.teardown()


class _Queued:
    """A prefetcher whose thread has not reached the job yet (or whose queue is full)."""

    def __init__(self, accept: bool) -> None:
        self.accept, self.jobs = accept, []  # type: ignore[var-annotated]

    def submit(self, keys: list[bytes], holder: Holder, release: Callable[[], None]) -> bool:
        if self.accept:
            self.jobs.append((keys, holder, release))
        return self.accept

    def close(self) -> None:
        pass


def test_a_held_hit_on_disk_stays_there_until_its_promotion_ran() -> None:
    """A Lookup holding a hit only the disk has: until the promotion it queued has run, spills
    that fill the disk evict other keys, never the hit's; the LoadKeys then gets the hit's
    exact bytes, and the disk's hold ends with the job (at once when the queue refused it)."""
    m = Tiers()
    stack = TierStack(m.pool, m.cache, m.disk)
    try:
        m.store(KEYS[:4])
        m.spill(4)
        m.store(KEYS[4:8])
        m.store(KEYS[8:12])  # KEYS[:4] only on disk now, the disk's oldest keys
        assert stack.prefetcher is not None
        stack.prefetcher.close()
        queued = _Queued(accept=True)
        stack.prefetcher = queued  # type: ignore[assignment]
        hit, tiers, held, promised = stack.lookup(KEYS[:4], Holder(owner=7, seconds=30.0))
        assert (hit, bytes(tiers), held, promised) == (4, b"\x02" * 4, 0, 2)
        assert m.disk.held == 2  # the share of 8 pages is 2: the rest is not promised
        stack.prefetcher = _Queued(accept=True)  # type: ignore[assignment]
        queued.jobs.clear()
        m.disk.release(KEYS[:2])
        m.cache.holds.policy = HoldPolicy(max_held_fraction=0.5)
        hit, tiers, held, promised = stack.lookup(KEYS[:4], Holder(owner=7, seconds=30.0))
        assert (hit, held, promised) == (4, 0, 4) and m.disk.held == 4
        queued = stack.prefetcher  # type: ignore[assignment]
        for i in range(m.disk.capacity):  # the disk filled twice over by other spills
            assert m.disk.write(b"other-%d" % i, m.pool.page_views(0))
        assert all(m.disk.contains(k) for k in KEYS[:4])
        keys, holder, release = queued.jobs.pop()
        stack.promote(keys)
        m.cache.holds.promoted(holder, keys)
        release()
        assert m.disk.held == 0
        pages = stack.hold_for_load(KEYS[:4], owner=7)
        for k, page in zip(KEYS[:4], pages.tolist(), strict=True):
            assert tag_of(m.pool, page) == {m.tags[k]}
        m.cache.finish_load(pages)
        stack.prefetcher = _Queued(accept=False)  # type: ignore[assignment]
        m.spill(8)
        m.store(KEYS[12:20])  # KEYS[4:12] evicted from host, some on disk only
        _, tiers, held, promised = stack.lookup(KEYS[4:12], Holder(owner=8, seconds=30.0))
        assert 2 in tiers and m.disk.held == 0  # refused by the queue: no hold left behind
        assert promised == held  # and nothing below host memory promised
    finally:
        stack.prefetcher = None
        m.teardown()
