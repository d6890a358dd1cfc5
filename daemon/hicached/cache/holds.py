"""Holds: which pages a session's Lookup promised to keep until its LoadKeys, and until when.

A hit is a promise: a Lookup that names its session (``session_id``, ``hold_ms``) holds the
pages of the hit prefix for that session, so that another worker's Store cannot evict them
before the load. A hold ends when a LoadKeys of that session consumes it (its copy ended), by
``ReleaseHolds``, when the session ends, or at its deadline (``hold_ms``, capped by
``HoldPolicy.max_hold_ms``). A session holds at most ``max_held_fraction`` of a pool's pages:
past that a Lookup holds fewer (``held`` says how many), never fails, and a Store never fails
because of holds (a pool with nothing evictable answers no space, as ever).

This module keeps the books; the pool cache (``pool_cache``) keeps each held page out of the
LRU and read-held in the allocator while it is held, under its own lock, which also guards
this table (no lock here).

Primitives:

- ``HoldPolicy(max_hold_ms, max_held_fraction)``: the daemon's limits (validated).
- ``Holder``: who a Lookup holds its hit for (a session's owner number), for how long, and
  whether that session has ended (read under the pool cache's lock: a session marks itself
  ended before it ends its holds, so a hold taken after that sees it; no table of ended
  sessions is kept).
- ``Hold``: a held page and its ``Deadline`` (shared by the holds one Lookup took).
- ``HoldTable``: ``get(owner, key)``, ``count(owner)``, ``deadline(owner, until)`` (a new
  one), ``add(owner, key, page, deadline)`` (False for a refresh of a hold already there),
  ``take(owner, keys)`` (the holds a load consumes), ``drop(owner, keys)`` (``ReleaseHolds``;
  no keys: all), ``end(owner)`` (the session ended: every hold, and what the table kept for
  it), ``expire(now)`` (holds past their deadline), ``version(owner)`` (bumped when its set
  of holds changes), ``owners()`` (owners it keeps anything for: live sessions only),
  ``deadlines``, ``total``; ``last(owner)`` / ``remember(owner, Holding)``: what the owner's
  last Lookup held (the same Lookup again, nothing changed since, refreshes it in one step),
  ``lookups`` (owners with one). Deadlines sit in a heap (a moved one is put back when it comes
  due): a Lookup that asks the same keys again refreshes all its holds in O(1).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from hicache.errors import SpecInvalid


def _never() -> bool:
    return False


class Holder(NamedTuple):
    """Who a Lookup holds its hit for: a session (its owner number), for how long, and
    whether it has ended since (``ended()``, read under the pool cache's lock)."""

    owner: int
    seconds: float
    ended: Callable[[], bool] = _never


@dataclass(frozen=True)
class HoldPolicy:
    """The daemon's limits on holds (``max_hold_ms``, ``max_held_fraction`` in its config)."""

    max_hold_ms: int = 30_000
    """The longest a hold lasts whatever a Lookup asks for (a worker that never loads cannot
    keep pages from the others for longer)."""
    max_held_fraction: float = 0.25
    """The share of a pool's pages one session may hold at once."""

    def __post_init__(self) -> None:
        if not 0 < self.max_hold_ms <= 3_600_000:
            raise SpecInvalid("max_hold_ms is within 1 .. 3600000",
                              metadata={"max_hold_ms": self.max_hold_ms})
        if not 0 < self.max_held_fraction <= 1:
            raise SpecInvalid("max_held_fraction is within (0, 1]",
                              metadata={"max_held_fraction": self.max_held_fraction})

    def seconds(self, hold_ms: int) -> float:
        """How long a hold asked for ``hold_ms`` lasts."""
        return min(max(hold_ms, 0), self.max_hold_ms) / 1000.0

    def limit(self, page_num: int) -> int:
        """The most pages one session may hold in a pool of ``page_num`` pages (at least 1)."""
        return max(int(page_num * self.max_held_fraction), 1)


class Deadline:
    """When the holds one Lookup took (or refreshed) end; shared by them, so a Lookup that
    asks the same keys again moves them all on at once."""

    __slots__ = ("keys", "owner", "until")

    def __init__(self, owner: int, until: float) -> None:
        self.owner, self.until = owner, until
        self.keys: list[bytes] = []
        """Keys given this deadline (a key may have been given a later Lookup's since)."""


@dataclass
class Hold:
    page: int
    deadline: Deadline

    @property
    def until(self) -> float:
        return self.deadline.until


class Holding(NamedTuple):
    """What one Lookup held: its leading keys in host memory (``lead``, ``keys``), the
    owner's holds ``version`` and the removal sequence then (``removals``), how many it held
    and their ``deadline``."""

    lead: int
    version: int
    removals: int
    keys: list[bytes]
    held: int
    deadline: Deadline


class HoldTable:
    def __init__(self) -> None:
        self._by_owner: dict[int, dict[bytes, Hold]] = {}
        self._last: dict[int, Holding] = {}
        self._due: list[tuple[float, int, Deadline]] = []
        self._seq = itertools.count()
        self._version: dict[int, int] = {}
        self.total = 0
        """Holds in the table now."""

    def get(self, owner: int, key: bytes) -> Hold | None:
        held = self._by_owner.get(owner)
        return held.get(key) if held else None

    def count(self, owner: int) -> int:
        held = self._by_owner.get(owner)
        return len(held) if held else 0

    def last(self, owner: int) -> Holding | None:
        """What the owner's last Lookup held (``remember``), if anything."""
        return self._last.get(owner)

    def remember(self, owner: int, holding: Holding) -> None:
        self._last[owner] = holding

    @property
    def lookups(self) -> int:
        """Owners whose last Lookup the table remembers."""
        return len(self._last)

    def version(self, owner: int) -> int:
        """Bumped whenever the owner's set of holds changes (not when a deadline moves)."""
        return self._version.get(owner, 0)

    def _changed(self, owner: int) -> None:
        self._version[owner] = self._version.get(owner, 0) + 1

    def deadline(self, owner: int, until: float) -> Deadline:
        """A new deadline for the holds a Lookup takes or refreshes."""
        d = Deadline(owner, until)
        heapq.heappush(self._due, (until, next(self._seq), d))
        return d

    def add(self, owner: int, key: bytes, page: int, deadline: Deadline) -> bool:
        """Hold ``page`` for ``key`` until ``deadline``: True for a new hold, False when the
        owner held it already (it then keeps the later of its deadline and this one). An
        ended owner gets none (the caller checks its ``Holder.ended`` first)."""
        held = self._by_owner.setdefault(owner, {})
        h = held.get(key)
        if h is not None:
            if deadline is not h.deadline and deadline.until >= h.deadline.until:
                h.deadline = deadline
                deadline.keys.append(key)
            return False
        held[key] = Hold(page, deadline)
        deadline.keys.append(key)
        self.total += 1
        self._changed(owner)
        return True

    def take(self, owner: int, keys: Iterable[bytes]) -> dict[bytes, Hold]:
        """Remove and return the owner's holds of ``keys`` (a load consumes them)."""
        held = self._by_owner.get(owner)
        if not held:
            return {}
        out = {k: held.pop(k) for k in dict.fromkeys(keys) if k in held}
        self.total -= len(out)
        if out:
            self._changed(owner)
        if not held:
            del self._by_owner[owner]
        return out

    def drop(self, owner: int, keys: Iterable[bytes] | None = None) -> list[Hold]:
        """Remove the owner's holds of ``keys``, or all of them."""
        if keys is None:
            held = self._by_owner.pop(owner, {})
            self.total -= len(held)
            if held:  # (an owner with none keeps no version either)
                self._changed(owner)
            return list(held.values())
        return list(self.take(owner, keys).values())

    def end(self, owner: int) -> list[Hold]:
        """The owner (a session) ended: its holds go, and whatever the table kept for it
        (its deadlines still in the heap find no holds and go when due)."""
        gone = self.drop(owner)
        self._version.pop(owner, None)
        self._last.pop(owner, None)
        return gone

    @property
    def deadlines(self) -> int:
        """Deadlines in the heap (stale ones included, until they come due)."""
        return len(self._due)

    def owners(self) -> set[int]:
        """The owners the table keeps anything for (holds, a version, a last Lookup)."""
        return set(self._by_owner) | set(self._version) | set(self._last)

    def expire(self, now: float) -> list[Hold]:
        """Remove and return every hold whose deadline is at or before ``now``."""
        out: list[Hold] = []
        due = self._due
        while due and due[0][0] <= now:
            _, _, d = heapq.heappop(due)
            if d.until > now:  # moved on since: due later
                heapq.heappush(due, (d.until, next(self._seq), d))
                continue
            held = self._by_owner.get(d.owner)
            mine = [k for k in d.keys if held and (h := held.get(k)) is not None
                    and h.deadline is d]
            out += self.take(d.owner, mine).values()
        return out

    def next_due(self) -> float | None:
        """The earliest deadline in the table (stale entries included), or None."""
        return self._due[0][0] if self._due else None
