"""The event log of a pool's cache: what each tier of the node stored, removed and evicted, in
order.

Cache-aware routers (SGLang's router, Dynamo) follow it to know which node holds which prefix:
over ``WatchEvents`` and, in the engines' own format, over the daemon's KV event stream
(``hicached.publish.kv_events``).

Primitives:

- ``EventKind``: ``STORED``, ``REMOVED``, ``EVICTED``; ``HOST``, ``DISK``, ``CLUSTER``: the
  tier an event is about (Lookup's tier bytes), ``MEDIUM``: each tier's name in SGLang's
  ``StorageMedium`` (host memory is ``CPU_PINNED`` whether or not the host pins it).
- ``CacheEvent``: ``seq`` (1, 2, ... per pool), ``kind``, ``keys``, ``tier``; a STORED event's
  keys are one chain (``chains``): ``parent`` (the key before the first, "" when unknown) and
  ``tokens`` (``page_size`` per key as little-endian int64 bytes, when known; ``token_ids``:
  the same as an array), ``namespace`` (the Store's LoRA name and cache salt), ``ahead`` and
  ``lookahead`` (the tokens after each page its key's hash covers, ``ahead`` per key, when the
  writer gave them: vLLM's lookahead block hashes; ``lookahead_rows``: one list per key).
- ``EventLog(max_keys, chains, listener)``: ``append(kind, keys, tier, chain)`` (STORED keys
  cut into chain runs, every event at most ``MAX_EVENT_KEYS`` keys; ``listener(event)`` is called
  for each, in order, under the log's lock: it must not block), ``after(seq)`` (the retained
  events after ``seq``), ``wait(seq, timeout)`` (the same, blocking until there is one),
  ``last_seq``, ``kept_keys``, ``chains`` (the pool's ``ChainTable``). It keeps the newest
  events holding at most ``max_keys`` keys in all (a ring: it fills to that and stays); a
  reader that fell further behind sees the gap as a jump in ``seq`` and resyncs with Lookup.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from hicache.keys import NO_NAMESPACE, Namespace
from hicache.locks import condition
from hicached.cache.chains import ChainTable, Run, lookahead_rows

MAX_EVENT_KEYS = 4096
"""Keys per event: a ClearPool of millions of keys becomes many events, each a small message."""

HOST, DISK, CLUSTER = 1, 2, 3
MEDIUM = {HOST: "CPU_PINNED", DISK: "DISK", CLUSTER: "EXTERNAL"}


class EventKind(enum.Enum):
    STORED = 1
    REMOVED = 2
    EVICTED = 3


class CacheEvent(NamedTuple):
    """Immutable, and made in one C call (a frozen dataclass's per-field ``__setattr__`` cost
    every Store a few microseconds: a Store into a full pool appends two events)."""

    seq: int
    kind: EventKind
    keys: tuple[bytes, ...]
    tier: int = HOST
    parent: bytes = b""
    """STORED: the key before ``keys[0]`` in its chain ("" when none is known)."""
    tokens: bytes | None = None
    """STORED: the pages' tokens (``page_size`` per key, little-endian int64), when the writer
    gave them. Bytes, sliced from the Store's own: a Store makes no array for its event (on
    its thread, numpy's small-array calls cost more than the whole chain's bookkeeping)."""

    namespace: Namespace = NO_NAMESPACE
    """STORED: the LoRA adapter and cache salt the Store named the pages under."""
    ahead: int = 0
    """STORED: lookahead tokens per key (0: none told)."""
    lookahead: bytes | None = None
    """STORED: the tokens after each page that its key's hash covers (``ahead`` per key,
    little-endian int64), when the writer gave them."""

    @property
    def token_ids(self) -> np.ndarray | None:
        """``tokens`` as an int64 array (a view of them)."""
        return None if self.tokens is None else np.frombuffer(self.tokens, dtype="<i8")

    @property
    def lookahead_rows(self) -> list[list[int]] | None:
        """``lookahead`` as one list per key (None: none told)."""
        return lookahead_rows(self.lookahead, self.ahead)


class EventLog:
    def __init__(self, max_keys: int = 1 << 18, chains: ChainTable | None = None,
                 listener: Callable[[CacheEvent], None] | None = None) -> None:
        assert max_keys >= MAX_EVENT_KEYS
        self.max_keys = max_keys
        self.chains = chains or ChainTable(0, 1)
        self.listener = listener
        """Called with every event as it is appended (the KV event publisher's queue)."""
        self._events: deque[CacheEvent] = deque()
        self._keys = 0
        self._seq = 0
        self._cond = condition("events")
        self._waiting = 0
        """Readers in ``wait`` now: an append wakes them, and only then pays for a notify."""

    @property
    def kept_keys(self) -> int:
        """Keys of the events kept for replay now (at most ``max_keys``)."""
        with self._cond:
            return self._keys

    @property
    def last_seq(self) -> int:
        with self._cond:
            return self._seq

    def append(self, kind: EventKind, keys: Sequence[bytes], tier: int = HOST,
               chain: bool = True) -> None:
        """``chain``: STORED keys the chain table does not know are one chain in this order
        (a Store's); False: each stands alone (a spill's or a promotion's)."""
        if not keys:
            return
        if kind is EventKind.STORED:
            runs = self.chains.runs(keys, chain)
        else:
            self.chains.forget(keys, tier)  # gone from the pool's last tier: its chain too
            if len(keys) <= MAX_EVENT_KEYS:
                with self._cond:  # one event, no chain to look up (the common eviction)
                    self._seq += 1
                    self._add(CacheEvent(self._seq, kind, tuple(keys), tier))
                return
            runs = [Run(list(keys), b"")]
        step = self.chains.page_size * 8
        with self._cond:
            for run in runs:
                run_keys, parent, tokens = run.keys, run.parent, run.token_bytes()
                ahead, lookahead = run.ahead, run.lookahead_bytes()
                for i in range(0, len(run_keys), MAX_EVENT_KEYS):
                    self._seq += 1
                    chunk = tuple(run_keys[i:i + MAX_EVENT_KEYS])
                    self._add(CacheEvent(
                        self._seq, kind, chunk, tier, run_keys[i - 1] if i else parent,
                        tokens[i * step:(i + len(chunk)) * step] if tokens is not None
                        else None, run.namespace, ahead,
                        lookahead[i * ahead * 8:(i + len(chunk)) * ahead * 8]
                        if lookahead is not None else None))

    def _add(self, event: CacheEvent) -> None:
        """Keep ``event`` (lock held): tell the listener, drop the oldest past ``max_keys``,
        wake waiting readers."""
        self._events.append(event)
        self._keys += len(event.keys)
        if self.listener is not None:
            self.listener(event)
        while self._keys > self.max_keys:
            self._keys -= len(self._events.popleft().keys)
        if self._waiting:
            self._cond.notify_all()

    def after(self, seq: int) -> list[CacheEvent]:
        """Retained events with a sequence number above ``seq``, oldest first."""
        with self._cond:
            return self._after(seq)

    def wait(self, seq: int, timeout: float) -> list[CacheEvent]:
        """``after(seq)``, waiting up to ``timeout`` seconds for one to exist."""
        with self._cond:
            self._waiting += 1
            try:
                self._cond.wait_for(lambda: self._seq > seq, timeout)
            finally:
                self._waiting -= 1
            return self._after(seq)

    def _after(self, seq: int) -> list[CacheEvent]:
        """O(events returned): a reader that keeps up never walks the whole log."""
        count = min(self._seq - seq, len(self._events))
        if count <= 0:
            return []
        newest = list(itertools.islice(reversed(self._events), count))
        newest.reverse()
        return newest
