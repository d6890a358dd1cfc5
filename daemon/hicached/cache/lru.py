"""The eviction policy of a pool's keyed pages: least recently used first.

Primitives:

- ``LRU``: ``add(key, now)`` (most recently used), ``touch(key, now)``, ``discard(key)``,
  ``pop_oldest(n, busy, used)`` (keys in ``busy`` passed over while others remain; ``used``
  gets each popped key's last use), ``oldest(n)`` (left in place), ``len``, ``in``. Every
  operation is O(1) per key (``pop_oldest``: plus the busy keys it passes). ``now`` is the
  caller's clock (``time.monotonic``), read once per batch.

It holds only the keys that may be evicted now (ready, and not busy: no copy is using their
pages); the cache adds a key when it becomes evictable and discards it when it stops being so.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection


class LRU:
    def __init__(self) -> None:
        self._order: OrderedDict[bytes, float] = OrderedDict()
        """Evictable keys, least recently used first, each with the time of its last use."""

    def add(self, key: bytes, now: float) -> None:
        """Make ``key`` evictable, as the most recently used (at ``now``)."""
        self._order[key] = now
        self._order.move_to_end(key)

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

    def touch(self, key: bytes, now: float) -> None:
        """Mark ``key`` used at ``now``, if it is evictable."""
        if key in self._order:
            self._order.move_to_end(key)
            self._order[key] = now

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
