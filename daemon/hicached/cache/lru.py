"""The eviction policy of a pool's keyed pages: least recently used first.

Primitives:

- ``LRU``: ``add(keys, now)`` (newly ready: most recently used), ``back(keys, now)`` (evictable
  again after being read: the same), ``touch(keys, now)``, ``discard(key)``,
  ``pop_oldest(n, busy, used)`` (keys in ``busy`` passed over while others remain; ``used``
  gets each popped key's last use), ``oldest(n)`` (left in place), ``len``, ``in``. Every
  operation is O(1) per key (``pop_oldest``: plus the busy keys it passes). ``now`` is the
  caller's clock (``time.monotonic``), read once per batch; a batch's keys are in chain order
and the last becomes the most recent. ``reuse_lru.ReuseLRU`` keeps the same contract.

It holds only the keys that may be evicted now (ready, and not busy: no copy is using their
pages); the cache adds a key when it becomes evictable and discards it when it stops being so.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence


class LRU:
    def __init__(self) -> None:
        self._order: OrderedDict[bytes, float] = OrderedDict()
        """Evictable keys, least recently used first, each with the time of its last use."""

    def add(self, keys: Sequence[bytes], now: float) -> None:
        """Make ``keys`` evictable, as the most recently used (at ``now``)."""
        order = self._order
        for key in keys:
            order[key] = now
            order.move_to_end(key)

    back = add

    def oldest(self, n: int) -> list[bytes]:
        """Up to ``n`` least recently used keys, oldest first, left in place."""
        out: list[bytes] = []
        for key in self._order:
            if len(out) == n:
                break
            out.append(key)
        return out

    def oldest_use(self) -> float | None:
        """When the least recently used key was last used (None when there is none)."""
        for last in self._order.values():
            return last
        return None

    def touch(self, keys: Sequence[bytes], now: float) -> None:
        """Mark ``keys`` used at ``now``, those that are evictable."""
        order = self._order
        for key in keys:
            if key in order:
                order.move_to_end(key)
                order[key] = now

    def discard(self, key: bytes) -> None:
        self._order.pop(key, None)

    def pop_oldest(self, n: int, busy: Collection[bytes] = (),
                   used: list[float] | None = None) -> list[bytes]:
        """Up to ``n`` least recently used keys, removed from the policy. Keys in ``busy``
        (whose pages are not freed at once: being spilled) are passed over while other keys
        remain, and taken last, oldest first. ``used``, if given, gets the time of each
        popped key's last use, in the same order."""
        out: list[bytes] = []
        order = self._order
        if not busy:
            while len(out) < n and order:
                key, last = order.popitem(last=False)
                out.append(key)
                if used is not None:
                    used.append(last)
            return out
        passed: list[bytes] = []
        for key in order:
            if len(out) == n:
                break
            (passed if key in busy else out).append(key)
        out += passed[:n - len(out)]
        for key in out:
            last = order.pop(key)
            if used is not None:
                used.append(last)
        return out

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
