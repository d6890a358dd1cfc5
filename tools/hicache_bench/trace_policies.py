"""Reference caches a trace's hit rate is measured against: LRU, ARC, S3-FIFO, the daemon's own
policy and the offline optimum, each replaying a prefix cache's request stream.

A request is its prompt's blocks in order (chained ids: two requests share an id only where
they share the whole prefix up to it). Its hit is the leading run of its blocks the cache holds
when it arrives (a prefix cache can use no block after a missing one); then every block of it
is accessed: the held ones touched, then the missing ones stored, each in order, as an engine
looks a prompt up, loads its hit and stores the rest in one batch (whose pages already there
are touched before any is evicted for the new ones). The hit rate is hit blocks over prompt
blocks.

Policies, block-granular, ``capacity`` blocks:

- ``Lru``: least recently used first (what the daemon's pools do).
- ``Arc``: Megiddo and Modha's adaptive replacement cache (recency and frequency lists, their
  ghosts, the target size adapting on ghost hits).
- ``S3Fifo``: Yang et al.'s S3-FIFO (a small FIFO of a tenth of the capacity, a main FIFO with
  two-bit reinsertion, a ghost FIFO the size of the main one; an object accessed in the small
  queue moves to the main one).
- ``Reuse``: the daemon's ``reuse`` eviction policy (``hicached.cache.reuse_lru``), driven
  through the calls a pool makes when an engine serves a request, so that a daemon replay
  hits exactly what it hits.
- ``Belady``: the offline optimum of the block stream: evict the block used again farthest in
  the future, and store no block used later than every held one (it is told each access's
  next use). Optimal for block hits, an upper reference for prefix hits.
- ``RateOracle``: what a policy that predicted every block's reuse rate perfectly, but not when
  each reuse comes, could do (the independent reference model's optimum, A0): it keeps the
  blocks of highest lifetime rate (``lifetime_rates``: uses after the first over the requests
  from its first use to its last), stores none whose rate is below every held one's, and none
  past its last use. Not a policy anyone can run (the rates are the future's); the ceiling of
  online policies whose knowledge of a block is how often it comes back. With
  ``last_use=False`` it is not told when a block dies: a block keeps its rate after its last
  use, so what the last use is worth can be told apart from what the rate is.
- ``CountOracle``: keeps the blocks that will be used most in all (``use_counts``: the
  requests using each block over the whole trace), stores none used less than every held one.
  Another oracle: how far knowing how popular each block will be goes.

Primitives: ``Policy`` (``holds(block)``, ``access(block, next_use)``, ``len()``,
``stores``, ``evictions``), the seven classes (the optimum and the two oracles one ranked
heap, ``_Ranked``: the lowest held block goes first, none ranking no higher is stored),
``POLICIES`` (name -> class, the four online ones and the optimum), ``next_uses(requests)``,
``lifetime_rates(requests)``, ``use_counts(requests)``, ``replay(policy, requests, uses) ->
Tally``, ``Tally`` (hit and prompt blocks, stores, evictions, ``rate``).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from hicached.cache.reuse_lru import ReuseLRU

NEVER = 1 << 62
"""The next use of a block never used again."""
_POSITIONS = 1 << 20
"""A next use is ``request index * _POSITIONS + the block's place in that request``: of two
blocks the same request uses next, the deeper one is used later (and goes first)."""


class Policy:
    """A cache of ``capacity`` blocks."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a cache holds at least one block, not {capacity}")
        self.capacity = capacity
        self.stores = 0
        """Blocks stored (accessed while missing, and admitted)."""
        self.evictions = 0

    def holds(self, block: int) -> bool:
        raise NotImplementedError

    def __len__(self) -> int:
        """Blocks held now."""
        raise NotImplementedError

    def access(self, block: int, next_use: int = NEVER) -> None:
        """``block`` is used now (touched if held, else stored); ``next_use``: when it is
        used next (``next_uses``), which only the offline optimum reads."""
        raise NotImplementedError

    def serve(self, blocks: Sequence[int], nexts: Sequence[int]) -> None:
        """One request after its hit was counted: the held blocks touched, then the missing
        ones stored, each in order, as one Store of the request's pages touches those there
        before it evicts for the others."""
        held = [self.holds(b) for b in blocks]
        for b, n, h in zip(blocks, nexts, held, strict=True):
            if h:
                self.access(b, n)
        for b, n, h in zip(blocks, nexts, held, strict=True):
            if not h:
                self.access(b, n)


class Lru(Policy):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[int, None] = OrderedDict()

    def holds(self, block: int) -> bool:
        return block in self._order

    def __len__(self) -> int:
        return len(self._order)

    def access(self, block: int, next_use: int = NEVER) -> None:
        if block in self._order:
            self._order.move_to_end(block)
            return
        if len(self._order) >= self.capacity:
            self._order.popitem(last=False)
            self.evictions += 1
        self._order[block] = None
        self.stores += 1


class Arc(Policy):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._t1: OrderedDict[int, None] = OrderedDict()
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[int, None] = OrderedDict()
        self._b2: OrderedDict[int, None] = OrderedDict()
        self._p = 0.0

    def holds(self, block: int) -> bool:
        return block in self._t1 or block in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def _replace(self, in_b2: bool) -> None:
        t1 = len(self._t1)
        if t1 and (t1 > self._p or (in_b2 and t1 == self._p)):
            old, _ = self._t1.popitem(last=False)
            self._b1[old] = None
        else:
            old, _ = self._t2.popitem(last=False)
            self._b2[old] = None
        self.evictions += 1

    def access(self, block: int, next_use: int = NEVER) -> None:
        c = self.capacity
        if block in self._t1:
            del self._t1[block]
            self._t2[block] = None
            return
        if block in self._t2:
            self._t2.move_to_end(block)
            return
        self.stores += 1
        if block in self._b1:
            self._p = min(float(c), self._p + max(len(self._b2) / len(self._b1), 1.0))
            self._replace(False)
            del self._b1[block]
            self._t2[block] = None
            return
        if block in self._b2:
            self._p = max(0.0, self._p - max(len(self._b1) / len(self._b2), 1.0))
            self._replace(True)
            del self._b2[block]
            self._t2[block] = None
            return
        l1 = len(self._t1) + len(self._b1)
        total = l1 + len(self._t2) + len(self._b2)
        if l1 >= c:
            if len(self._t1) < c:
                self._b1.popitem(last=False)
                self._replace(False)
            else:
                self._t1.popitem(last=False)
                self.evictions += 1
        elif total >= c:
            if total >= 2 * c:
                self._b2.popitem(last=False)
            self._replace(False)
        self._t1[block] = None


class S3Fifo(Policy):
    SMALL_SHARE = 0.1
    MAX_FREQ = 3

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._small_cap = max(1, int(capacity * self.SMALL_SHARE))
        self._ghost_cap = max(1, capacity - self._small_cap)
        self._small: OrderedDict[int, None] = OrderedDict()
        self._main: OrderedDict[int, None] = OrderedDict()
        self._ghost: OrderedDict[int, None] = OrderedDict()
        self._freq: dict[int, int] = {}

    def holds(self, block: int) -> bool:
        return block in self._freq

    def __len__(self) -> int:
        return len(self._freq)

    def access(self, block: int, next_use: int = NEVER) -> None:
        freq = self._freq.get(block)
        if freq is not None:
            self._freq[block] = min(freq + 1, self.MAX_FREQ)
            return
        while len(self._freq) >= self.capacity:
            self._evict()
        self.stores += 1
        self._freq[block] = 0
        if block in self._ghost:
            del self._ghost[block]
            self._main[block] = None
        else:
            self._small[block] = None

    def _evict(self) -> None:
        if self._small and (len(self._small) >= self._small_cap or not self._main):
            while self._small:
                old, _ = self._small.popitem(last=False)
                if self._freq[old] >= 1:  # used again while small: it earned the main queue
                    self._freq[old] = 0
                    self._main[old] = None
                    continue
                del self._freq[old]
                self._ghost[old] = None
                if len(self._ghost) > self._ghost_cap:
                    self._ghost.popitem(last=False)
                self.evictions += 1
                return
        while self._main:
            old, _ = self._main.popitem(last=False)
            if self._freq[old] > 0:  # reinserted, one use spent
                self._freq[old] -= 1
                self._main[old] = None
                continue
            del self._freq[old]
            self.evictions += 1
            return


class _Ranked(Policy):
    """Keeps the blocks of highest rank (``rank(block, next_use)``): the lowest held goes
    first, and a block that ranks no higher than it is not stored at all."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._rank: dict[int, float] = {}
        self._heap: list[tuple[float, int]] = []
        """(rank, block), stale entries skipped: the held block of lowest rank on top."""

    def rank(self, block: int, next_use: int) -> float:
        raise NotImplementedError

    def holds(self, block: int) -> bool:
        return block in self._rank

    def __len__(self) -> int:
        return len(self._rank)

    def access(self, block: int, next_use: int = NEVER) -> None:
        rank = self.rank(block, next_use)
        if block not in self._rank:
            if len(self._rank) >= self.capacity:
                low, victim = self._lowest()
                if rank <= low:  # no more worth a place than anything held
                    return
                del self._rank[victim]
                heapq.heappop(self._heap)
                self.evictions += 1
            self.stores += 1
        self._rank[block] = rank
        heapq.heappush(self._heap, (rank, block))

    def _lowest(self) -> tuple[float, int]:
        while True:
            rank, block = self._heap[0]
            if self._rank.get(block) == rank:
                return rank, block
            heapq.heappop(self._heap)


class Belady(_Ranked):
    def rank(self, block: int, next_use: int) -> float:
        return -next_use  # the block used farthest ahead ranks lowest


class RateOracle(_Ranked):
    def __init__(self, capacity: int, rates: dict[int, float], last_use: bool = True) -> None:
        super().__init__(capacity)
        self._rates = rates
        self._last_use = last_use

    def rank(self, block: int, next_use: int) -> float:
        if self._last_use and next_use == NEVER:
            return -1.0
        return self._rates.get(block, 0.0)


class CountOracle(_Ranked):
    def __init__(self, capacity: int, counts: dict[int, int]) -> None:
        super().__init__(capacity)
        self._counts = counts

    def rank(self, block: int, next_use: int) -> float:
        return float(self._counts.get(block, 0))


def use_counts(requests: Sequence[Sequence[int]]) -> dict[int, int]:
    """How many requests use each block, over the whole trace."""
    count: dict[int, int] = {}
    for blocks in requests:
        for b in blocks:
            count[b] = count.get(b, 0) + 1
    return count


def lifetime_rates(requests: Sequence[Sequence[int]]) -> dict[int, float]:
    """Each block's reuse rate over its life: the requests using it after its first, over
    the requests from its first use to its last (0 for a block used once)."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, blocks in enumerate(requests):
        for b in blocks:
            first.setdefault(b, i)
            last[b] = i
    return {b: (n - 1) / (last[b] - first[b]) if n > 1 else 0.0
            for b, n in use_counts(requests).items()}


class Reuse(Policy):
    """The daemon's ``reuse`` eviction (``hicached.cache.reuse_lru.ReuseLRU``), driven as a
    pool drives it when an engine serves a request: a touching Lookup of every block, a
    load of the hit (its blocks out of the policy, then back: used), a Store of the rest
    (those held touched, room made for the missing, which are then added)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.policy = ReuseLRU(lambda: capacity)

    def holds(self, block: int) -> bool:
        return block_key(block) in self.policy

    def __len__(self) -> int:
        return len(self.policy)

    def access(self, block: int, next_use: int = NEVER) -> None:
        self.serve([block], [next_use])

    def serve(self, blocks: Sequence[int], nexts: Sequence[int]) -> None:
        p = self.policy
        keys = [block_key(b) for b in blocks]
        there = [k in p for k in keys]
        p.touch([k for k, t in zip(keys, there, strict=True) if t], 0.0)
        hit = there.index(False) if False in there else len(keys)
        for k in keys[:hit]:
            p.discard(k)
        p.back(keys[:hit], 0.0)
        rest = keys[hit:]
        present = [k for k in rest if k in p]
        p.touch(present, 0.0)
        new = list(dict.fromkeys(k for k in rest if k not in p))
        short = len(p) + len(new) - self.capacity
        if short > 0:
            self.evictions += len(p.pop_oldest(short))
        new = new[:self.capacity - len(p)]
        p.add(new, 0.0)
        self.stores += len(new)


def block_key(block: int) -> bytes:
    """The key a daemon replay stores for ``block``."""
    return b"trace-block-" + block.to_bytes(8, "big")


POLICIES: dict[str, type[Policy]] = {"lru": Lru, "arc": Arc, "s3fifo": S3Fifo,
                                     "reuse": Reuse, "belady": Belady}


def next_uses(requests: Sequence[Sequence[int]]) -> list[list[int]]:
    """For each request's each block, when it is used next: the index of the next request
    that uses it, then its place there (``NEVER`` when none)."""
    out: list[list[int]] = [[] for _ in requests]
    seen: dict[int, int] = {}
    for i in range(len(requests) - 1, -1, -1):
        out[i] = [seen.get(b, NEVER) for b in requests[i]]
        for k, b in enumerate(requests[i]):
            seen[b] = i * _POSITIONS + k
    return out


@dataclass
class Tally:
    hit_blocks: int = 0
    prompt_blocks: int = 0
    stores: int = 0
    evictions: int = 0
    broken: int = 0
    """A daemon replay's LoadKeys that could not load what its Lookup promised
    (``KEY_NOT_FOUND``): the request computed its whole prompt."""
    tier_hits: dict[int, int] = field(default_factory=dict)
    """A daemon replay's hit blocks by the tier Lookup found them in (1 host memory, 2 disk,
    3 cluster); empty for the reference policies."""

    @property
    def rate(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0


def replay(policy: Policy, requests: Sequence[Sequence[int]],
           uses: Sequence[Sequence[int]] | None = None) -> Tally:
    """``requests`` through ``policy``: each one's leading held blocks are its hit, then
    every block of it is accessed in order. ``uses``: ``next_uses(requests)`` (computed here
    when None)."""
    uses = next_uses(requests) if uses is None else uses
    tally = Tally()
    for blocks, nexts in zip(requests, uses, strict=True):
        hit = 0
        for b in blocks:
            if not policy.holds(b):
                break
            hit += 1
        tally.hit_blocks += hit
        tally.prompt_blocks += len(blocks)
        policy.serve(blocks, nexts)
    tally.stores, tally.evictions = policy.stores, policy.evictions
    return tally
