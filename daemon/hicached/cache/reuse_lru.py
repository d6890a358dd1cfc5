"""The eviction policy made for prefix caches: pages used again outlive pages used once by a
margin the pool learns, and of one batch the deepest pages go first.

What a prefix cache's pages are worth is not independent, and most are never used again: a
prompt's new pages are reused only when another request continues its prefix, while a page
already used twice (a shared system prompt's, a document asked again) comes back far more
often. And a page is worth nothing once the page before it in its chain is gone, so of one
request's pages the deepest should go first. Plain LRU ignores both. This policy keeps two
queues, each least recently used first:

- *once*: pages stored and not used since;
- *reused*: pages used again (a load, a touching Lookup, a Store naming them again) or stored
  again soon after their eviction (their key is in the *ghost*: the ids of the last
  ``GHOST`` x capacity keys evicted).

Time is the count of pages stored or used (the pool's own clock, not the wall's); every page of
one batch gets the batch's time and enters its queue deepest first, so the batch's head is
its most recent. The victim is the older of the two queues' heads, where a reused page counts
``theta`` x capacity younger than it is. ``theta`` 0 is LRU with a batch's tail first; a
larger one shields reused pages from a flood of pages used once. Which ``theta`` is right
depends on the workload and on the pool's size, so the pool learns it online: ``_Shadows``
replays a sample of the keys (a 32-bit hash of the key below a limit: ``SAMPLE_PAGES`` of
them at a time, whatever the pool's size) through one small shadow of the policy per
candidate in ``THETAS``, each scoring its hits on the sample's loads and stores with a decay;
the pool moves to the best only when it leads the current one by ``SWITCH_Z`` standard
deviations of the counts, so it starts as LRU and leaves it only on evidence. The shadows
run off the calls' path: a call hashes its keys and queues the sampled ids, a thread replays
them, and the scores take each batch's result ``LAG`` sampled batches later.

Measured on public request traces (benchmarks/RESULTS.md, "An eviction policy made for prefix
caches"): above LRU, ARC and S3-FIFO at every capacity on the shared Mooncake trace, twice
LRU's hit rate at 1 % of the blocks on that release's conversation trace, and not below LRU
on any trace tried.

Primitives:

- ``ReuseLRU(capacity)``: ``capacity()`` the pool's pages now. ``add(keys, now)`` (keys newly
  ready), ``back(keys, now)`` (keys whose readers ended: they were used), ``touch(keys, now)``
  (keys used while evictable), ``discard(key)``, ``pop_oldest(n, busy, used)``, ``oldest(n)``,
  ``oldest_use()``, ``len``, ``in`` (the same contract as ``lru.LRU``'s, batches in chain
  order); ``theta`` (the margin now, in capacities); ``nbytes()``. O(1) per key, plus, for
  the sampled keys only, O(1) per candidate on the shadows' thread.
- ``Queues()``: the two queues and the ghost (32-bit ids: the low half of the key's hash),
  keyed by bytes, with the policy's clock (``add`` / ``back`` / ``touch(keys, wall)``,
  ``discard``, ``pop(n, margin, busy, used, ghost_bound)``, ``oldest(n, margin)``,
  ``oldest_use(margin)``, ``held()``, ``ghost_len()``, ``nbytes()``, ``len``, ``in``): in C
  (``_queues``) or, where that is not built, ``PyQueues``, the same in Python and its
  reference.
- ``Shadows(thetas, max_capacity, lag)``: one shadow per margin, a stream of
  ``set_capacity(c)`` and batches (``submit(ids)``, ``submit_keys(keys, limit)``), each
  submit returning the results (ids, hits per shadow) of the batches ``lag`` before it, and
  ``held(i)``; in C (``_shadows``: replayed on a thread of its own, a few hash probes per
  sampled key and shadow) or, where that is not built, ``PyShadows``, the same in Python (on
  the caller's thread) and its reference. The results trail by a fixed count of batches, not
  by the thread's pace, so what a pool learns, and when, is the same either way.
- ``THETAS``, ``SAMPLE_PAGES``, ``GHOST``, ``HALF_LIFE``, ``SWITCH_Z``, ``LAG``: the constants
  above.
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterator, Sequence

THETAS = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)
"""The margins (in capacities) a pool chooses among; the first is where it starts."""
SAMPLE_PAGES = 1024
"""About how many pages each candidate's shadow holds (all of a smaller pool's)."""
GHOST = 4
"""Evicted keys remembered, as a multiple of the capacity (their ids only)."""
HALF_LIFE = 64.0
"""A candidate's hits lose half their weight after this many capacities of sampled
accesses."""
SWITCH_Z = 4.0
"""How many standard deviations a candidate's score must lead the current one's by."""
LAG = 64
"""How many sampled batches the shadows' results may trail the pool's calls by: they are
replayed on a thread of their own, off the calls' path, and a call waits for that thread only
when it is this far behind (a call's keys are then hashed and queued, no more)."""
_HASH_SPACE = 1 << 32


class PyQueues:
    """``_queues.Queues`` in Python (its reference, and where the C module is missing): the
    two queues, each key with (time, wall time), and the ghost of 32-bit ids."""

    def __init__(self) -> None:
        self._once: OrderedDict[bytes, tuple[int, float]] = OrderedDict()
        """Keys not used since stored: (time, wall time of the last use), oldest first."""
        self._reused: OrderedDict[bytes, tuple[int, float]] = OrderedDict()
        """Keys used again, the same way."""
        self._ghost: OrderedDict[int, None] = OrderedDict()
        """The ids of the keys evicted last, oldest first."""
        self._time = 0

    def _entry(self, keys: Sequence[bytes], wall: float) -> tuple[int, float]:
        if not all(isinstance(k, bytes) for k in keys):
            raise TypeError("keys are bytes")
        t = self._time
        self._time = t + len(keys)
        return t, wall

    def add(self, keys: Sequence[bytes], wall: float) -> None:
        entry = self._entry(keys, wall)
        ghost, once, reused = self._ghost, self._once, self._reused
        for key in reversed(keys):
            self.discard(key)
            h = hash(key) & 0xFFFFFFFF
            if h in ghost:
                del ghost[h]
                reused[key] = entry
            else:
                once[key] = entry

    def back(self, keys: Sequence[bytes], wall: float) -> None:
        entry = self._entry(keys, wall)
        for key in reversed(keys):
            self.discard(key)
            self._reused[key] = entry

    def touch(self, keys: Sequence[bytes], wall: float) -> None:
        entry = self._entry(keys, wall)
        once, reused = self._once, self._reused
        for key in reversed(keys):
            if key in once:
                del once[key]
            elif key in reused:
                del reused[key]
            else:
                continue
            reused[key] = entry

    def discard(self, key: bytes) -> None:
        if not isinstance(key, bytes):
            raise TypeError("keys are bytes")
        if self._once.pop(key, None) is None:
            self._reused.pop(key, None)

    def _order(self, margin: float) -> Iterator[tuple[bytes, float]]:
        """Every key, first victim first, with its wall time."""
        once = iter(self._once.items())
        reused = iter(self._reused.items())
        a = next(once, None)
        b = next(reused, None)
        while a is not None or b is not None:
            if b is None or (a is not None and a[1][0] <= b[1][0] + margin):
                assert a is not None
                yield a[0], a[1][1]
                a = next(once, None)
            else:
                yield b[0], b[1][1]
                b = next(reused, None)

    def oldest(self, n: int, margin: float) -> list[bytes]:
        out: list[bytes] = []
        for key, _ in self._order(margin):
            if len(out) >= n:
                break
            out.append(key)
        return out

    def oldest_use(self, margin: float) -> float | None:
        for _, wall in self._order(margin):
            return wall
        return None

    def pop(self, n: int, margin: float, busy: Collection[bytes], used: list[float] | None,
            ghost_bound: int) -> list[bytes]:
        if ghost_bound < 0:
            raise ValueError("ghost_bound is not negative")
        out: list[bytes] = []
        walls: list[float] = []
        passed: list[tuple[bytes, float]] = []
        for key, wall in self._order(margin):
            if len(out) >= n:
                break
            if busy and key in busy:
                passed.append((key, wall))
                continue
            out.append(key)
            walls.append(wall)
        for key, wall in passed[:max(n - len(out), 0)]:
            out.append(key)
            walls.append(wall)
        ghost = self._ghost
        for key in out:
            self.discard(key)
            ghost[hash(key) & 0xFFFFFFFF] = None
        for _ in range(max(len(ghost) - ghost_bound, 0)):
            ghost.popitem(last=False)
        if used is not None:
            used += walls
        return out

    def held(self) -> tuple[int, int]:
        return len(self._once), len(self._reused)

    def ghost_len(self) -> int:
        return len(self._ghost)

    def nbytes(self) -> int:
        """What its dictionaries hold (not the keys), as ``sys.getsizeof`` counts them."""
        return sum(sys.getsizeof(d) for d in (self._once, self._reused, self._ghost))

    def __len__(self) -> int:
        return len(self._once) + len(self._reused)

    def __contains__(self, key: object) -> bool:
        return key in self._once or key in self._reused


try:
    from hicached.cache import _queues
except ImportError:  # not built: the same in Python
    Queues: type[_queues.Queues] | type[PyQueues] = PyQueues
else:
    Queues = _queues.Queues


class ReuseLRU:
    """One pool's evictable keys (see the module's docstring); the pool's lock guards it."""

    def __init__(self, capacity: Callable[[], int]) -> None:
        self._capacity = capacity
        self._queues: _queues.Queues | PyQueues = Queues()
        self._shadows = _Shadows()

    @property
    def theta(self) -> float:
        return self._shadows.theta

    def __len__(self) -> int:
        return len(self._queues)

    def __contains__(self, key: object) -> bool:
        return key in self._queues

    # -- uses ------------------------------------------------------------------------------

    def add(self, keys: Sequence[bytes], now: float) -> None:
        """``keys`` (in chain order, none of them evictable now) became ready: evictable, as
        used once, unless evicted lately (then as reused)."""
        self._queues.add(keys, now)
        self._shadows.feed(keys, self._capacity())

    def back(self, keys: Sequence[bytes], now: float) -> None:
        """``keys`` (in chain order, none of them evictable now) are evictable again after
        being read: used."""
        self._queues.back(keys, now)
        self._shadows.feed(keys, self._capacity())

    def touch(self, keys: Sequence[bytes], now: float) -> None:
        """``keys`` (in chain order) were used; those evictable become the most recent."""
        self._queues.touch(keys, now)

    def discard(self, key: bytes) -> None:
        """``key`` is no longer evictable (being read, or gone)."""
        self._queues.discard(key)

    # -- eviction --------------------------------------------------------------------------

    def _margin(self) -> float:
        return self._shadows.theta * self._capacity()

    def oldest(self, n: int) -> list[bytes]:
        """Up to ``n`` keys in the order they would be evicted, left in place."""
        return self._queues.oldest(n, self._margin())

    def oldest_use(self) -> float | None:
        """When the next victim was last used (None when there is none)."""
        return self._queues.oldest_use(self._margin())

    def pop_oldest(self, n: int, busy: Collection[bytes] = (),
                   used: list[float] | None = None) -> list[bytes]:
        """Up to ``n`` victims, removed from the policy, their ids into the ghost. Keys in
        ``busy`` (being spilled) are passed over while others remain, and taken last in
        victim order. ``used``, if given, gets each popped key's last wall time."""
        capacity = self._capacity()
        return self._queues.pop(n, self._shadows.theta * capacity, busy, used,
                                GHOST * max(capacity, 1))

    def nbytes(self) -> int:
        """The memory its queues, ghost and shadows hold (the keys themselves not counted:
        the pool holds them)."""
        return self._queues.nbytes() + self._shadows.nbytes()


class _Shadow:
    """The policy with one fixed margin, over sampled key ids, holding ``capacity`` ids."""

    def __init__(self, theta: float) -> None:
        self.theta = theta
        self.capacity = 1
        self._once: OrderedDict[int, int] = OrderedDict()
        self._reused: OrderedDict[int, int] = OrderedDict()
        self._ghost: OrderedDict[int, None] = OrderedDict()
        self._time = 0

    def access(self, ids: list[int]) -> int:
        """One batch's sampled ids (chain order) used: held ones count as hits, the others
        are stored; returns the hits."""
        t = self._time
        self._time = t + len(ids)
        once, reused, ghost = self._once, self._reused, self._ghost
        hits = 0
        for i in reversed(ids):
            if i in once:
                del once[i]
            elif i in reused:
                del reused[i]
            else:
                while len(once) + len(reused) >= self.capacity:
                    self._evict()
                if i in ghost:
                    del ghost[i]
                    reused[i] = t
                else:
                    once[i] = t
                continue
            hits += 1
            reused[i] = t
        return hits

    def _evict(self) -> None:
        once, reused = self._once, self._reused
        if once and (not reused
                     or next(iter(once.values())) <= next(iter(reused.values()))
                     + self.theta * self.capacity):
            victim, _ = once.popitem(last=False)
        else:
            victim, _ = reused.popitem(last=False)
        ghost = self._ghost
        ghost[victim] = None
        if len(ghost) > GHOST * self.capacity:
            ghost.popitem(last=False)


class PyShadows:
    """``_shadows.Shadows`` in Python (its reference, and where the C module is missing): one
    ``_Shadow`` per margin, replayed on the caller's thread, its results returned ``lag``
    batches late as the C ones are."""

    def __init__(self, thetas: Sequence[float], max_capacity: int, lag: int = 0) -> None:
        if not 1 <= max_capacity <= 1 << 24:
            raise ValueError("max_capacity is 1 to 2**24")
        if not 0 <= lag <= 4096:
            raise ValueError("lag is 0 to 4096 batches")
        self._max = max_capacity
        self.lag = lag
        self._shadows = [_Shadow(theta) for theta in thetas]
        self._pending: deque[tuple[int, ...]] = deque()
        for s in self._shadows:
            s.capacity = max_capacity

    def set_capacity(self, capacity: int) -> None:
        if not 1 <= capacity <= self._max:
            raise ValueError("capacity is 1 to max_capacity")
        for s in self._shadows:
            s.capacity = capacity

    def submit(self, ids: Sequence[int]) -> list[tuple[int, ...]]:
        ids = list(ids)
        if any(not 0 <= i < _HASH_SPACE for i in ids):
            raise OverflowError("an id over 32 bits")
        self._pending.append((len(ids), *(s.access(ids) for s in self._shadows)))
        due = len(self._pending) - self.lag
        return [self._pending.popleft() for _ in range(max(due, 0))]

    def submit_keys(self, keys: Sequence[bytes], limit: int) -> list[tuple[int, ...]]:
        ids = [i for i in map(self.key_id, keys) if i < limit]
        return self.submit(ids) if ids else []

    @staticmethod
    def key_id(key: bytes) -> int:
        """FNV-1a over the key's bytes, then murmur3's finalizer."""
        h = 0x811C9DC5
        for b in key:
            h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
        h ^= h >> 16
        h = (h * 0x7FEB352D) & 0xFFFFFFFF
        h ^= h >> 15
        h = (h * 0x846CA68B) & 0xFFFFFFFF
        return h ^ (h >> 16)

    def pause(self, on: bool) -> bool:
        """No thread to pause: False."""
        return False

    def nbytes(self) -> int:
        """What its dictionaries hold, as ``sys.getsizeof`` counts them."""
        return sum(sys.getsizeof(d) for s in self._shadows
                   for d in (s._once, s._reused, s._ghost))

    def held(self, i: int) -> tuple[int, int]:
        s = self._shadows[i]
        return len(s._once), len(s._reused)


try:
    from hicached.cache import _shadows
except ImportError:  # not built: the same in Python
    Shadows: type[_shadows.Shadows] | type[PyShadows] = PyShadows
else:
    Shadows = _shadows.Shadows


class _Shadows:
    """One ``_Shadow`` per candidate margin over a sample of the keys, and the margin the
    pool uses now (``theta``)."""

    def __init__(self) -> None:
        self.theta = THETAS[0]
        self._current = 0
        self._rate = 0.0
        """The share of keys sampled (0: not sized yet)."""
        self._capacity = 0
        """The pool's pages the shadows are sized for."""
        self._room = 1
        """The most ids each shadow can hold (more: resampled)."""
        self._limit = 0
        self._shadows: _shadows.Shadows | PyShadows = Shadows(THETAS, 1)
        """Made again (with a thread of its own) at the first ``feed``."""
        self._scores: list[float] = []
        self._decay = 1.0

    def _resize(self, capacity: int) -> None:
        """Size the shadows for a pool of ``capacity`` pages; resample (and start the scores
        over) when the sample would leave half to twice ``SAMPLE_PAGES`` or outgrow the
        shadows' room (twice what they were made for)."""
        capacity = max(capacity, 1)
        self._capacity = capacity
        held = capacity * self._rate
        if self._rate and max(round(held), 1) <= self._room and (
                self._rate == 1.0 or held >= SAMPLE_PAGES / 2):
            self._shadows.set_capacity(max(round(held), 1))
            return
        self._rate = min(1.0, SAMPLE_PAGES / capacity)
        self._limit = int(self._rate * _HASH_SPACE)
        size = max(round(capacity * self._rate), 1)
        # room to double (a growing pool), not more: small tables stay in the CPU's caches
        self._room = min(2 * size, 2 * SAMPLE_PAGES)
        self._shadows = Shadows(THETAS, self._room, LAG)
        self._shadows.set_capacity(size)
        self._scores = [0.0] * len(THETAS)
        self._decay = 0.5 ** (1.0 / (HALF_LIFE * size))

    def nbytes(self) -> int:
        return self._shadows.nbytes()

    def feed(self, keys: Sequence[bytes], capacity: int) -> None:
        """``keys`` (chain order) were stored or loaded in a pool of ``capacity`` pages."""
        if capacity != self._capacity:
            self._resize(capacity)
        for got in self._shadows.submit_keys(keys, self._limit):
            self._score(got)

    def _score(self, got: tuple[int, ...]) -> None:
        """One batch's result: ``got[0]`` ids sampled, then each candidate's hits."""
        scores = self._scores
        fade = self._decay ** got[0]
        for i, hits in enumerate(got[1:]):
            scores[i] = scores[i] * fade + hits
        best = max(range(len(scores)), key=scores.__getitem__)
        now = self._current
        lead = scores[best] - scores[now]
        if lead > 0 and lead > SWITCH_Z * math.sqrt(scores[best] + scores[now]):
            self._current = best
            self.theta = THETAS[best]
