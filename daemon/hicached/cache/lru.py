"""The eviction policy of a pool's keyed pages: least recently used first.

Primitives:

- ``LRU``: ``add(key)`` (most recently used), ``touch(key)``, ``discard(key)``,
  ``pop_oldest(n, busy)`` (keys in ``busy`` passed over while others remain), ``oldest(n)``
  (left in place), ``len``, ``in``. Every operation is O(1) per key (``pop_oldest``: plus the
  busy keys it passes).

It holds only the keys that may be evicted now (ready, and not busy: no copy is using their
pages); the cache adds a key when it becomes evictable and discards it when it stops being so.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection


class LRU:
    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def add(self, key: bytes) -> None:
        """Make ``key`` evictable, as the most recently used."""
        self._order[key] = None
        self._order.move_to_end(key)

    def oldest(self, n: int) -> list[bytes]:
        """Up to ``n`` least recently used keys, oldest first, left in place."""
        out: list[bytes] = []
        for key in self._order:
            if len(out) == n:
                break
            out.append(key)
        return out

    def touch(self, key: bytes) -> None:
        """Mark ``key`` used now, if it is evictable."""
        if key in self._order:
            self._order.move_to_end(key)

    def discard(self, key: bytes) -> None:
        self._order.pop(key, None)

    def pop_oldest(self, n: int, busy: Collection[bytes] = ()) -> list[bytes]:
        """Up to ``n`` least recently used keys, removed from the policy. Keys in ``busy``
        (whose pages are not freed at once: being spilled) are passed over while other keys
        remain, and taken last, oldest first."""
        out: list[bytes] = []
        if not busy:
            while len(out) < n and self._order:
                out.append(self._order.popitem(last=False)[0])
            return out
        passed: list[bytes] = []
        for key in self._order:
            if len(out) == n:
                break
            (passed if key in busy else out).append(key)
        out += passed[:n - len(out)]
        for key in out:
            del self._order[key]
        return out

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
