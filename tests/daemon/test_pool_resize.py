"""A pool's share of the memory budget: ``Sizing.resize`` and the allocator's limit.

Shrinking evicts the least recently used keys, copies the pages of keys still above the new
size below it (exact bytes, checked against what was written, not against another view of
the same memory), leaves pages a copy, a hold or a raw owner has where they are (the limit
stays above them), and gives the memory above the limit back to the system; growing hands
the pages out again. A state machine drives stores, loads, removals and resizes against a
small model.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache.specs import CanarySpec, Layout
from hicached.cache.pool_cache import PoolCache
from hicached.core.pool import HostPool
from tests.cache_pages import pattern, read, store
from tests.helpers import make_pool, mha, spec

K = [b"key-%03d" % i for i in range(64)]


def page_of(cache: PoolCache, key: bytes) -> int:
    return cache.index.ready[key]


@pytest.fixture
def pool() -> Iterator[HostPool]:
    p = make_pool(spec(mha(), page_size=4, size_tokens=64, canary=CanarySpec()))  # 16 pages
    yield p
    p.close()


def test_a_shrink_evicts_the_oldest_and_moves_the_rest_below_with_their_bytes(
        pool: HostPool) -> None:
    cache = PoolCache(pool)
    store(cache, K[:12])  # pages 0..11, K0 the least recently used
    cache.lookup([K[0]], touch=True)  # now K1 is the oldest
    r = cache.sizing.resize(6)
    assert (r.limit, r.evicted) == (6, 6)
    assert set(cache.index.ready) == {K[0], *K[7:12]}  # K1..K6 went, oldest first
    assert r.moved == 5  # K7..K11 lived on pages 7..11
    n = pool.spec.page_bytes
    for key in cache.index.ready:
        assert page_of(cache, key) < 6
        assert np.array_equal(read(pool, page_of(cache, key)), pattern(key, n)), key
    assert cache.stats.evicted_by["budget"] == 6
    pool.allocator.memcheck()
    # a Store after it stays below the limit: it evicts rather than grow
    store(cache, K[20:23])
    assert all(p < 6 for p in cache.index.keyed_pages()) and pool.allocator.used_pages <= 6
    # a moved key loads, and the canary holds for the page it moved to
    assert K[11] in cache.index.ready
    pages = cache.begin_load([K[11]])
    assert pool.canary is not None
    pool.canary.verify(pages, range(3), pool.fingerprints(pages, range(3)))
    cache.finish_load(pages)


def test_pages_in_use_stay_and_hold_the_limit_above_them_until_they_are_free(
        pool: HostPool) -> None:
    cache = PoolCache(pool)
    store(cache, K[:10])
    loading = cache.begin_load([K[9]])  # page 9: a copy reads it
    raw = cache.alloc_raw(2 * pool.page_size)  # pages 10, 11: a worker owns them
    r = cache.sizing.resize(4)
    assert r.limit == 12  # page 11 is the highest in use
    assert page_of(cache, K[9]) == 9 and K[9] in cache.index.ready
    assert all(p < 4 for k, p in cache.index.ready.items() if k != K[9])
    cache.finish_load(loading)
    pool.allocator.free(raw)
    r = cache.sizing.resize(4)
    assert r.limit == 4 and r.moved == 1
    assert np.array_equal(read(pool, page_of(cache, K[9])), pattern(K[9], pool.spec.page_bytes))
    pool.allocator.memcheck()


def test_a_growth_hands_the_pages_out_again(pool: HostPool) -> None:
    cache = PoolCache(pool)
    cache.sizing.resize(4)
    store(cache, K[:8])
    assert len(cache.index.ready) == 4
    r = cache.sizing.resize(16)
    assert r == (16, 0, 0, 0)
    store(cache, K[8:20])
    assert len(cache.index.ready) == 16 and pool.allocator.used_pages == 16
    pool.allocator.memcheck()


def _rss_kib(address: int) -> int:
    """Resident KiB of the mapping that holds ``address`` (``/proc/self/smaps``)."""
    with open("/proc/self/smaps") as f:
        text = f.read()
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        lo, hi = (int(x, 16) for x in block.split(" ", 1)[0].split("-"))
        if lo <= address < hi:
            return int(re.search(r"^Rss:\s+(\d+) kB", block, re.M).group(1))  # type: ignore[union-attr]
    raise AssertionError("no mapping holds the pool")


def test_the_memory_above_the_limit_goes_back_to_the_system() -> None:
    # 64 KiB pages, one run each (PAGE_FIRST): whole OS pages above the limit
    p = make_pool(spec(mha(layers=4, heads=8, dim=64), page_size=16, layout=Layout.PAGE_FIRST,
                       size_tokens=16 * 64))
    try:
        cache = PoolCache(p)
        store(cache, K[:64])  # every page written
        before = _rss_kib(p.address)
        r = cache.sizing.resize(16)
        assert r.limit == 16
        assert r.released_bytes == 48 * p.spec.page_bytes
        after = _rss_kib(p.address)
        assert before - after >= 0.9 * r.released_bytes / 1024, (before, after)
        raw = p.raw_bytes()
        for off, n in p.page_run_ranges(16, 64):
            assert not raw[off:off + n].any(), "released pages read zero"
        del raw
        for key in cache.index.ready:  # the 16 kept keys are whole
            assert np.array_equal(read(p, page_of(cache, key)), pattern(key, p.spec.page_bytes))
        cache.sizing.resize(64)  # grown again: the pages fault back in as they are written
        store(cache, K[:64])
        assert all(np.array_equal(read(p, page_of(cache, k)), pattern(k, p.spec.page_bytes))
                   for k in K[:64] if k in cache.index.ready)
    finally:
        p.close()


class ResizeMachine(RuleBasedStateMachine):
    """Stores, loads (some left in flight), removals and resizes against a model of which
    keys exist and what bytes they hold."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(spec(mha(layers=2), page_size=4, size_tokens=48))  # 12 pages
        self.cache = PoolCache(self.pool)
        self.n = self.pool.spec.page_bytes
        self.removed: set[bytes] = set()
        self.loading: list[tuple[bytes, np.ndarray]] = []

    def teardown(self) -> None:
        self.pool.close()

    @rule(first=st.integers(0, 30), n=st.integers(1, 4))
    def store(self, first: int, n: int) -> None:
        keys = K[first:first + n]
        store(self.cache, keys)
        self.removed -= set(keys)

    @rule(i=st.integers(0, 30))
    def begin_load(self, i: int) -> None:
        key = K[i]
        if key not in self.cache.index.ready:
            return
        self.loading.append((key, self.cache.begin_load([key])))

    @precondition(lambda self: self.loading)
    @rule()
    def finish_load(self) -> None:
        key, pages = self.loading.pop(0)
        # the page read is the key's, byte for byte, however often it moved before the load
        assert np.array_equal(read(self.pool, int(pages[0])), pattern(key, self.n))
        self.cache.finish_load(pages)

    @rule(i=st.integers(0, 30))
    def remove(self, i: int) -> None:
        self.cache.remove([K[i]])
        self.removed.add(K[i])

    @rule(pages=st.integers(0, 12), moves=st.integers(0, 3))
    def resize(self, pages: int, moves: int) -> None:
        r = self.cache.sizing.resize(pages, max_moves=moves)
        assert r.limit >= pages
        assert r.limit == max(pages, self.pool.allocator.top()), "the limit hugs what is used"

    @invariant()
    def holds(self) -> None:
        alloc = self.pool.allocator
        alloc.memcheck()
        limit = alloc.limit
        loading = {int(p[0]) for _, p in self.loading}
        for key, page in self.cache.index.ready.items():
            assert key not in self.removed, "a removed key is still there"
            assert page < limit, "a key above the limit"
            if page not in loading:
                assert np.array_equal(read(self.pool, page), pattern(key, self.n)), key
        for key, pages in self.loading:  # a page being read never moves
            assert self.cache.index.ready.get(key, int(pages[0])) == int(pages[0]), key
        assert alloc.used_pages <= limit


ResizeMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                           deadline=None)
TestResizeMachine = ResizeMachine.TestCase


def test_a_file_backed_pool_punches_its_released_pages_and_reserves_them_again() -> None:
    """A memfd (or state file) pool: the released pages leave the file (a hole), and are
    reserved again before they are handed out, so a full tmpfs refuses the growth instead of
    a copy dying of SIGBUS."""
    from hicached.core.memory import Backing
    from hicached.core.pool import MemoryOptions

    s = spec(mha(layers=4, heads=8, dim=64), page_size=16, layout=Layout.PAGE_FIRST,
             size_tokens=16 * 64)
    p = HostPool(s, MemoryOptions(backing=Backing.MEMFD, hugepages=False, prefault_threads=1,
                                  reserve_bytes=0), resident_pages=16)
    try:
        assert p.memory is not None
        fd = p.memory.fd

        def blocks() -> int:
            return os.fstat(fd).st_blocks * 512

        assert blocks() == 16 * s.page_bytes, "only the resident pages are in the file"
        cache = PoolCache(p)
        assert p.allocator.limit == 16, "nothing above its resident pages before it grows"
        assert p.reserve_pages(16, 64)
        p.allocator.set_limit(64)  # as the budget grows it: reserved, then handed out
        store(cache, K[:64])
        assert blocks() == 64 * s.page_bytes
        r = cache.sizing.resize(16)
        assert r.released_bytes == 48 * s.page_bytes
        assert blocks() == 16 * s.page_bytes, "the released pages left the file"
        assert p.reserve_pages(16, 32) and blocks() == 32 * s.page_bytes
    finally:
        p.close()
