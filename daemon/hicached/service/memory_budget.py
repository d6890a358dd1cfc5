"""One memory budget shared by the pools: each pool's share grows with its demand and shrinks
when it is idle or another pool needs the memory more.

A pool's share is its allocator's limit (``PageAllocator.limit``): the pages it may hold.
The shares of all pools add up to the budget at most; what no pool holds is *slack*.

- **Growth on demand** (``grow``, called by a pool's cache with its lock held, when a Store,
  a promotion or an Alloc finds the pool full): the pool takes from the slack at once, at
  least ``grow_step_bytes``, up to its ceiling and its tenant's quota. What it could not get
  is remembered as its unmet demand. A pool whose tenant is at its quota, or that is at its
  ceiling, evicts its own pages instead, as a fixed-size pool does.
- **Rebalancing** (``rebalance``, every ``interval_seconds`` on the budget's thread): a pool
  holding free pages above its floor gives them back to the slack (an idle pool shrinks to
  what it uses, and to its floor once others need its keys' memory); then each pool with
  unmet demand, or that evicted since the last round, takes memory from the others by one
  value rule, the one eviction uses inside a pool: the pool whose least recently used page
  is the oldest gives first (``Sizing.resize``: its oldest keys evicted, the rest moved
  below its new size), and only where that page is older than the taker's own oldest. A
  tenant below its guaranteed share takes from tenants above theirs whatever their ages;
  no pool goes below its floor, and no tenant is taken below its guaranteed share by
  another. One round moves at most ``step_fraction`` of the budget from a pool.
- **Locked memory** (a GPU host, where pools are page-locked for DMA): a pool's locked part
  follows its share (``core.pin_units``): pages are locked before its limit rises over them
  (a Store's growth locks its step, ``grow_step_bytes``, while it waits; a rebalance locks
  what it gives before taking the budget's lock) and unlocked after it fell below them,
  before their memory goes back. A pool that cannot lock more (the locked-memory limit)
  is not granted more: it evicts its own.
- **Admission** (``admit``): a new pool is charged its floor; the floors of all pools fit the
  budget (``HOST_MEMORY_INSUFFICIENT`` otherwise), and a joining pool's floor is taken back
  from pools above theirs when the slack is short (``join``).

Locks: the budget's lock is taken inside a pool cache's (``grow``), never the other way
round, and no system call runs under it (a growth reserves its room under it, locks and
fallocates its pages outside it, publishes its limit under it); ``rebalance`` resizes pools
with no lock of the budget held, a pool being shrunk counting at its share before until the
shrink ended (its limit dips while its pages move, and may end above the size asked for where
pages are in use: nothing grows into that dip).

Primitives: ``MemoryBudget(budget_bytes, config, clock)``: ``admit(spec)``, ``join(sizing)``,
``leave(name)``, ``grow(name, pages)``, ``rebalance()``, ``start()`` / ``close()`` (the
thread), ``shares()`` / ``share(name)`` (``PoolShareView`` per pool), ``tenants()``
(``TenantView``), ``stats`` (``BudgetStats``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hicache import seams
from hicache.errors import HostMemoryInsufficient
from hicache.locks import condition, lock
from hicache.specs import PoolSpec
from hicached.cache.sizing import Sizing
from hicached.service.budget_config import BudgetConfig, share_for

log = logging.getLogger(__name__)

LEAVE_WAIT_S = 30.0
"""How long ``leave`` waits for a growth of the pool still reserving (system calls: well
under a second but for a stalled file system)."""

PRESSURE_REASONS = ("store", "promotion", "alloc")
"""Evictions that say a pool needed more room than it had (``budget`` evictions do not)."""


@dataclass(frozen=True)
class PoolShareView:
    pool: str
    tenant: str
    share_bytes: int
    """What the pool may hold now (its allocator's limit)."""
    used_bytes: int
    floor_bytes: int
    ceiling_bytes: int


@dataclass(frozen=True)
class TenantView:
    tenant: str
    share_bytes: int
    """What its pools may hold together now."""
    used_bytes: int
    quota_bytes: int
    """0: none but the budget."""
    guaranteed_bytes: int


@dataclass
class BudgetStats:
    grown_bytes: int = 0
    """Bytes of share pools took (from the slack on demand, or given by a rebalance)."""
    shrunk_bytes: int = 0
    """Bytes of share pools gave back (idle, or taken for another)."""
    released_bytes: int = 0
    """Memory given back to the system by shrinking pools."""
    moved_keys: int = 0
    """Keys whose pages moved below a shrinking pool's new size."""
    rounds: int = 0


class _Member:
    __slots__ = ("ceiling", "evictions", "fixed", "floor", "growing", "holding",
                 "moves", "name", "page_bytes", "reserved_top", "sizing", "tenant", "wanted")

    def __init__(self, sizing: Sizing, floor: int, ceiling: int, tenant: str,
                 fixed: int) -> None:
        self.sizing = sizing
        self.fixed = fixed
        """Bytes the pool is charged whatever its share (its tables and key index)."""
        self.name = sizing.pool.spec.name
        self.page_bytes = sizing.pool.spec.page_bytes
        self.floor, self.ceiling, self.tenant = floor, ceiling, tenant
        self.evictions = _pressure(sizing)
        self.wanted = 0
        """Pages asked for and not granted since the last round."""
        self.growing = 0
        """Pages growths (a Store's, a rebalance's) have taken from the slack and are
        reserving (outside the budget's lock), not yet in its limit."""
        self.reserved_top = 0
        """The end of the highest run of pages a growth reserved: what lies above the limit
        up to it is given back by the last growth (or shrink) to end (``_settle``)."""
        self.moves = 0
        """Bumped whenever the limit is published or a shrink begins or ends: a growth
        publishes only where nothing moved it since it began (a limit that went down and
        back up has unlocked what the growth locked)."""
        self.holding = 0
        """While the pool is being shrunk: its share before (what it counts for until the
        shrink ends: the limit dips below what it ends at while its pages move)."""

    @property
    def limit(self) -> int:
        return self.sizing.pool.allocator.limit


class _Share:
    """A pool's share of the budget as its cache reaches it (``Sizing.share_with``)."""

    __slots__ = ("budget", "name")

    def __init__(self, budget: MemoryBudget, name: str) -> None:
        self.budget, self.name = budget, name

    def grow(self, pages: int) -> int:
        return self.budget.grow(self.name, pages)


def _view(m: _Member) -> PoolShareView:
    return PoolShareView(m.name, m.tenant, m.limit * m.page_bytes,
                         m.sizing.pool.allocator.used_pages * m.page_bytes,
                         m.floor * m.page_bytes, m.ceiling * m.page_bytes)


def _pressure(sizing: Sizing) -> int:
    by = sizing.stats.evicted_by
    return sum(by[r] for r in PRESSURE_REASONS)


class MemoryBudget:
    def __init__(self, budget_bytes: int, config: BudgetConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.budget_bytes = budget_bytes
        self.config = config
        self._clock = clock
        self._lock = lock("budget")
        self._settled = condition(self._lock)
        """Notified when a growth ends (``leave`` waits for a pool's last)."""
        self._members: dict[str, _Member] = {}
        self.stats = BudgetStats()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- pools coming and going ------------------------------------------------------------

    def bounds(self, spec: PoolSpec) -> tuple[int, int, str]:
        """(floor pages, ceiling pages, tenant) of a pool of ``spec``."""
        rule = share_for(self.config, spec.name)
        pages = spec.resolved_size_tokens() // spec.page_size
        ceiling = min(rule.ceiling_bytes // spec.page_bytes, pages) if rule.ceiling_bytes \
            else pages
        floor = min(-(-rule.floor_bytes // spec.page_bytes), pages)
        return floor, max(ceiling, floor), rule.tenant

    def admit(self, spec: PoolSpec, metadata_bytes: int, pending: int = 0) -> int:
        """The bytes a new pool of ``spec`` is charged (its floor and its tables), or
        ``HOST_MEMORY_INSUFFICIENT`` when the floors would not fit the budget beside the
        pools' and ``pending`` (pools being built)."""
        floor, _, _ = self.bounds(spec)
        need = floor * spec.page_bytes + metadata_bytes
        with self._lock:
            committed = pending + sum(m.floor * m.page_bytes + m.fixed
                                      for m in self._members.values())
        if committed + need > self.budget_bytes:
            raise HostMemoryInsufficient(
                f"pool {spec.name} needs a floor of {need} bytes; the floors of the pools "
                f"there already take {committed} of the budget's {self.budget_bytes}",
                metadata={"pool": spec.name, "floor_bytes": need, "committed_bytes": committed,
                          "budget_bytes": self.budget_bytes})
        return need

    def join(self, sizing: Sizing, fixed_bytes: int = 0) -> None:
        """Share the budget with ``sizing``'s pool (charged ``fixed_bytes`` besides its share):
        it starts at its floor (or at what it holds already, re-attached, as far as the slack
        goes), taking its floor back from pools above theirs if the slack is short; its
        Stores then grow it on demand."""
        floor, ceiling, tenant = self.bounds(sizing.pool.spec)
        m = _Member(sizing, floor, ceiling, tenant, fixed_bytes)
        held = sizing.pool.allocator.top()
        with self._lock:
            slack = (self._slack_bytes() - fixed_bytes) // m.page_bytes
            start = max(floor, min(ceiling, held, slack))
        sizing.resize(start)  # (its memory above it is given back before it counts)
        with self._lock:
            self._members[m.name] = m
            short = -self._slack_bytes()
        if short > 0:  # its floor comes first: a floor is what the others cannot keep
            self._reclaim(short, m, force=True)
        sizing.share_with(_Share(self, m.name))
        log.info("pool %s shares the budget: floor %d, ceiling %d pages of %d bytes, tenant "
                 "%r, starts at %d", m.name, floor, ceiling, m.page_bytes, tenant, start)

    def leave(self, name: str) -> None:
        """The pool no longer shares the budget; returns once no growth of it is still
        reserving (its memory may be closed after this)."""
        with self._settled:
            m = self._members.pop(name, None)
            if m is not None:
                self._settled.wait_for(lambda: not m.growing, LEAVE_WAIT_S)
        if m is not None:
            m.sizing.share_with(None)

    # -- growth on demand (a pool's lock held) ---------------------------------------------

    def grow(self, name: str, pages: int) -> int:
        """Pages ``name`` may add to its share now (its limit is raised by as many before
        this returns; 0: it evicts its own). In three steps (``_reserve``), so that the
        system calls of a growth (``fallocate``, page locking, the driver's registration:
        milliseconds to seconds) hold no lock another pool's Store needs."""
        with self._lock:
            m = self._members.get(name)
            if m is None or pages <= 0:
                return 0
            room = self._room(m, max(pages, -(-self.config.grow_step_bytes // m.page_bytes)))
            if room < pages:
                m.wanted += pages - room
        return self._reserve(m, room, "budget.grow_reserving")

    def _reserve(self, m: _Member, room: int, seam: str = "") -> int:
        """Raise ``m``'s limit by up to ``room`` pages: the room taken from the slack under
        the budget's lock (``growing``: it counts at once, so no other pool takes it), the
        pages reserved (locked, fallocated) with no lock of the budget's held, the limit
        published under it again; how many pages it rose by. Where another growth of the
        same pool published first, what is there is taken; pages reserved above the limit
        are given back by the last growth of the pool to end, never while another is still
        reserving (a pool locked by units unlocks every unit above the point it is given:
        the other's too)."""
        with self._lock:
            if m.name not in self._members:
                return 0
            start, moves = m.limit, m.moves
            room = max(min(room, self._room(m, room)), 0)
            if not room:
                return 0
            m.growing += room
        reserved = False
        try:
            if seam:
                seams.reached(seam)
            reserved = m.sizing.pool.reserve_pages(start, start + room)
            seams.reached("budget.reserved")
        finally:
            with self._lock:
                m.growing -= room
                m.reserved_top = max(m.reserved_top, start + room)
                got = 0
                if reserved and m.name in self._members:
                    if m.moves == moves:
                        m.sizing.pool.allocator.set_limit(start + room)
                        m.moves += 1
                        self.stats.grown_bytes += room * m.page_bytes
                        got = room
                    elif not m.holding:  # another growth published: take what is there
                        got = max(min(m.limit - start, room), 0)
                self._settle(m)
                self._settled.notify_all()
        return got

    def _settle(self, m: _Member) -> None:
        """The budget's lock held: once no growth or shrink of ``m`` is under way, what was
        reserved above its limit is given back (free: the limit is below, none in use). A
        pool that left gives back nothing: its memory is being closed."""
        if m.growing or m.holding:
            return
        if m.reserved_top > m.limit and m.name in self._members:
            m.sizing.pool.release_pages(m.limit, m.reserved_top)
        m.reserved_top = 0

    # -- rebalancing -----------------------------------------------------------------------

    def rebalance(self) -> None:
        """One round (see the module's docstring)."""
        now = self._clock()
        with self._lock:
            members = list(self._members.values())
        demand: dict[str, int] = {}
        ages: dict[str, float] = {}
        for m in members:
            seen = _pressure(m.sizing)
            with self._lock:
                want, m.wanted = m.wanted, 0
            if seen > m.evictions or want:
                demand[m.name] = max(want, seen - m.evictions)
            m.evictions = seen
            ages[m.name] = m.sizing.coldest_age(now)
        # idle memory back to the slack: the free pages of a pool without demand, but for a
        # step of room, never below its floor
        for m in members:
            if m.name in demand:
                continue
            keep = max(m.floor, m.sizing.pool.allocator.used_pages + self._step_pages(m))
            if m.limit > keep:
                self._shrink(m, keep)
        # then each pool in need, those of tenants below their guarantee first, the
        # hottest (youngest oldest page) next
        takers = sorted((m for m in members if m.name in demand and m.limit < m.ceiling),
                        key=lambda m: (not self._below_guarantee(m.tenant), ages[m.name]))
        for m in takers:
            want = max(demand[m.name], self._step_pages(m))
            # granted in a Store's growth's three steps: no Store waits behind a lock-up
            got = self._reserve(m, want)
            short = (want - got) * m.page_bytes
            if short > 0:
                self._reclaim(short, m, ages)
                self._reserve(m, want - got)
        self.stats.rounds += 1

    def _room(self, m: _Member, pages: int) -> int:
        """Pages ``m`` may add now, of ``pages``: its ceiling, the slack, its tenant's quota."""
        return max(min(pages, m.ceiling - m.limit, self._slack_bytes() // m.page_bytes,
                       self._quota_room(m.tenant) // m.page_bytes), 0)

    def _reclaim(self, nbytes: int, taker: _Member, ages: dict[str, float] | None = None,
                 force: bool = False) -> None:
        """Free ``nbytes`` of others' shares for ``taker``, the least valuable first (see the
        module's docstring); ``force`` (a floor): from any pool above its floor."""
        now = self._clock()
        ages = ages if ages is not None else {}
        taker_age = ages.get(taker.name, taker.sizing.coldest_age(now))
        guaranteed = self._below_guarantee(taker.tenant)
        own_only = self._quota_room(taker.tenant) <= 0  # at its quota: its own pools only
        with self._lock:
            others = [m for m in self._members.values() if m is not taker]
        donors = []
        for d in others:
            age = ages.get(d.name)
            if age is None:
                age = ages[d.name] = d.sizing.coldest_age(now)
            if d.limit <= d.floor:
                continue
            if force:
                pass
            elif d.tenant != taker.tenant:
                if own_only:
                    continue
                if not guaranteed and age <= taker_age:
                    continue  # its pages are worth as much as the taker's: it keeps them
                if self._tenant_share(d.tenant) <= self._guarantee(d.tenant):
                    continue
            elif age <= taker_age and taker.limit > taker.floor:
                continue
            donors.append((age, d))
        for _age, d in sorted(donors, key=lambda x: -x[0]):
            if nbytes <= 0:
                break
            pages = min(-(-nbytes // d.page_bytes), d.limit - d.floor)
            if not force:
                pages = min(pages, self._step_pages(d))
            if d.tenant != taker.tenant and not force:
                over = self._tenant_share(d.tenant) - self._guarantee(d.tenant)
                pages = min(pages, max(over, 0) // d.page_bytes)
            if pages <= 0:
                continue
            before = d.limit
            self._shrink(d, before - pages)
            nbytes -= (before - d.limit) * d.page_bytes

    def _shrink(self, m: _Member, pages: int) -> None:
        with self._lock:
            before = m.holding = m.limit
            m.moves += 1
        try:
            r = m.sizing.resize(pages)
        finally:
            with self._lock:
                m.holding = 0
                m.moves += 1
                self._settle(m)
        with self._lock:
            self.stats.shrunk_bytes += max(before - r.limit, 0) * m.page_bytes
            self.stats.released_bytes += r.released_bytes
            self.stats.moved_keys += r.moved

    # -- the books (the budget's lock held, or a snapshot) ---------------------------------

    def _slack_bytes(self) -> int:
        return self.budget_bytes - sum(
            (max(m.limit, m.holding) + m.growing) * m.page_bytes + m.fixed
            for m in self._members.values())

    @property
    def used_bytes(self) -> int:
        """The shares and fixed charges of the pools sharing the budget."""
        with self._lock:
            return self.budget_bytes - self._slack_bytes()

    def _tenant_share(self, tenant: str) -> int:
        return sum((m.limit + m.growing) * m.page_bytes for m in list(self._members.values())
                   if m.tenant == tenant)

    def _quota_room(self, tenant: str) -> int:
        quota = self.config.tenant(tenant).quota_bytes
        return quota - self._tenant_share(tenant) if quota else self.budget_bytes

    def _guarantee(self, tenant: str) -> int:
        t = self.config.tenant(tenant)
        if t.guaranteed_bytes >= 0:
            return t.guaranteed_bytes
        members = list(self._members.values())
        tenants = {m.tenant for m in members} or {tenant}
        fair = (self.budget_bytes - sum(m.fixed for m in members)) // len(tenants)
        return min(fair, t.quota_bytes) if t.quota_bytes else fair

    def _below_guarantee(self, tenant: str) -> bool:
        return self._tenant_share(tenant) < self._guarantee(tenant)

    def _step_pages(self, m: _Member) -> int:
        return max(int(self.budget_bytes * self.config.step_fraction) // m.page_bytes,
                   -(-self.config.grow_step_bytes // m.page_bytes), 1)

    # -- what it looks like ----------------------------------------------------------------

    def shares(self) -> list[PoolShareView]:
        """Every pool's share, read in one step under the budget's lock: their sum never
        passes the budget, even while it moves memory from one pool to another."""
        with self._lock:
            return [_view(m) for m in self._members.values()]

    def share(self, name: str) -> PoolShareView | None:
        """``name``'s share (None: the pool does not share the budget)."""
        with self._lock:
            m = self._members.get(name)
            return _view(m) if m is not None else None

    def tenants(self) -> list[TenantView]:
        out: dict[str, list[PoolShareView]] = {}
        for s in self.shares():
            out.setdefault(s.tenant, []).append(s)
        return [TenantView(t, sum(s.share_bytes for s in v), sum(s.used_bytes for s in v),
                           self.config.tenant(t).quota_bytes, self._guarantee(t))
                for t, v in sorted(out.items())]

    # -- the thread ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="budget", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_seconds):
            try:
                self.rebalance()
            except Exception:  # a round that failed leaves the shares as they were
                log.exception("rebalancing the memory budget failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

