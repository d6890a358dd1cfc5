"""The ``reuse`` eviction policy (``hicached.cache.reuse_lru``): its victim order against a
reference model, a pool using it under stores, loads, holds and removals, the margin it learns,
and its hit rate beside LRU's on request streams.

The model orders every evictable key by its effective time (the batch's time, plus the margin
for a reused key), a key used once before a reused one at the same time, and by insertion
inside a queue (a batch entering deepest first); it reads the margin from the policy (the
shadows choose it; a rule also sets it, as random keys seldom make them) and checks it is one
of the candidates.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache.errors import KeyNotFound
from hicache_bench.trace_policies import Lru, Reuse, replay
from hicached.cache import _queues, reuse_lru
from hicached.cache.holds import Holder, HoldPolicy
from hicached.cache.index_types import NO_SPACE, STORED
from hicached.cache.pool_cache import PoolCache
from hicached.cache.reuse_lru import GHOST, THETAS, ReuseLRU
from hicached.core.pool import HostPool
from tests.helpers import make_pool, mha, spec

CAP = 8
UNIVERSE = [b"r%02d" % i for i in range(24)]


class PolicyModel:
    """The rule in the plainest form: entries (key, queue, time, order, wall)."""

    def __init__(self) -> None:
        self.entries: dict[bytes, tuple[int, int, int, float]] = {}
        """key -> (queue: 0 once / 1 reused, time, insertion number, wall time)."""
        self.ghost: list[int] = []
        self.time = 0
        self.seq = 0

    def _put(self, key: bytes, queue: int, t: int, wall: float) -> None:
        self.seq += 1
        self.entries[key] = (queue, t, self.seq, wall)

    def add(self, keys: list[bytes], wall: float) -> None:
        t, self.time = self.time, self.time + len(keys)
        for k in reversed(keys):
            self.entries.pop(k, None)
            if hash(k) in self.ghost:
                self.ghost.remove(hash(k))
                self._put(k, 1, t, wall)
            else:
                self._put(k, 0, t, wall)

    def back(self, keys: list[bytes], wall: float) -> None:
        t, self.time = self.time, self.time + len(keys)
        for k in reversed(keys):
            self.entries.pop(k, None)
            self._put(k, 1, t, wall)

    def touch(self, keys: list[bytes], wall: float) -> None:
        t, self.time = self.time, self.time + len(keys)
        for k in reversed(keys):
            if k in self.entries:
                del self.entries[k]
                self._put(k, 1, t, wall)

    def order(self, theta: float) -> list[bytes]:
        margin = theta * CAP
        return sorted(self.entries, key=lambda k: (
            self.entries[k][1] + margin * self.entries[k][0], self.entries[k][0],
            self.entries[k][2]))

    def pop(self, n: int, busy: set[bytes], theta: float) -> list[bytes]:
        order = self.order(theta)
        out = [k for k in order if k not in busy][:n]
        out += [k for k in order if k in busy][:n - len(out)]
        for k in out:
            del self.entries[k]
            if hash(k) not in self.ghost:
                self.ghost.append(hash(k))
        del self.ghost[:max(len(self.ghost) - GHOST * CAP, 0)]
        return out


class PolicyMachine(RuleBasedStateMachine):
    """``ReuseLRU`` driven at random, beside ``PolicyModel``."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = ReuseLRU(lambda: CAP)
        self.model = PolicyModel()
        self.wall = 0.0

    def _tick(self) -> float:
        self.wall += 1.0
        return self.wall

    @rule(keys=st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=5, unique=True))
    def add(self, keys: list[bytes]) -> None:
        keys = [k for k in keys if k not in self.model.entries]
        wall = self._tick()
        self.policy.add(keys, wall)
        self.model.add(keys, wall)

    @rule(keys=st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=5, unique=True))
    def back(self, keys: list[bytes]) -> None:
        for k in keys:  # a load takes them out first
            self.policy.discard(k)
            self.model.entries.pop(k, None)
        wall = self._tick()
        self.policy.back(keys, wall)
        self.model.back(keys, wall)

    @rule(keys=st.lists(st.sampled_from(UNIVERSE), max_size=6, unique=True))
    def touch(self, keys: list[bytes]) -> None:
        wall = self._tick()
        self.policy.touch(keys, wall)
        self.model.touch(keys, wall)

    @rule(theta=st.sampled_from(THETAS))
    def margin_chosen(self, theta: float) -> None:
        """What the shadows would do on evidence (random keys seldom give any)."""
        self.policy._shadows.theta = theta

    @rule(key=st.sampled_from(UNIVERSE))
    def discard(self, key: bytes) -> None:
        self.policy.discard(key)
        self.model.entries.pop(key, None)

    @precondition(lambda self: len(self.model.entries) > 0)
    @rule(n=st.integers(1, 4), busy=st.sets(st.sampled_from(UNIVERSE), max_size=4))
    def pop_oldest(self, n: int, busy: set[bytes]) -> None:
        theta = self.policy.theta
        want = self.model.pop(n, busy, theta)
        used: list[float] = []
        got = self.policy.pop_oldest(n, busy, used)
        assert got == want
        assert len(used) == len(got)

    @invariant()
    def same_keys_same_order(self) -> None:
        assert self.policy.theta in THETAS
        assert len(self.policy) == len(self.model.entries)
        for k in UNIVERSE:
            assert (k in self.policy) == (k in self.model.entries)
        order = self.model.order(self.policy.theta)
        assert self.policy.oldest(len(order) + 1) == order
        first = self.policy.oldest_use()
        assert first == (self.model.entries[order[0]][3] if order else None)


PolicyMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60,
                                           deadline=None)
test_the_policy_orders_victims_as_its_rule_says = PolicyMachine.TestCase


QUEUE_KEYS = [b"q%02d" % i for i in range(30)]


class QueuesMachine(RuleBasedStateMachine):
    """The C queues and ghost against ``PyQueues``, call by call, also out of the pool's
    contract (keys already held, a key twice in a batch) and with the ghost's bound moving
    (its tables grow, squeeze and shrink)."""

    def __init__(self) -> None:
        super().__init__()
        self.native = _queues.Queues()
        self.python = reuse_lru.PyQueues()
        self.wall = 0.0

    def _both(self, verb: str, *args: object) -> object:
        got = getattr(self.native, verb)(*args)
        assert got == getattr(self.python, verb)(*args), verb
        return got

    @rule(verb=st.sampled_from(["add", "back", "touch"]),
          keys=st.lists(st.sampled_from(QUEUE_KEYS), max_size=8))
    def batch(self, verb: str, keys: list[bytes]) -> None:
        self.wall += 0.5
        self._both(verb, keys, self.wall)

    @rule(key=st.sampled_from(QUEUE_KEYS))
    def discard(self, key: bytes) -> None:
        self._both("discard", key)

    @rule(n=st.integers(0, 12), margin=st.sampled_from([0.0, 1.5, 7.0, 1e9]),
          busy=st.sets(st.sampled_from(QUEUE_KEYS), max_size=6), ask=st.booleans(),
          bound=st.integers(0, 80))
    def pop(self, n: int, margin: float, busy: set[bytes], ask: bool, bound: int) -> None:
        used: tuple[list[float], list[float]] | tuple[None, None] = \
            ([0.25], [0.25]) if ask else (None, None)
        got = self.native.pop(n, margin, busy, used[0], bound)
        assert got == self.python.pop(n, margin, busy, used[1], bound)
        assert used[0] == used[1]
        assert self.native.ghost_len() <= bound

    @rule(bad=st.sampled_from([[b"ok", "str"], [b"ok", 5], 7]))
    def bad_batch_changes_nothing(self, bad: object) -> None:
        before = self.native.oldest(100, 0.0), self.native.held()
        for q in (self.native, self.python):
            with pytest.raises(TypeError):
                q.add(bad, 0.0)  # type: ignore[arg-type]
        assert (self.native.oldest(100, 0.0), self.native.held()) == before

    @invariant()
    def the_same(self) -> None:
        for margin in (0.0, 3.0, 1e9):
            assert self.native.oldest(100, margin) == self.python.oldest(100, margin)
            assert self.native.oldest_use(margin) == self.python.oldest_use(margin)
        assert self.native.oldest(3, 0.0) == self.python.oldest(3, 0.0)
        assert self.native.held() == self.python.held()
        assert self.native.ghost_len() == self.python.ghost_len()
        assert len(self.native) == len(self.python)
        for k in QUEUE_KEYS[:6]:
            assert (k in self.native) == (k in self.python)


QueuesMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=80,
                                           deadline=None)
test_the_native_queues_do_what_the_python_ones_do = QueuesMachine.TestCase


def test_the_native_queues_are_built() -> None:
    assert reuse_lru.Queues.__module__ == "hicached.cache._queues"  # setup.py builds it


def test_the_native_queues_match_python_on_a_long_stream_of_many_keys() -> None:
    """Tens of thousands of calls over 3,000 keys, the ghost's bound rising and falling
    (its tables grown, squeezed and given back), against the reference."""
    rng = random.Random(7)
    native, python = _queues.Queues(), reuse_lru.PyQueues()
    keys = [b"k%05d" % i for i in range(3000)]
    bound = 400
    for step in range(20_000):
        if step % 2000 == 0:
            bound = rng.choice([0, 40, 400, 4000])
        r = rng.random()
        batch = rng.sample(keys, rng.randint(1, 64))
        verb = "add" if r < 0.45 else "back" if r < 0.6 else "touch" if r < 0.75 else ""
        if verb:
            getattr(native, verb)(batch, float(step))
            getattr(python, verb)(batch, float(step))
        elif r < 0.8:
            native.discard(batch[0])
            python.discard(batch[0])
        else:
            n, margin = rng.randint(1, 80), rng.choice([0.0, 500.0, 5000.0])
            busy = set(rng.sample(keys, 20))
            assert native.pop(n, margin, busy, None, bound) == \
                python.pop(n, margin, busy, None, bound)
        if step % 500 == 0:
            assert native.oldest(10_000, 100.0) == python.oldest(10_000, 100.0)
            assert native.ghost_len() == python.ghost_len()
    assert native.held() == python.held()
    assert 0 < native.nbytes() < 600_000


def test_the_native_queues_refuse_what_they_cannot_take() -> None:
    for q in (_queues.Queues(), reuse_lru.PyQueues()):
        q.add([b"a", b"b"], 1.0)
        with pytest.raises(TypeError):
            q.discard("a")  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            q.touch([b"a", None], 2.0)  # type: ignore[list-item]
        with pytest.raises(ValueError):
            q.pop(1, 0.0, (), None, -1)
        assert q.held() == (2, 0) and q.oldest(5, 0.0) == [b"b", b"a"]
        assert "a" not in q and b"a" in q
    with pytest.raises(TypeError):
        _queues.Queues().pop(1, 0.0, (), (), 4)  # type: ignore[arg-type]


def test_a_batch_goes_deepest_first_and_a_reused_page_outlives_a_newer_one() -> None:
    p = ReuseLRU(lambda: 4)
    p.add([b"a", b"b", b"c"], 1.0)  # one request's chain
    assert p.oldest(3) == [b"c", b"b", b"a"]  # its head the most recent
    p.discard(b"a")  # a load takes it out ...
    p.back([b"a"], 2.0)  # ... and gives it back: reused
    p.add([b"x"], 3.0)
    assert p.oldest(4) == [b"c", b"b", b"a", b"x"]  # theta 0: plain recency between queues
    p._shadows.theta = 1.0  # a reused page counts a capacity (4) younger
    p.add([b"y", b"z"], 4.0)
    assert p.oldest(6) == [b"c", b"b", b"x", b"z", b"y", b"a"]
    assert p.pop_oldest(2) == [b"c", b"b"]
    p.add([b"b"], 5.0)  # stored again soon after its eviction: enters as reused
    assert p.oldest(6)[-1] == b"b"


# -- a pool using it ----------------------------------------------------------------------------

@pytest.fixture
def pool() -> Iterator[HostPool]:
    p = make_pool(spec(mha(), page_size=4, size_tokens=4 * CAP))
    yield p
    p.close()


KEYS = [b"p%02d" % i for i in range(20)]


class PoolMachine(RuleBasedStateMachine):
    """A pool of ``CAP`` pages with ``eviction="reuse"``: stores, touching lookups, loads,
    holds, removals at random; never more ready keys than pages, a held key is never evicted,
    a removed key never hits until stored again, and the keys ready are exactly the model's
    (stored, minus what eviction reported and what was removed)."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(spec(mha(), page_size=4, size_tokens=4 * CAP))
        self.cache = PoolCache(self.pool, policy=HoldPolicy(max_held_fraction=0.5),
                               eviction="reuse")
        self.ready: set[bytes] = set()
        self.held: set[bytes] = set()

    def teardown(self) -> None:
        self.pool.close()

    def _evicted(self) -> set[bytes]:
        now = set(self.cache.snapshot())
        gone = self.ready - now
        self.ready = now
        return gone

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6, unique=True))
    def store(self, keys: list[bytes]) -> None:
        ticket = self.cache.begin_store(keys)
        self.cache.finish_store(ticket, True)
        stored = {k for k, s in zip(keys, ticket.status, strict=True) if s == STORED}
        assert not any(s == NO_SPACE for s in ticket.status) or len(self.held) > 0
        gone = (self.ready | stored) - set(self.cache.snapshot())
        assert not gone & self.held, "a held key was evicted"
        self.ready = (self.ready | stored) - gone

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6, unique=True))
    def lookup(self, keys: list[bytes]) -> None:
        _, tiers = self.cache.lookup(keys, touch=True)
        assert [t == 1 for t in tiers] == [k in self.ready for k in keys]

    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        if not self.ready:
            return
        keys = data.draw(st.lists(st.sampled_from(sorted(self.ready)), min_size=1,
                                  max_size=4, unique=True))
        pages = self.cache.begin_load(keys)
        self.cache.finish_load(pages)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    def hold(self, keys: list[bytes]) -> None:
        _, _, held = self.cache.lookup_held(keys, Holder(1, 60.0))
        self.held |= set(keys[:held])

    @rule()
    def release(self) -> None:
        self.cache.holds.release(1)
        self.held.clear()

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True))
    def remove(self, keys: list[bytes]) -> None:
        self.cache.remove(keys)
        self.ready -= set(keys)
        self.held -= set(keys)
        for k in keys:
            prefix, tiers = self.cache.lookup([k], touch=True)
            assert prefix == 0 and tiers == b"\x00", "a removed key hit"
            with pytest.raises(KeyNotFound):
                self.cache.begin_load([k])

    @invariant()
    def within_capacity_and_as_modelled(self) -> None:
        assert self.cache.key_count <= CAP
        assert set(self.cache.snapshot()) == self.ready
        assert self.cache.index.evictable == len(self.ready - self.held)


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                         deadline=None)
test_a_pool_evicting_by_reuse_keeps_every_promise = PoolMachine.TestCase


# -- the margin it learns, and what it hits --------------------------------------------------

def _documents(n: int, seed: int) -> list[list[int]]:
    """Half the requests read one of 300 documents (10 blocks each) in turn, half are one-shot
    prompts: a working set larger than a small cache, where recency alone keeps nothing."""
    rng = random.Random(seed)
    docs = [list(range(i * 10, i * 10 + 10)) for i in range(300)]
    fresh = 1 << 30
    out: list[list[int]] = []
    for j in range(n):
        if rng.random() < 0.5:
            out.append(list(docs[j % 300]))
        else:
            k = rng.randint(5, 20)
            out.append(list(range(fresh, fresh + k)))
            fresh += k
    return out


def _bursts(n: int, seed: int) -> list[list[int]]:
    """Each prompt is asked again a few times right after it appears, then never: recency is
    all there is to know."""
    rng = random.Random(seed)
    out: list[list[int]] = []
    live: list[list[int]] = []
    fresh = 0
    while len(out) < n:
        if live and rng.random() < 0.6:
            out.append(list(rng.choice(live[-4:])))
        else:
            k = rng.randint(4, 30)
            live.append(list(range(fresh, fresh + k)))
            fresh += k
            out.append(list(live[-1]))
    return out


def test_where_frequency_pays_the_pool_learns_a_margin_and_beats_lru() -> None:
    requests = _documents(4000, 3)
    capacity = 1500  # half the documents' blocks
    reuse = Reuse(capacity)
    got = replay(reuse, requests)
    lru = replay(Lru(capacity), requests)
    assert reuse.policy.theta > 0
    assert got.rate > lru.rate + 0.10, (got.rate, lru.rate)


def test_where_recency_is_all_it_stays_at_lru() -> None:
    requests = _bursts(4000, 5)
    for capacity in (40, 200, 1000):
        reuse = Reuse(capacity)
        got = replay(reuse, requests)
        assert reuse.policy.theta == THETAS[0]
        assert got.rate >= replay(Lru(capacity), requests).rate


def test_the_sample_follows_the_pool_size() -> None:
    """A pool larger than the sample replays a share of its keys; resized past twice the
    sample, the shadows are resampled."""
    p = ReuseLRU(lambda: size)
    size = 100 * reuse_lru.SAMPLE_PAGES
    keys = [b"s%06d" % i for i in range(20_000)]
    p.add(keys, 0.0)
    shadows = p._shadows
    assert shadows._rate == pytest.approx(0.01)
    held = sum(shadows._shadows.held(0))
    assert 100 < held < 400  # about 1 % of 20,000
    size = 2 * reuse_lru.SAMPLE_PAGES
    p.add([b"t"], 0.0)
    assert shadows._rate == 0.5 and shadows._shadows.held(0) == (0, 0)


def test_a_small_pool_is_replayed_whole_and_its_shadows_grow_with_it() -> None:
    """Below the sample every key is replayed, in shadows made for twice the pool (small
    tables); grown past that, they are made again for the new size."""
    size = 100
    p = ReuseLRU(lambda: size)
    p.add([b"a%d" % i for i in range(150)], 0.0)
    shadows = p._shadows
    assert shadows._rate == 1.0 and shadows._room == 200
    assert sum(shadows._shadows.held(0)) == 100
    size = 200  # within the room: kept, the same ids held
    p.add([b"b"], 0.0)
    assert sum(shadows._shadows.held(0)) == 101 and shadows._room == 200
    size = 300  # past it: made again
    p.add([b"c"], 0.0)
    assert shadows._room == 600 and sum(shadows._shadows.held(0)) == 1


def test_the_native_shadows_are_built() -> None:
    assert reuse_lru.Shadows.__module__ == "hicached.cache._shadows"  # setup.py builds it


@given(st.lists(st.lists(st.integers(0, 40), max_size=8), max_size=60),
       st.lists(st.integers(1, 12), min_size=1, max_size=4), st.sampled_from([0, 1, 5]))
@settings(max_examples=300, deadline=None)
def test_the_native_shadows_hit_what_the_python_ones_hit(batches: list[list[int]],
                                                         capacities: list[int],
                                                         lag: int) -> None:
    """The C shadows (on their thread when lag > 0) against their Python reference, batch by
    batch, on small id sets (hits, evictions and ghost returns all happen), capacities
    changing between batches: the same results, returned at the same submits."""
    native = reuse_lru.Shadows(THETAS, 12, lag)
    python = reuse_lru.PyShadows(THETAS, 12, lag)
    assert native.lag == python.lag == lag
    for n, ids in enumerate(batches):
        capacity = capacities[n % len(capacities)]
        native.set_capacity(capacity)
        python.set_capacity(capacity)
        got = native.submit(ids)
        assert got == python.submit(ids), n
        assert len(got) == (n + 1 > lag)
        for i in range(len(THETAS)):
            assert native.held(i) == python.held(i)


@given(st.lists(st.lists(st.integers(0, 200), max_size=16), min_size=1, max_size=200))
@settings(max_examples=40, deadline=None)
def test_the_shadows_thread_returns_what_replaying_inline_returns(
        batches: list[list[int]]) -> None:
    """A lag changes when results come back, never what they are: a thread's run against
    the inline one, with no look at the state between submits (the thread runs free)."""
    inline = reuse_lru.Shadows(THETAS, 64)
    threaded = reuse_lru.Shadows(THETAS, 64, 7)
    want = [r for ids in batches for r in inline.submit(ids)]
    got = [r for ids in batches for r in threaded.submit(ids)]
    assert got == want[:len(got)] and len(got) == max(len(batches) - 7, 0)
    assert [threaded.held(i) for i in range(len(THETAS))] == \
        [inline.held(i) for i in range(len(THETAS))]


def test_a_submit_waits_for_a_thread_lag_batches_behind_and_no_longer() -> None:
    """The thread stopped between batches: submits within the lag return at once, the one
    past it waits (other threads run meanwhile), and returns what is due once the thread
    goes on."""
    shadows = reuse_lru.Shadows(THETAS, 16, 2)
    assert shadows.pause(True)
    assert shadows.submit([1, 2]) == [] and shadows.submit([3]) == []
    got: list[list[tuple[int, ...]]] = []
    waiter = threading.Thread(target=lambda: got.append(shadows.submit([1])))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and got == []  # waiting, and this thread ran meanwhile
    assert shadows.pause(False)
    waiter.join(10)
    assert got == [[(2,) + (0,) * len(THETAS)]]
    assert shadows.submit([2]) == [(1,) + (0,) * len(THETAS)]
    assert shadows.submit([9]) == [(1,) + (1,) * len(THETAS)]  # 1 was held: a hit


def test_the_shadows_thread_blocks_the_process_s_signals() -> None:
    """A signal to the daemon goes to a thread that handles it, never to the shadows'."""
    tasks = set(os.listdir("/proc/self/task"))
    shadows = reuse_lru.Shadows(THETAS, 16, 4)
    new = set(os.listdir("/proc/self/task")) - tasks
    assert len(new) == 1
    status = Path(f"/proc/self/task/{new.pop()}/status").read_text()
    blocked = int(next(line for line in status.splitlines()
                       if line.startswith("SigBlk:")).split()[1], 16)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
        assert blocked >> (sig - 1) & 1, sig
    del shadows


def test_a_policy_under_threads_and_resizes_keeps_its_keys() -> None:
    """Stress: threads drive one policy under a lock (as a pool's calls do) while its size
    swings past the shadows' room, so shadows (each with its thread) are made and dropped
    while earlier ones still replay; every key is accounted for at the end."""
    size = [64]
    policy = ReuseLRU(lambda: size[0])
    lock = threading.Lock()
    held: set[bytes] = set()
    errors: list[BaseException] = []

    def drive(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for step in range(3000):
                keys = [b"%d-%d-%d" % (seed, step, i) for i in range(rng.randint(1, 48))]
                with lock:
                    if step % 97 == 0:
                        size[0] = rng.choice([16, 64, 3000, 50_000])
                    new = [k for k in keys if k not in held]
                    policy.add(new, float(step))
                    held.update(new)
                    over = len(held) - size[0]
                    if over > 0:
                        for k in policy.pop_oldest(over):
                            held.discard(k)
                    if held and rng.random() < 0.3:
                        k = next(iter(held))
                        policy.discard(k)
                        policy.back([k], float(step))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=drive, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert len(policy) == len(held) and all(k in policy for k in held)
    assert policy.theta in THETAS


def test_the_shadows_start_over_inline_in_a_forked_child() -> None:
    """A fork leaves the thread behind, perhaps in the middle of a batch: the child's
    shadows start over, empty, replayed on its own thread, the batches queued before the fork
    returned as results of no ids; the parent's thread goes on as before."""
    shadows = reuse_lru.Shadows(THETAS, 16, 1)
    assert shadows.submit([1, 2]) == []
    pid = os.fork()
    if pid == 0:  # the child
        ok = shadows.submit([1]) == [(0,) * (len(THETAS) + 1)] and \
            shadows.submit([5]) == [(1,) + (0,) * len(THETAS)] and \
            shadows.held(0) == (2, 0) and not shadows.pause(True)
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 20
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:  # the child hangs (waiting for a thread it has not)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    assert shadows.submit([1]) == [(2,) + (0,) * len(THETAS)]
    assert shadows.held(0) == (1, 1)


@given(st.lists(st.binary(max_size=40), max_size=30), st.integers(0, 1 << 32))
@settings(max_examples=200, deadline=None)
def test_the_native_shadows_sample_keys_as_the_python_ones(keys: list[bytes],
                                                          limit: int) -> None:
    """The same id per key, the same keys below the limit, the same hits."""
    native = reuse_lru.Shadows(THETAS, 12)
    python = reuse_lru.PyShadows(THETAS, 12)
    assert [native.key_id(k) for k in keys] == [python.key_id(k) for k in keys]
    for _ in range(2):
        assert native.submit_keys(keys, limit) == python.submit_keys(keys, limit)


def test_the_native_shadows_refuse_what_they_cannot_hold() -> None:
    for make in (reuse_lru.Shadows, reuse_lru.PyShadows):
        for bad_args in ((THETAS, 0), (THETAS, 1 << 25), (THETAS, 8, -1), (THETAS, 8, 5000)):
            with pytest.raises(ValueError):
                make(*bad_args)
    native = reuse_lru.Shadows(THETAS, 8)
    for bad in (0, 9):
        with pytest.raises(ValueError):
            native.set_capacity(bad)
    with pytest.raises(OverflowError):
        native.submit([1 << 32])
    with pytest.raises(TypeError):
        native.submit(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        native.submit_keys([b"k", "not bytes"], 1 << 32)  # type: ignore[list-item]
    assert native.submit_keys([b"k"], 0) == []  # nothing sampled: no batch
    big = list(range(1000))  # a large batch
    assert native.submit(big) == [(1000,) + (0,) * len(THETAS)]
    assert native.submit(big[:8]) == [(8,) + (8,) * len(THETAS)]  # deepest first: head stays


TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / \
    "mooncake_synthetic_trace.jsonl"


@pytest.mark.skipif(not TRACE.exists(), reason="the shared Mooncake trace is not beside the "
                                               "checkout")
def test_on_the_shared_trace_it_is_above_lru_arc_and_s3fifo() -> None:
    """The issue's trace at 1-20 % of its blocks, in-process (what the daemon hits exactly:
    test_trace_replay.py): above LRU everywhere, above the best of LRU, ARC and S3-FIFO at
    1-5 %."""
    from hicache_bench.trace import read_trace
    from hicache_bench.trace_policies import Arc, S3Fifo, next_uses

    requests = read_trace(str(TRACE))
    distinct = len({b for r in requests for b in r})
    uses = next_uses(requests)
    for share in (0.01, 0.02, 0.05, 0.10, 0.20):
        cap = int(distinct * share)
        ours = replay(Reuse(cap), requests, uses).rate
        lru = replay(Lru(cap), requests, uses).rate
        assert ours > lru, (share, ours, lru)
        if share <= 0.05:
            best = max(lru, replay(Arc(cap), requests, uses).rate,
                       replay(S3Fifo(cap), requests, uses).rate)
            assert ours > best, (share, ours, best)


def test_a_promoted_page_enters_as_used_and_outlives_the_pool_s_older_pages(
        pool: HostPool) -> None:
    """A promotion reads a page up for a load: it enters as used, the most recent, so that
    with a large margin a Store right after does not evict it before its load (or its hold)
    takes it, as it would a page stored and not used since."""
    cache = PoolCache(pool, eviction="reuse")
    old = [b"old%d" % i for i in range(CAP - 2)]
    for k in old:  # stored, then loaded: reused
        t = cache.begin_store([k])
        cache.finish_store(t, True)
        cache.finish_load(cache.begin_load([k]))
    policy = cache.index._evictable
    assert isinstance(policy, ReuseLRU)
    policy._shadows.theta = THETAS[-1]  # used pages kept far longer
    up = cache.begin_store([b"up0", b"up1"], "promotion")
    cache.finish_store(up, True)
    t = cache.begin_store([b"new"])  # the pool is full: one page must go
    cache.finish_store(t, True)
    ready = set(cache.snapshot())
    assert {b"up0", b"up1", b"new"} <= ready
    assert len(ready - set(old)) == 3 and len(set(old) - ready) == 1
