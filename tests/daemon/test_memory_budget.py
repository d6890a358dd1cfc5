"""One memory budget shared by pools (``service.memory_budget``), on real pools and caches.

A busy pool grows and an idle one shrinks to its floor and no further; memory goes to the pool
whose pages are worth more (its oldest page is younger); a tenant at its quota evicts its own
pages; no tenant takes another below its guaranteed share; floors are admitted only while
they fit. A state machine drives stores into several pools of two tenants, the clock and the
rounds, against the budget's promises and the keys' bytes.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hicache.errors import HostMemoryInsufficient
from hicached.cache.pool_cache import PoolCache
from hicached.core.pool import HostPool, MemoryOptions
from hicached.service.budget_config import BudgetConfig, PoolShare, TenantQuota
from hicached.service.memory_budget import MemoryBudget
from tests.cache_pages import pattern, read, store
from tests.helpers import StrictPinner, make_pool, mha, spec

PAGES = 32  # per pool
PINNED = MemoryOptions(hugepages=False, prefault_threads=1, reserve_bytes=0, pin_unit_bytes=4096)


class Node:
    """Pools of 32 pages under one budget, on one hand-moved clock. With a ``pinner`` (a GPU
    host's page-locking, by the driver's rules) the pools are larger (a page's bytes of one
    layer fill two OS pages), and each locks the units its share needs."""

    def __init__(self, budget_pages: int, config: BudgetConfig,
                 pinner: StrictPinner | None = None) -> None:
        self.now = 1000.0
        self.pools: dict[str, HostPool] = {}
        self.caches: dict[str, PoolCache] = {}
        self.pinner = pinner
        self.geometry = mha(layers=2) if pinner is None else mha(layers=2, heads=8, dim=128)
        probe = spec(self.geometry, page_size=4, size_tokens=4 * PAGES)
        self.page_bytes = probe.page_bytes
        self.budget = MemoryBudget(budget_pages * self.page_bytes, config,
                                   clock=lambda: self.now)
        self.n = 0

    def add(self, name: str) -> PoolCache:
        s = spec(self.geometry, page_size=4, size_tokens=4 * PAGES, name=name)
        self.budget.admit(s, 0)
        if self.pinner is None:
            pool = make_pool(s)
        else:
            pool = HostPool(s, PINNED, pinner=self.pinner,
                            resident_pages=self.budget.bounds(s)[0])
        cache = PoolCache(pool, clock=lambda: self.now)
        self.pools[name], self.caches[name] = pool, cache
        self.budget.join(cache.sizing)
        return cache

    def store(self, name: str, n: int) -> list[bytes]:
        keys = [b"%s-%06d" % (name.encode(), self.n + i) for i in range(n)]
        self.n += n
        for k in keys:
            self.now += 1.0
            store(self.caches[name], [k])
        return keys

    def share(self, name: str) -> int:
        return self.pools[name].allocator.limit

    def tenant_pages(self, tenant: str) -> int:
        return sum(v.share_bytes for v in self.budget.tenants() if v.tenant == tenant) \
            // self.page_bytes

    def close(self) -> None:
        for p in self.pools.values():
            p.close()


def pages(n: int, node: Node) -> int:
    return n * node.page_bytes


@pytest.fixture
def node() -> Iterator[Node]:
    made: list[Node] = []

    def make(budget_pages: int, config: BudgetConfig, pinner: StrictPinner | None = None
             ) -> Node:
        made.append(Node(budget_pages, config, pinner))
        return made[-1]

    yield make  # type: ignore[misc]
    for n in made:
        n.close()


def config(node_page_bytes: int, **kw: object) -> BudgetConfig:
    return BudgetConfig(elastic=True, grow_step_bytes=node_page_bytes, step_fraction=0.125,
                        **kw)  # type: ignore[arg-type]


PB = spec(mha(layers=2), page_size=4, size_tokens=4 * PAGES).page_bytes


def test_the_busy_pool_grows_and_the_idle_one_shrinks_to_its_floor_and_no_further(
        node) -> None:  # type: ignore[no-untyped-def]
    n = node(36, config(PB, pools=(PoolShare("*", floor_bytes=6 * PB),)))
    a, b = n.add("a"), n.add("b")
    assert (n.share("a"), n.share("b")) == (6, 6)  # floors first
    n.store("b", 20)  # b is busy first: it grows from the slack on demand
    assert n.share("b") == 20 and b.stats.evicted == 0
    n.store("a", 30)  # then a: it takes the rest of the slack, then evicts its own
    assert n.share("a") == 16 and a.stats.evicted_by["store"] == 14
    for _ in range(10):  # a stays busy; b is idle and its pages are older than a's
        n.store("a", 4)
        n.budget.rebalance()
    assert n.share("b") == 6, "the idle pool gives way down to its floor and no further"
    assert n.share("a") == 30
    assert len(b.index.ready) == 6 and b.stats.evicted_by["budget"] == 14  # its newest 6 stayed
    assert all(np.array_equal(read(n.pools["b"], p), pattern(k, PB))
               for k, p in b.index.ready.items())
    # idle memory goes back: a's keys removed, the next round takes its free pages
    a.clear()
    n.budget.rebalance()
    assert n.share("a") == 6  # its floor (above a step of room: an eighth of the budget)


def test_a_growth_stalled_in_its_system_calls_holds_no_other_pools_store(node) -> None:  # type: ignore[no-untyped-def]
    """Pool a's Store grows it and stops while its pages are being locked (the seam: no
    budget lock held); pool b's Stores grow b meanwhile, and a's room already counts against
    the slack, so b cannot take it. Then a's growth is published."""
    import threading

    from hicache import seams

    n = node(24, config(PB, pools=(PoolShare("*", floor_bytes=4 * PB),)))
    n.add("a")
    n.add("b")
    n.store("a", 4)
    n.store("b", 4)  # both full at their floors
    done = threading.Event()

    def grow_a() -> None:
        n.store("a", 1)
        done.set()

    with seams.Pause("budget.grow_reserving") as stop:
        t = threading.Thread(target=grow_a)
        t.start()
        assert stop.wait_reached(5)
        slack_before = n.budget.budget_bytes - n.budget.used_bytes
        grown = threading.Thread(target=lambda: n.store("b", 20))
        grown.start()
        grown.join(5)
        assert not grown.is_alive(), "b's Store waited behind a's growth"
        assert n.share("b") == 4 + 15  # all the slack but a's room (a step: one page)
        assert slack_before == (24 - 8 - 1) * PB and n.share("a") == 4
        assert not done.is_set()
        stop.release()
        t.join(5)
    assert done.is_set() and n.share("a") == 5
    assert n.budget.used_bytes == 24 * PB


def _locked_pool_full_at_its_floor(node):  # type: ignore[no-untyped-def]
    """A node on a GPU host (locked memory by cuMemHostRegister's rules) with pool a, its
    floor four pages, full at it: (node, a's locked units, a's budget member)."""
    pb = spec(mha(layers=2, heads=8, dim=128), page_size=4, size_tokens=4 * PAGES).page_bytes
    n = node(64, config(pb, pools=(PoolShare("*", floor_bytes=4 * pb),)), StrictPinner())
    n.add("a")
    units = n.pools["a"].pin_units
    assert units is not None
    n.store("a", 4)  # full at its floor
    return n, units, n.budget._members["a"]


def test_a_growth_that_ends_first_unlocks_no_page_another_growth_reserved(node) -> None:  # type: ignore[no-untyped-def]
    """A rebalance grants pool a ten pages and stops with them locked, a's limit not raised
    (the seam); a's Stores grow it meanwhile: one publishes, the next stops with its page
    reserved. The grant ends first: a's limit moved, so it takes what is there, and what it
    locked above the limit is free but for the page the other growth is about to publish;
    nothing is unlocked while that one still reserves. When it ends, every page under the
    limit is locked and what lies above is given back."""
    import threading

    from hicache import seams

    n, units, member = _locked_pool_full_at_its_floor(node)
    stopped: dict[threading.Thread, threading.Event] = {}
    arrived = threading.Semaphore(0)

    def stop_chosen() -> None:
        go = stopped.get(threading.current_thread())
        if go is not None:
            arrived.release()
            go.wait(10)

    with seams.hooked("budget.reserved", stop_chosen):
        grant = threading.Thread(target=n.budget._reserve, args=(member, 10))  # a round's
        stopped[grant] = threading.Event()
        grant.start()
        assert arrived.acquire(timeout=5)
        assert units.frontier >= 14 and n.share("a") == 4  # locked, not yet published
        n.store("a", 1)  # a Store's growth on this thread: published
        assert n.share("a") == 5
        grower = threading.Thread(target=n.store, args=("a", 1))
        stopped[grower] = threading.Event()
        grower.start()
        assert arrived.acquire(timeout=5)
        stopped[grant].set()
        grant.join(5)
        assert not grant.is_alive() and n.share("a") == 5
        assert units.frontier >= 6, "a page another growth reserved was unlocked under it"
        stopped[grower].set()
        grower.join(5)
    assert n.share("a") == 6
    assert 6 <= units.frontier < 14, "what lies above the limit was not given back"
    assert member.reserved_top == 0 and member.growing == 0


def _stopped_grant(n, member, pages: int):  # type: ignore[no-untyped-def]
    """A rebalance's grant on a thread of its own, stopped with its pages reserved."""
    import threading

    from hicache import seams

    go, there = threading.Event(), threading.Event()
    grant = threading.Thread(target=n.budget._reserve, args=(member, pages))

    def stop() -> None:
        if threading.current_thread() is grant:
            there.set()
            go.wait(10)

    hook = seams.hooked("budget.reserved", stop)
    hook.__enter__()
    grant.start()
    assert there.wait(5)
    return grant, go, hook


def test_a_grant_does_not_publish_over_a_limit_that_went_down_and_back(node) -> None:  # type: ignore[no-untyped-def]
    """A grant locks ten pages above a's limit and stops; a grows by two, then a round
    shrinks it back to where the grant began (unlocking every unit above). The limit is
    where it was, but what the grant locked is not: it must not publish it."""
    n, units, member = _locked_pool_full_at_its_floor(node)
    grant, go, hook = _stopped_grant(n, member, 10)
    try:
        n.store("a", 2)
        assert n.share("a") == 6
        n.budget._shrink(member, 4)
        assert n.share("a") == 4 and units.frontier < 14  # the grant's pages unlocked
    finally:
        go.set()
        grant.join(5)
        hook.__exit__(None, None, None)
    assert units.frontier >= n.share("a"), (
        f"limit {n.share('a')} published over pages locked below {units.frontier} only")
    assert member.growing == 0 and member.reserved_top == 0


def test_leaving_waits_for_a_growth_still_reserving(node) -> None:  # type: ignore[no-untyped-def]
    """A pool leaves the budget (it is being deleted) while a grant to it is reserving: the
    leave returns only once that growth ended, which then publishes and frees nothing."""
    import threading

    n = node(24, config(PB, pools=(PoolShare("*", floor_bytes=4 * PB),)))
    n.add("a")
    member = n.budget._members["a"]
    grant, go, hook = _stopped_grant(n, member, 4)
    try:
        leaving = threading.Thread(target=n.budget.leave, args=("a",))
        leaving.start()
        leaving.join(0.3)
        assert leaving.is_alive(), "left while a growth of the pool was still reserving"
    finally:
        go.set()
        grant.join(5)
        hook.__exit__(None, None, None)
    leaving.join(5)
    assert not leaving.is_alive() and n.share("a") == 4 and member.growing == 0


def test_a_pool_that_cannot_lock_more_evicts_its_own_and_grows_once_it_can(node) -> None:  # type: ignore[no-untyped-def]
    pinner = StrictPinner()
    pb = spec(mha(layers=2, heads=8, dim=128), page_size=4, size_tokens=4 * PAGES).page_bytes
    n = node(64, config(pb, pools=(PoolShare("*", floor_bytes=4 * pb),)), pinner)
    a = n.add("a")
    units = n.pools["a"].pin_units
    assert units is not None and n.share("a") == 4
    pinner.limit = pinner.nbytes  # the locked-memory limit reached
    n.store("a", 10)
    assert n.share("a") == 4 and a.stats.evicted_by["store"] == 6
    assert units.frontier >= 4 and pinner.nbytes == pinner.limit
    pinner.limit = None
    n.store("a", 1)
    assert n.share("a") == 4, "no unit is tried again while the refusal is recent"
    units._refused_until = 0.0
    n.store("a", 4)
    assert n.share("a") >= 8 and units.frontier >= n.share("a")
    assert all(np.array_equal(read(n.pools["a"], p), pattern(k, pb))
               for k, p in a.index.ready.items())


def test_memory_goes_to_the_pool_whose_pages_are_worth_more(node) -> None:  # type: ignore[no-untyped-def]
    n = node(24, config(PB))
    n.add("a"), n.add("b")
    n.store("a", 12)
    n.store("b", 12)  # the budget is full: a's pages are older than b's
    n.now += 100
    n.store("b", 4)  # b evicts its own and wants more
    n.budget.rebalance()
    assert n.share("b") > 12 and n.share("a") < 12, "the older pages gave way"
    assert n.caches["a"].stats.evicted_by["budget"] > 0
    before = n.share("b")
    n.now += 1
    for k in list(n.caches["a"].index.ready)[:2]:  # a's pages become the hot ones
        n.caches["a"].lookup([k], touch=True)
    n.store("a", 8)
    n.budget.rebalance()  # a's oldest page is now younger than b's: b gives
    assert n.share("b") < before


def test_a_tenant_at_its_quota_evicts_its_own_pages(node) -> None:  # type: ignore[no-untyped-def]
    n = node(64, config(PB, pools=(PoolShare("t-*", tenant="t"), PoolShare("u", tenant="u")),
                        tenants=(TenantQuota("t", quota_bytes=20 * PB),)))
    n.add("t-1"), n.add("t-2"), n.add("u")
    n.store("u", 8)
    n.store("t-2", 6)
    n.store("t-1", 30)
    assert n.tenant_pages("t") == 20, "the quota holds"
    assert n.caches["t-1"].stats.evicted_by["store"] > 0
    for _ in range(5):
        n.store("t-1", 4)
        n.budget.rebalance()
    assert n.tenant_pages("t") <= 20
    assert n.share("t-2") < 6, "its own other pool gave way"
    assert n.caches["u"].stats.evicted == 0 and len(n.caches["u"].index.ready) == 8


def test_no_tenant_is_taken_below_its_guaranteed_share(node) -> None:  # type: ignore[no-untyped-def]
    n = node(32, config(PB, pools=(PoolShare("t", tenant="t"), PoolShare("u", tenant="u")),
                        tenants=(TenantQuota("u", guaranteed_bytes=10 * PB),)))
    n.add("t"), n.add("u")
    n.store("u", 16)  # u's pages are old
    n.now += 1000
    for _ in range(12):
        n.store("t", 6)
        n.budget.rebalance()
    assert n.share("u") == 10, "u keeps its guarantee however old its pages are"
    assert n.share("t") == 22


def test_a_tenant_below_its_fair_share_takes_from_one_above_whatever_the_ages(
        node) -> None:  # type: ignore[no-untyped-def]
    n = node(32, config(PB, pools=(PoolShare("t", tenant="t"), PoolShare("u", tenant="u"))))
    n.add("t"), n.add("u")
    n.store("u", 32)  # u holds everything, and its pages are the younger
    for i in range(10):
        n.now = 100.0 + 10 * i  # t's pages are all older than u's
        n.store("t", 4)
        n.now = 5000.0
        n.budget.rebalance()
    assert n.share("t") == 16 and n.share("u") == 16  # the fair share: half each


def test_floors_are_admitted_while_they_fit_and_a_new_floor_is_taken_back(node) -> None:  # type: ignore[no-untyped-def]
    n = node(20, config(PB, pools=(PoolShare("*", floor_bytes=8 * PB),)))
    n.add("a")
    n.store("a", 20)  # a grows over the whole budget
    assert n.share("a") == 20
    n.add("b")  # its floor comes back from a
    assert n.share("b") == 8 and n.share("a") == 12
    with pytest.raises(HostMemoryInsufficient) as err:
        n.add("c")
    assert err.value.metadata["committed_bytes"] == str(16 * PB)


def test_no_pool_grows_into_the_dip_of_a_shrink_in_progress(node) -> None:  # type: ignore[no-untyped-def]
    """While a pool is being shrunk its limit dips to the size asked for, then comes back up
    above its pages still in use; another pool's Store growing in between must not take that
    dip (the budget would end over-committed). Stopped at the seam between the two."""
    import threading

    from hicache import seams

    n = node(24, config(PB))
    a = n.add("a")
    n.add("b")
    n.store("a", 20)
    n.store("b", 4)
    reading = a.begin_load([max(a.index.ready, key=lambda k: a.index.ready[k])])  # page 19 in use
    with seams.Pause("resize.moved") as stop:
        t = threading.Thread(target=n.budget._shrink, args=(n.budget._members["a"], 8))
        t.start()
        assert stop.wait_reached(10)
        assert n.pools["a"].allocator.limit == 8  # the dip
        n.store("b", 12)  # b's Stores grow from the slack only
        assert n.share("b") <= 24 - 20, "b grew into a's dip"
        stop.release()
        t.join(10)
    assert n.share("a") == 20  # page 19 is still read: the share stays above it
    assert n.share("a") + n.share("b") <= 24
    a.finish_load(reading)


class BudgetMachine(RuleBasedStateMachine):
    """Stores into four pools of two tenants, time passing, rounds; the budget's promises
    and every key's bytes hold after each step."""

    pinned = False
    """Pools page-locked by units that follow their shares (a GPU host)."""

    def __init__(self) -> None:
        super().__init__()
        self.pinner = StrictPinner() if self.pinned else None
        pb = spec(mha(layers=2, heads=8, dim=128) if self.pinned else mha(layers=2),
                  page_size=4, size_tokens=4 * PAGES).page_bytes
        self.node = Node(48, config(
            pb, pools=(PoolShare("t-*", floor_bytes=4 * pb, ceiling_bytes=24 * pb, tenant="t"),
                       PoolShare("u-*", floor_bytes=2 * pb, tenant="u")),
            tenants=(TenantQuota("t", quota_bytes=36 * pb),
                     TenantQuota("u", guaranteed_bytes=12 * pb))), pinner=self.pinner)
        for name in ("t-1", "t-2", "u-1", "u-2"):
            self.node.add(name)
        self.removed: set[bytes] = set()

    def teardown(self) -> None:
        self.node.close()

    @rule(pool=st.sampled_from(["t-1", "t-2", "u-1", "u-2"]), n=st.integers(1, 8))
    def store(self, pool: str, n: int) -> None:
        self.node.store(pool, n)

    @rule(seconds=st.floats(0, 100))
    def wait(self, seconds: float) -> None:
        self.node.now += seconds

    @rule(pool=st.sampled_from(["t-1", "u-1"]), i=st.integers(0, 50))
    def remove(self, pool: str, i: int) -> None:
        keys = sorted(self.node.caches[pool].index.ready)
        if keys:
            key = keys[i % len(keys)]
            self.node.caches[pool].remove([key])
            self.removed.add(key)

    @rule()
    def rebalance(self) -> None:
        u_before = self.node.tenant_pages("u")
        u_budget = sum(self.node.caches[p].stats.evicted_by["budget"] for p in ("u-1", "u-2"))
        self.node.budget.rebalance()
        u_after = self.node.tenant_pages("u")
        taken = sum(self.node.caches[p].stats.evicted_by["budget"]
                    for p in ("u-1", "u-2")) > u_budget
        if taken and u_after < u_before:
            assert u_after >= min(12, u_before), "u was taken below its guarantee"

    @invariant()
    def promises(self) -> None:
        node = self.node
        shares = {v.pool: v for v in node.budget.shares()}
        pb = node.page_bytes
        assert sum(v.share_bytes for v in shares.values()) <= 48 * pb, "over the budget"
        for v in shares.values():
            assert v.floor_bytes <= v.share_bytes <= v.ceiling_bytes, v
            assert v.used_bytes <= v.share_bytes, v
        assert node.tenant_pages("t") <= 36, "over t's quota"
        for name, cache in node.caches.items():
            node.pools[name].allocator.memcheck()
            for key, page in cache.index.ready.items():
                assert key not in self.removed
                assert np.array_equal(read(node.pools[name], page), pattern(key, pb)), key

    @invariant()
    def locked_memory_follows_the_shares(self) -> None:
        if self.pinner is None:
            return
        locked = dict(self.pinner.ranges)
        for pool in self.node.pools.values():
            units, base = pool.pin_units, pool.memory.address  # type: ignore[union-attr]
            assert units is not None
            limit = pool.allocator.limit
            need = units._first < limit
            mine = {int(a) + base: int(b - a) for a, b in
                    zip(units._starts[need], units._ends[need], strict=True)}
            assert {a: locked.pop(a) for a in mine if a in locked} == mine, \
                f"{pool.spec.name}: a page below its share is not locked"
            assert units.locked == int(need.sum()), f"{pool.spec.name}: more locked than needed"
            assert pool.pinned_bytes == sum(mine.values())
        assert not locked, "memory locked for no pool"


BudgetMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40,
                                           deadline=None)
TestBudgetMachine = BudgetMachine.TestCase


class PinnedBudgetMachine(BudgetMachine):
    """The same, on a GPU host: each pool's locked memory is exactly what its share needs,
    after every step (``core.pin_units``)."""

    pinned = True


PinnedBudgetMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=40,
                                                 deadline=None)
TestPinnedBudgetMachine = PinnedBudgetMachine.TestCase
