"""The event log of a pool's cache: what was stored, removed and evicted, in order.

Cache-aware routers (SGLang's router, Dynamo) follow it to know which node holds which prefix.

Primitives:

- ``EventKind``: ``STORED``, ``REMOVED``, ``EVICTED``.
- ``CacheEvent``: ``seq`` (1, 2, ... per pool), ``kind``, ``keys``.
- ``EventLog(max_keys)``: ``append(kind, keys)`` (split into events of at most
  ``MAX_EVENT_KEYS`` keys), ``after(seq)`` (the retained events after ``seq``), ``wait(seq,
  timeout)`` (the same, blocking until there is one), ``last_seq``. It keeps the newest events
  holding at most ``max_keys`` keys in all; a reader that fell further behind sees the gap as a
  jump in ``seq`` and resyncs with Lookup.
"""

from __future__ import annotations

import enum
import itertools
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

MAX_EVENT_KEYS = 4096
"""Keys per event: a ClearPool of millions of keys becomes many events, each a small message."""


class EventKind(enum.Enum):
    STORED = 1
    REMOVED = 2
    EVICTED = 3


@dataclass(frozen=True)
class CacheEvent:
    seq: int
    kind: EventKind
    keys: tuple[bytes, ...]


class EventLog:
    def __init__(self, max_keys: int = 1 << 18) -> None:
        assert max_keys >= MAX_EVENT_KEYS
        self.max_keys = max_keys
        self._events: deque[CacheEvent] = deque()
        self._keys = 0
        self._seq = 0
        self._cond = threading.Condition()

    @property
    def last_seq(self) -> int:
        with self._cond:
            return self._seq

    def append(self, kind: EventKind, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        with self._cond:
            for i in range(0, len(keys), MAX_EVENT_KEYS):
                self._seq += 1
                chunk = tuple(keys[i:i + MAX_EVENT_KEYS])
                self._events.append(CacheEvent(self._seq, kind, chunk))
                self._keys += len(chunk)
            while self._keys > self.max_keys:
                self._keys -= len(self._events.popleft().keys)
            self._cond.notify_all()

    def after(self, seq: int) -> list[CacheEvent]:
        """Retained events with a sequence number above ``seq``, oldest first."""
        with self._cond:
            return self._after(seq)

    def wait(self, seq: int, timeout: float) -> list[CacheEvent]:
        """``after(seq)``, waiting up to ``timeout`` seconds for one to exist."""
        with self._cond:
            self._cond.wait_for(lambda: self._seq > seq, timeout)
            return self._after(seq)

    def _after(self, seq: int) -> list[CacheEvent]:
        """O(events returned): a reader that keeps up never walks the whole log."""
        count = min(self._seq - seq, len(self._events))
        if count <= 0:
            return []
        newest = list(itertools.islice(reversed(self._events), count))
        newest.reverse()
        return newest
