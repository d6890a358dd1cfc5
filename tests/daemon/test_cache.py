"""The content index on its own: key states, LRU eviction, holds, removal, events, raw pages.

Bytes are not moved here (the daemon does that between begin_* and finish_*); the model-based
test in test_cache_model.py checks bytes through a real server.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from hicache.errors import HiCacheError, PoolExhausted
from hicached.cache.events import MAX_EVENT_KEYS, EventKind, EventLog
from hicached.cache.index_types import EVICTED_AGE_BUCKETS, NO_SPACE, PRESENT, STORED
from hicached.cache.lru import LRU
from hicached.cache.pool_cache import PoolCache
from hicached.core.pool import HostPool
from tests.helpers import make_pool, mha, spec

K = [b"k%d" % i for i in range(16)]


@pytest.fixture
def pool() -> Iterator[HostPool]:
    p = make_pool(spec(mha(), page_size=4, size_tokens=16))  # 4 pages
    yield p
    p.close()


def store(cache: PoolCache, keys: list[bytes], ok: bool = True) -> bytes:
    ticket = cache.begin_store(keys)
    cache.finish_store(ticket, ok)
    return bytes(ticket.status)


def test_lru_policy_orders_by_last_use() -> None:
    lru = LRU()
    for i, k in enumerate(K[:4]):
        lru.add([k], float(i))
    lru.touch([K[0]], 5.0)
    lru.touch([b"absent"], 6.0)
    lru.discard(K[2])
    assert lru.pop_oldest(2) == [K[1], K[3]] and len(lru) == 1 and K[0] in lru
    assert lru.pop_oldest(5) == [K[0]] and lru.pop_oldest(1) == []


def test_lru_tells_each_popped_keys_last_use() -> None:
    lru = LRU()
    for i, k in enumerate(K[:4]):
        lru.add([k], float(i))
    lru.touch([K[0]], 10.0)
    used: list[float] = []
    assert lru.pop_oldest(2, used=used) == [K[1], K[2]] and used == [1.0, 2.0]
    used.clear()  # a busy key passed over, then taken last: its own time follows it
    assert lru.pop_oldest(2, busy={K[3]}, used=used) == [K[0], K[3]] and used == [10.0, 3.0]


def test_evictions_are_counted_by_reason_and_by_idle_time(pool: HostPool) -> None:
    """A Store, a promotion and an Alloc each make room: counted under their reason; each
    evicted key's idle time (since its last use) lands in its histogram bucket."""
    clock = [1000.0]
    cache = PoolCache(pool, clock=lambda: clock[0])
    store(cache, K[:4])  # used at 1000
    clock[0] = 1000.5
    cache.lookup([K[3]], touch=True)  # K3 used again at 1000.5
    clock[0] = 1030.0
    store(cache, [K[4]])  # evicts K0: idle 30 s
    clock[0] = 1030.05
    ticket = cache.begin_store([K[5]], "promotion")  # evicts K1: idle 30.05 s
    cache.finish_store(ticket, True)
    clock[0] = 5000.0
    cache.alloc_raw(2 * pool.page_size)  # evicts K2 (idle 4000 s) and K3 (3999.5 s)
    st = cache.stats
    assert st.evicted_by == {"store": 1, "promotion": 1, "alloc": 2, "budget": 0}
    assert sum(st.evicted_age) == st.evicted == 4
    at = {b: n for b, n in zip([*EVICTED_AGE_BUCKETS, float("inf")], st.evicted_age,
                               strict=True) if n}
    assert at == {60.0: 2, 21600.0: 2}  # 30, 30.05 s; 4000, 3999.5 s
    assert st.evicted_age_sum == pytest.approx(30 + 30.05 + 4000 + 3999.5)
    pool.allocator.memcheck()


def test_a_key_is_visible_only_once_its_copy_finished(pool: HostPool) -> None:
    cache = PoolCache(pool)
    ticket = cache.begin_store(K[:2])
    assert cache.lookup(K[:2]) == (0, b"\x00\x00")  # being written: absent
    with pytest.raises(HiCacheError) as exc:
        cache.begin_load(K[:1])
    assert exc.value.reason == "KEY_NOT_FOUND"
    assert store(cache, K[:1]) == bytes([PRESENT])  # in flight elsewhere: not written again
    cache.finish_store(ticket, True)
    assert bytes(ticket.status) == bytes([STORED, STORED])
    assert cache.lookup([K[0], K[5], K[1]]) == (1, b"\x01\x00\x01")
    pool.allocator.memcheck()


def test_a_failed_copy_leaves_no_key_and_no_page(pool: HostPool) -> None:
    cache = PoolCache(pool)
    assert store(cache, K[:3], ok=False) == bytes(3)
    assert cache.lookup(K[:3])[0] == 0 and pool.allocator.free_pages == 4
    assert cache.events.last_seq == 0
    pool.allocator.memcheck()


def test_full_pool_evicts_least_recently_used_and_reports_no_space(pool: HostPool) -> None:
    cache = PoolCache(pool)
    store(cache, K[:4])
    pages = cache.begin_load([K[0]])  # used: most recently used once released
    cache.finish_load(pages)
    assert store(cache, [K[1]]) == bytes([PRESENT])  # a re-store counts as use too
    assert store(cache, K[4:6]) == bytes([STORED, STORED])
    assert cache.lookup(K[:6])[1] == b"\x01\x01\x00\x00\x01\x01"  # K2, K3 were oldest
    assert cache.stats.evicted == 2
    events = cache.events.after(0)
    assert [(e.kind, e.keys) for e in events[1:]] == [(EventKind.EVICTED, (K[2], K[3])),
                                                      (EventKind.STORED, (K[4], K[5]))]
    pool.allocator.memcheck()


@pytest.mark.parametrize("touch", [False, True])
def test_a_touching_lookup_makes_its_hits_the_most_recently_used(pool: HostPool,
                                                                  touch: bool) -> None:
    """A Lookup leaves recency alone unless it touches: then the host pages of its hit are
    the most recently used (misses and keys below host memory are not made up)."""
    cache = PoolCache(pool)
    store(cache, K[:4])
    assert cache.lookup([K[0], K[9], K[1]], touch=touch) == (1, b"\x01\x00\x01")
    assert store(cache, K[4:6]) == bytes([STORED, STORED])
    evicted = [K[2], K[3]] if touch else [K[0], K[1]]
    assert cache.lookup(evicted)[0] == 0
    assert cache.lookup([k for k in K[:4] if k not in evicted])[0] == 2
    assert cache.lookup(K[9:10], touch=True) == (0, b"\x00")
    assert K[9] not in cache.index._evictable
    pool.allocator.memcheck()


def test_held_pages_are_never_evicted(pool: HostPool) -> None:
    cache = PoolCache(pool)
    store(cache, K[:4])
    held = cache.begin_load(K[:3])
    assert store(cache, K[4:6]) == bytes([STORED, NO_SPACE])  # only K3 could go
    assert cache.lookup(K[:4])[1] == b"\x01\x01\x01\x00"
    assert cache.stats.no_space == 1
    cache.finish_load(held)  # K0..K2 evictable again, as the most recently used
    assert store(cache, [K[5]]) == bytes([STORED])  # so K4 goes
    assert cache.lookup([K[4], *K[:3]])[1] == b"\x00\x01\x01\x01"
    pool.allocator.memcheck()


def test_raw_pages_are_never_evicted_but_may_evict(pool: HostPool) -> None:
    cache = PoolCache(pool)
    store(cache, K[:3])
    raw = cache.alloc_raw(8)  # one free page and one evicted key
    assert cache.lookup(K[:3])[1] == b"\x00\x01\x01"
    assert store(cache, K[8:10]) == bytes([STORED, STORED])  # evicts K1, K2; never raw
    assert store(cache, K[10:13]) == bytes([STORED, STORED, NO_SPACE])  # K8, K9 go; raw stay
    assert pool.allocator.is_allocated(raw[::4] // 4).all()
    with pytest.raises(PoolExhausted):
        cache.alloc_raw(12)  # all or nothing: 2 evictable + 0 free < 3 pages
    assert cache.lookup(K[10:12])[1] == b"\x01\x01"  # the refused alloc evicted nothing
    pool.allocator.memcheck()


def test_removed_key_frees_its_page_once_its_load_ends(pool: HostPool) -> None:
    cache = PoolCache(pool)
    store(cache, K[:2])
    held = cache.begin_load([K[0], K[0]])  # one page read twice
    assert cache.remove([K[0], K[7], K[0]]) == 1
    assert cache.lookup([K[0]])[0] == 0 and pool.allocator.free_pages == 2
    store(cache, [K[0]])  # a new copy of the key gets another page
    cache.finish_load(held)
    assert pool.allocator.free_pages == 2
    assert cache.lookup(K[:2])[1] == b"\x01\x01"
    pool.allocator.memcheck()


def test_clear_drops_ready_and_in_flight_keys_and_keeps_raw_pages(pool: HostPool) -> None:
    cache = PoolCache(pool)
    raw = cache.alloc_raw(4)
    store(cache, K[:2])
    writing = cache.begin_store([K[2]])
    assert cache.clear() == 3
    cache.finish_store(writing, True)  # finished after the clear: dropped, not visible
    assert cache.lookup(K[:3])[0] == 0 and bytes(writing.status) == bytes([0])
    assert pool.allocator.free_pages == 3 and pool.allocator.is_allocated(raw[:1] // 4).all()
    kinds = [e.kind for e in cache.events.after(0)]
    assert kinds == [EventKind.STORED, EventKind.REMOVED]
    pool.allocator.memcheck()


def test_load_of_a_missing_key_holds_nothing(pool: HostPool) -> None:
    cache = PoolCache(pool)
    store(cache, K[:2])
    with pytest.raises(HiCacheError) as exc:
        cache.begin_load([K[0], K[1], K[9], K[0], K[8]])
    assert exc.value.metadata == {"first_missing_position": "2", "hit_prefix": "2",
                                  "missing": "2", "field": "keys"}
    assert pool.allocator.counts()["busy"] == 0
    assert store(cache, K[2:4]) == bytes([STORED, STORED])
    assert store(cache, [K[4]]) == bytes([STORED])  # K0 still evictable: it was never held
    assert cache.lookup([K[0]])[0] == 0


def test_event_log_is_bounded_and_shows_gaps() -> None:
    log = EventLog(max_keys=2 * MAX_EVENT_KEYS)
    log.append(EventKind.STORED, [b"a"] * (MAX_EVENT_KEYS + 1))  # two events
    log.append(EventKind.REMOVED, [b"b"] * MAX_EVENT_KEYS)
    log.append(EventKind.EVICTED, [])  # nothing: no event
    assert log.last_seq == 3
    events = log.after(0)
    assert [e.seq for e in events] == [2, 3]  # the oldest fell out: the reader sees 1 missing
    assert [len(e.keys) for e in events] == [1, MAX_EVENT_KEYS]
    assert log.after(3) == [] and log.wait(3, 0.01) == []
    assert [e.seq for e in log.after(2)] == [3]


def test_metadata_is_counted(pool: HostPool) -> None:
    per_page = HostPool.metadata_bytes_per_page(pool.spec)
    assert pool.metadata_bytes == per_page * pool.page_num
    assert np.all(pool.allocator.counts()["free"] == 4)


def test_removals_while_writers_overlap_are_forgotten_once_no_writer_predates_them(
        pool: HostPool) -> None:
    """A spiller and a cluster writer whose loans always overlap (never none out): the
    removals recorded for them are kept only while a writer that began before them is out,
    and each writer still sees every removal made since it borrowed."""
    cache = PoolCache(pool)
    store(cache, K[:2])
    _, pages, first = cache.lending.borrow(K[:1])
    for i in range(200):
        # the next writer, before the first is done
        _, pages2, second = cache.lending.borrow(K[1:2])
        cache.remove([b"gone-%d" % i])
        assert cache.lending.removed_since(b"gone-%d" % i, first)
        assert cache.lending.removed_since(b"gone-%d" % i, second)
        cache.lending.give_back(pages, first)
        assert not cache.lending.removed_since(b"gone-%d" % (i - 1), second) if i else True
        pages, first = pages2, second
        assert cache.removals.kept <= 1, cache.removals.kept
    cache.lending.give_back(pages, first)
    assert cache.removals.kept == 0 and cache.removals.lent == 0
    pool.allocator.memcheck()
