"""A hit is a promise: the holds of the content index, on its own (no bytes move here; the
end-to-end tests in test_holds_e2e.py check bytes through a real daemon).

Covered: a held key survives the eviction that takes an unheld one; a held key removed (or
cleared) is gone for every later Lookup yet loads for its holder, and its page is freed when
the hold ends; the quota; expiry; ReleaseHolds; a session's end; a Store never fails because
of holds; a key twice in a load; and a model-based run against a small reference model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hicache.errors import KeyNotFound, SpecInvalid
from hicached.cache.holds import Holder, HoldPolicy, HoldTable
from hicached.cache.index_types import NO_SPACE, STORED
from hicached.cache.pool_cache import PoolCache
from hicached.core.pool import HostPool
from tests.helpers import make_pool, mha, spec

K = [b"k%02d" % i for i in range(40)]
A, B = 1, 2  # owner numbers of two sessions


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pool() -> Iterator[HostPool]:
    p = make_pool(spec(mha(), page_size=4, size_tokens=4 * 8))  # 8 pages
    yield p
    p.close()


def store(cache: PoolCache, keys: list[bytes]) -> bytes:
    ticket = cache.begin_store(keys)
    cache.finish_store(ticket, True)
    return bytes(ticket.status)


def load(cache: PoolCache, keys: list[bytes], owner: int = 0) -> np.ndarray:
    pages = cache.begin_load(keys, owner=owner)
    cache.finish_load(pages)
    return pages


def test_policy_is_validated_and_caps() -> None:
    with pytest.raises(SpecInvalid):
        HoldPolicy(max_hold_ms=0)
    with pytest.raises(SpecInvalid):
        HoldPolicy(max_held_fraction=1.5)
    p = HoldPolicy(max_hold_ms=1000, max_held_fraction=0.25)
    assert p.seconds(5000) == 1.0 and p.seconds(200) == 0.2 and p.seconds(-3) == 0
    assert p.limit(8) == 2 and p.limit(1) == 1


def test_a_held_key_survives_the_eviction_that_takes_an_unheld_one(pool: HostPool) -> None:
    cache = PoolCache(pool, policy=HoldPolicy(max_held_fraction=1.0))
    store(cache, K[:8])
    hit, tiers, held = cache.lookup_held(K[:4], Holder(A, 10))
    assert (hit, held, tiers) == (4, 4, b"\x01" * 4)
    assert bytes(store(cache, K[8:14])) == bytes([STORED] * 4 + [NO_SPACE] * 2)
    assert cache.lookup(K[:8])[1] == b"\x01" * 4 + b"\x00" * 4  # the unheld went
    load(cache, K[:4], owner=A)  # never KEY_NOT_FOUND
    assert cache.holds.table.total == 0 and cache.stats.holds_loaded == 4
    with pytest.raises(KeyNotFound):
        cache.begin_load([K[4]])
    pool.allocator.memcheck()


def test_a_removed_held_key_is_gone_for_everyone_but_loads_for_its_holder(
        pool: HostPool) -> None:
    cache = PoolCache(pool)
    store(cache, K[:2])
    assert cache.lookup_held(K[:2], Holder(A, 10))[2] == 2
    assert cache.remove(K[:1]) == 1
    cache.clear()
    assert cache.lookup(K[:2]) == (0, b"\x00\x00")
    assert cache.lookup_held(K[:2], Holder(B, 10))[2] == 0
    with pytest.raises(KeyNotFound):
        cache.begin_load(K[:1], owner=B)
    free_before = pool.allocator.free_pages
    pages = cache.begin_load([K[0], K[1], K[0]], owner=A)  # twice, though removed
    assert pool.allocator.free_pages == free_before  # still held by the load
    cache.finish_load(pages)
    assert pool.allocator.free_pages == free_before + 2, "the pages outlived their holds"
    store(cache, K[:1])  # stored again: a new page, found again
    assert cache.lookup(K[:1])[0] == 1
    pool.allocator.memcheck()


def test_a_session_holds_at_most_its_share(pool: HostPool) -> None:
    cache = PoolCache(pool, policy=HoldPolicy(max_held_fraction=0.25))  # 2 of 8 pages
    store(cache, K[:6])
    assert cache.lookup_held(K[:6], Holder(A, 10))[:1] == (6,)
    assert cache.holds.table.count(A) == 2
    assert cache.lookup_held(K[:6], Holder(A, 10))[2] == 2  # again: the same two
    assert cache.lookup_held(K[2:6], Holder(B, 10))[2] == 2  # another session: its own
    assert cache.holds.table.total == 4


def test_holds_expire_and_the_pages_become_evictable(pool: HostPool) -> None:
    clock = Clock()
    cache = PoolCache(pool, policy=HoldPolicy(max_held_fraction=1.0), clock=clock)
    store(cache, K[:8])
    cache.lookup_held(K[:8], Holder(A, 2.0))
    assert store(cache, K[8:9]) == bytes([NO_SPACE])  # every page held: no space, no error
    clock.now += 1.0
    cache.lookup_held(K[:1], Holder(A, 2.0))  # refreshed: lasts 2 s from now
    clock.now += 1.5
    assert store(cache, K[8:9]) == bytes([STORED])  # the 7 others expired: one evicted
    assert cache.stats.holds_expired == 7 and cache.holds.table.total == 1
    assert cache.lookup([K[0]])[0] == 1
    clock.now += 1.0
    assert cache.holds.expire() == 1 and cache.holds.table.total == 0
    pool.allocator.memcheck()


def test_release_and_the_end_of_a_session(pool: HostPool) -> None:
    cache = PoolCache(pool, policy=HoldPolicy(max_held_fraction=1.0))
    store(cache, K[:4])
    b_ended = [False]
    b = Holder(B, 10, lambda: b_ended[0])  # as the service makes it: the session's flag
    cache.lookup_held(K[:4], Holder(A, 10))
    cache.lookup_held(K[:4], b)
    assert cache.holds.release(A, [K[0], K[9]]) == 1
    assert cache.holds.release(A) == 3
    b_ended[0] = True  # the session marks itself ended, then ends its holds
    assert cache.holds.end(B) == 4
    assert cache.lookup_held(K[:4], b)[2] == 0, "an ended session held again"
    assert cache.holds.room(b) == 0 and cache.holds.promoted(b, K[:4]) == 0
    assert cache.stats.holds_released == 4 and cache.stats.holds_ended == 4
    assert B not in cache.holds.table.owners() and not cache.holds.table.last(B)
    store(cache, K[4:12])  # all evictable again
    assert cache.lookup(K[:4])[0] == 0
    pool.allocator.memcheck()


def test_a_lookup_stopped_while_its_session_ends_holds_nothing(pool: HostPool) -> None:
    """The Lookup found its session live, then stops before it takes the pool's lock; the
    session ends meanwhile (flag, then holds.end). Resumed, it holds nothing, and nothing
    of that session stays in the cache's books."""
    import threading

    from hicache import seams

    cache = PoolCache(pool, policy=HoldPolicy(max_held_fraction=1.0))
    store(cache, K[:4])
    ended = [False]
    holder = Holder(B, 10, lambda: ended[0])
    got: list[tuple[int, bytes, int]] = []
    with seams.Pause("lookup.hold") as stop:
        t = threading.Thread(target=lambda: got.append(cache.lookup_held(K[:4], holder)))
        t.start()
        assert stop.wait_reached(5)
        ended[0] = True
        cache.holds.end(B)
        stop.release()
        t.join(5)
    assert got and got[0][0] == 4 and got[0][2] == 0, got
    assert cache.holds.table.total == 0 and B not in cache.holds.table.owners()
    assert cache.holds.table.last(B) is None
    pool.allocator.memcheck()


def _reader(flag: list[bool]) -> Callable[[], bool]:
    return lambda: flag[0]


def test_sessions_that_come_and_go_leave_no_books_behind(pool: HostPool) -> None:
    """Thousands of sessions each holding and ending: the hold table's and the cache's books
    per session stay at the sessions alive."""
    cache = PoolCache(pool, policy=HoldPolicy(max_held_fraction=1.0))
    store(cache, K[:4])
    alive: dict[int, list[bool]] = {}
    for owner in range(1, 3001):
        flag = alive[owner] = [False]
        h = Holder(owner, 10, _reader(flag))
        cache.lookup_held(K[:4], h)
        if owner > 2:  # two stay open
            cache.holds.release(owner, K[:1])
            alive[owner][0] = True
            cache.holds.end(owner)
    assert cache.holds.table.owners() == {1, 2} and cache.holds.table.lookups == 2
    assert cache.holds.table.total == 8
    pool.allocator.memcheck()


def test_a_hold_is_not_taken_for_a_key_being_written(pool: HostPool) -> None:
    cache = PoolCache(pool)
    ticket = cache.begin_store(K[:1])
    assert cache.lookup_held(K[:1], Holder(A, 10)) == (0, b"\x00", 0)
    cache.finish_store(ticket, True)
    assert cache.lookup_held(K[:2], Holder(A, 10)) == (1, b"\x01\x00", 1)


def test_hold_table_books() -> None:
    t = HoldTable()
    early, late = t.deadline(A, 5.0), t.deadline(A, 7.0)
    assert t.add(A, b"x", 3, early) and not t.add(A, b"x", 3, late)  # refreshed: later
    h = t.get(A, b"x")
    assert h is not None and h.until == 7.0 and t.version(A) == 1
    assert t.expire(6.0) == [] and len(t.expire(7.0)) == 1 and t.total == 0
    moved = t.deadline(B, 1.0)
    t.add(B, b"y", 4, moved)
    moved.until = 3.0  # a Lookup of the same keys moved it on
    assert t.expire(2.0) == [] and t.total == 1
    assert [h.page for h in t.end(B)] == [4] and t.total == 0
    assert t.owners() == {A}, "an ended owner leaves nothing behind"


def test_asking_the_same_keys_again_refreshes_all_holds(pool: HostPool) -> None:
    clock = Clock()
    cache = PoolCache(pool, policy=HoldPolicy(max_held_fraction=1.0), clock=clock)
    store(cache, K[:6])
    assert cache.lookup_held(K[:6], Holder(A, 2.0))[2] == 6
    for _ in range(3):  # the fast way: nothing changed since
        clock.now += 1.5
        assert cache.lookup_held(K[:6], Holder(A, 2.0))[2] == 6
    assert cache.holds.expire() == 0 and cache.holds.table.total == 6
    cache.remove(K[:1])  # a change: the next Lookup takes the long way
    clock.now += 1.5
    assert cache.lookup_held(K[:6], Holder(A, 2.0))[:1] == (0,)
    assert cache.lookup_held(K[1:6], Holder(A, 2.0))[2] == 5
    clock.now += 2.5
    assert cache.holds.expire() == 6 and cache.holds.table.total == 0  # k00's old hold too


class HoldsMachine(RuleBasedStateMachine):
    """Stores, lookups with holds by two sessions, loads, removals, clears, releases, ends and
    time, against a reference model of which keys each session holds: a load of keys its
    session holds never fails, nothing leaks, the allocator's invariants hold throughout."""

    @initialize()
    def setup(self) -> None:
        self.pool = make_pool(spec(mha(), page_size=4, size_tokens=4 * 6))
        self.clock = Clock()
        self.cache = PoolCache(self.pool, policy=HoldPolicy(max_held_fraction=0.5),
                               clock=self.clock)
        self.held: dict[int, dict[bytes, float]] = {A: {}, B: {}}
        self.ended: set[int] = set()
        self.removed: dict[int, set[bytes]] = {A: set(), B: set()}
        """Keys a session holds that were removed or cleared since it held them (it holds
        their old page; stored again, the new page is not held until it looks them up)."""

    def teardown(self) -> None:
        self.pool.close()

    keys = st.lists(st.sampled_from(K[:10]), min_size=1, max_size=4)

    def _expire_model(self) -> None:
        for held in self.held.values():
            for k in [k for k, until in held.items() if until <= self.clock.now]:
                del held[k]

    @rule(keys=keys)
    def store(self, keys: list[bytes]) -> None:
        self._expire_model()
        store(self.cache, list(dict.fromkeys(keys)))

    @rule(owner=st.sampled_from([A, B]), keys=keys, seconds=st.sampled_from([0.5, 2.0]))
    def lookup(self, owner: int, keys: list[bytes], seconds: float) -> None:
        self.cache.holds.expire()
        self._expire_model()
        hit, _, held = self.cache.lookup_held(
            keys, Holder(owner, seconds, lambda: owner in self.ended))
        assert held <= hit
        if owner in self.ended:
            assert held == 0
            return
        until = self.clock.now + seconds
        for k in keys[:held]:  # the latest Lookup of a key sets its hold's deadline
            self.held[owner][k] = until
            self.removed[owner].discard(k)
        assert len(self.held[owner]) == self.cache.holds.table.count(owner)

    @rule(owner=st.sampled_from([A, B]), n=st.integers(1, 4),
          seconds=st.sampled_from([0.5, 2.0]))
    def lookup_what_is_there(self, owner: int, n: int, seconds: float) -> None:
        ready = [k for k in K[:10] if self.cache.lookup([k])[1] == b"\x01"]
        if ready:
            self.lookup(owner, ready[:n], seconds)

    @rule(owner=st.sampled_from([A, B]), n=st.integers(1, 3))
    def load_held(self, owner: int, n: int) -> None:
        self.cache.holds.expire()
        self._expire_model()
        mine = list(self.held[owner])[:n]
        if not mine:
            return
        load(self.cache, mine + mine[:1], owner=owner)  # never refused; a repeat too
        for k in mine:
            del self.held[owner][k]

    @rule(keys=keys)
    def remove(self, keys: list[bytes]) -> None:
        self.cache.remove(keys)
        for owner in self.removed:
            self.removed[owner] |= set(keys) & set(self.held[owner])

    @rule(owner=st.sampled_from([A, B]), then_load=st.booleans())
    def remove_a_held_key(self, owner: int, then_load: bool) -> None:
        if self.held[owner]:
            key = next(iter(self.held[owner]))
            self.cache.remove([key])
            for who in self.removed:
                if key in self.held[who]:
                    self.removed[who].add(key)
            if then_load:
                self.load_held(owner, 1)

    @rule()
    def clear(self) -> None:
        self.cache.clear()
        for owner in self.removed:
            self.removed[owner] |= set(self.held[owner])

    @rule(owner=st.sampled_from([A, B]))
    def release(self, owner: int) -> None:
        self.cache.holds.release(owner)
        self.held[owner].clear()

    @rule(owner=st.sampled_from([A, B]))
    def end(self, owner: int) -> None:
        self.ended.add(owner)  # the session marks itself ended, then ends its holds
        self.cache.holds.end(owner)
        self.held[owner].clear()

    @rule(dt=st.sampled_from([0.3, 1.0]))
    def tick(self, dt: float) -> None:
        self.clock.now += dt

    @invariant()
    def held_keys_stay_found_until_removed(self) -> None:
        self.cache.holds.expire()
        self._expire_model()
        for owner, held in self.held.items():
            for k in held:
                if k not in self.removed[owner]:
                    assert self.cache.lookup([k])[1] == b"\x01", f"held {k!r} was evicted"

    @invariant()
    def books_balance(self) -> None:
        self.pool.allocator.memcheck()
        assert not self.ended & self.cache.holds.table.owners(), \
            "an ended session's books stay"
        total = sum(len(h) for h in self.held.values())
        assert self.cache.holds.table.total >= total  # expired in the model, not yet in the cache
        counts = self.pool.allocator.counts()
        assert counts["busy"] == len(self.cache.index._reading)  # every read-hold is accounted
        assert counts["free"] + counts["keyed"] + counts["raw"] + counts["releasing"] \
            == self.pool.page_num


HoldsMachine.TestCase.settings = settings(HoldsMachine.TestCase.settings, max_examples=150,
                                          stateful_step_count=40)
TestHoldsMachine = HoldsMachine.TestCase
