"""What a pool knows of the chains its keys belong to: each key's parent and its tokens.

Engines name a page by a chained hash (SGLang: the SHA-256 of the previous page's digest and
this page's tokens), so a prefix is a chain of keys. Routers rebuild prefixes from the chain
(``BlockStored.parent_block_hash``) and some of them from the tokens too (Dynamo hashes a
page's tokens itself). A Store's keys are one chain, in order: each key's parent is the key
before it, the first one's is the Store's ``parent_key`` ("" when the writer did not say);
its ``token_ids``, when given, are ``page_size`` per key. The table keeps that for the keys
noted most recently, within a byte budget, so that the events of a key's later moves (a
spill to disk, a put to the cluster, a promotion back into host memory) carry it again. A key
the table no longer has is published alone, with no parent and no tokens (or, in one Store's
batch, after the key before it).

vLLM's lookahead block hashes (vLLM 0.34 with EAGLE / MTP) cover the tokens after a block too:
a Store may say them (``lookahead``: as many per key, beside its tokens), and the table keeps
them with the tokens, so every later event of the key says them again.

A key's entry lives while the pool may still publish the key: it is forgotten when the key
leaves the pool's last local tier (``forget``: evicted or removed from host memory in a pool
with no tier below it, from the disk in one with a disk tier), or, oldest Store first, when
the table is over its byte budget (a pool whose last tier is the cluster, which says nothing
of its own evictions, relies on that alone). So in a host-only pool the table holds about as
many keys as the pool: a Store's ``note`` costs a few dict operations in a small table, not
in one of every key stored since the start (a table 280 times its pool made each 64-page
Store ~30 us slower and its growth faulted pages in on the Store path).

Primitives:

- ``Run``: keys that follow one another in one chain, the parent of the first, their tokens
  (``page_size`` per key, or None when not all of them are known), their namespace (the
  Store's LoRA name and cache salt: ``hicache.keys.Namespace``), their lookahead tokens
  (``ahead`` per key, or None).
- ``ChainTable(max_bytes, page_size, last_tier)``: ``note(keys, parent, token_ids, namespace,
  lookahead)`` (one
  Store's batch, kept whole while any of its keys is; the oldest batches go first over the
  budget), ``forget(keys, tier)`` (the keys left ``tier``: dropped when it is the last),
  ``runs(keys, chain)`` (the keys, in order, cut into runs), ``parent_of(key)``,
  ``bytes_used``, ``entries``, ``last_tier`` (set by the pool's tier stack).

Thread-safe (one lock of its own, taken inside the pool cache's or a tier's lock, never
around one).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hicache.keys import NO_NAMESPACE, Namespace
from hicache.locks import lock

ENTRY_OVERHEAD_BYTES = 200
"""Bytes one key's entry costs beyond its parent and tokens (the key, its slot in the index,
its share of the batch), charged against ``max_bytes``."""


@dataclass(slots=True)
class Run:
    keys: list[bytes]
    parent: bytes
    """The key before ``keys[0]`` in its chain; "" when none is known (the chain's start)."""
    tokens: list[bytes] | None = field(default=None)
    """The keys' tokens as little-endian int64 bytes, in pieces that concatenate to
    ``page_size`` per key (one per key, or a Store's whole batch), or None when one of them is
    unknown."""

    namespace: Namespace = NO_NAMESPACE
    """The LoRA adapter and cache salt the Store named the keys under."""
    ahead: int = 0
    """Lookahead tokens per key (0: none told)."""
    lookahead: list[bytes] | None = field(default=None)
    """The keys' lookahead tokens as little-endian int64 bytes, in pieces that concatenate to
    ``ahead`` per key; None when not told (then ``ahead`` is 0)."""

    def token_bytes(self) -> bytes | None:
        return None if self.tokens is None else b"".join(self.tokens)

    def lookahead_bytes(self) -> bytes | None:
        return None if self.lookahead is None else b"".join(self.lookahead)

    def lookahead_rows(self) -> list[list[int]] | None:
        """The lookahead tokens, one list per key."""
        return lookahead_rows(self.lookahead_bytes(), self.ahead)

    def token_ids(self) -> np.ndarray | None:
        raw = self.token_bytes()
        return None if raw is None else np.frombuffer(raw, dtype="<i8")


@dataclass(eq=False, slots=True)
class _Batch:
    """What one Store said: its keys, the parent of the first, their tokens; ``live``: how
    many of its keys the table still answers from it (its bytes are charged until none)."""

    keys: tuple[bytes, ...]
    parent: bytes
    tokens: bytes | None
    cost: int
    live: int
    namespace: Namespace
    ahead: int = 0
    lookahead: bytes | None = None
    pos: dict[bytes, int] | None = None
    """Each key's place in ``keys``, made when a key is first asked about alone."""

    def place(self, key: bytes) -> int:
        if self.pos is None:
            self.pos = dict(zip(self.keys, range(len(self.keys)), strict=True))
        return self.pos[key]


def lookahead_rows(raw: bytes | None, ahead: int) -> list[list[int]] | None:
    """``ahead`` little-endian int64 ids per key as one list per key (None: none)."""
    if raw is None or not ahead:
        return None
    rows: list[list[int]] = np.frombuffer(raw, dtype="<i8").reshape(-1, ahead).tolist()
    return rows


HOST_TIER = 1
"""``hicached.cache.events.HOST`` (not imported: the event log imports this module)."""


class ChainTable:
    def __init__(self, max_bytes: int, page_size: int, last_tier: int = HOST_TIER) -> None:
        self.max_bytes, self.page_size = max_bytes, page_size
        self.last_tier = last_tier
        """The tier whose evictions and removals end a key's entry (the pool's lowest local
        tier: host memory, or the disk when the pool has one)."""
        self._entries: dict[bytes, _Batch] = {}
        self._batches: deque[_Batch] = deque()
        self._dead = 0
        """Batches in ``_batches`` with no live key left (dropped when they are half)."""
        self.bytes_used = 0
        self._lock = lock("chains")

    @property
    def entries(self) -> int:
        return len(self._entries)

    def note(self, keys: Sequence[bytes], parent: bytes = b"",
             token_ids: np.ndarray | bytes | None = None,
             namespace: Namespace = NO_NAMESPACE,
             lookahead: tuple[int, bytes] | None = None) -> None:
        """``keys`` (distinct: the caller's check) are one chain after ``parent``;
        ``token_ids`` (validated by the caller: ``page_size`` per key; ``bytes``: as
        little-endian int64) their tokens, ``lookahead`` (per key, the ids as little-endian
        int64; validated by the caller, and only with tokens) the tokens after each. The
        oldest batches go first when the table is over its budget; the batch just noted
        always stays (its own events need it). C-level passes only, for keys the table does
        not know yet: a Store pays no Python loop over its keys here."""
        if not keys:
            return
        raw = (token_ids if token_ids is None or isinstance(token_ids, bytes)
               else np.ascontiguousarray(token_ids, dtype="<i8").tobytes())
        batch = _Batch(tuple(keys), parent, raw, len(keys) * (ENTRY_OVERHEAD_BYTES
                                                              + len(keys[0]))
                       + len(parent) + (len(raw) if raw else 0)
                       + len(namespace.lora_name) + len(namespace.cache_salt)
                       + (len(lookahead[1]) if lookahead else 0), len(keys), namespace,
                       *(lookahead if lookahead and raw is not None else (0, None)))
        with self._lock:
            entries = self._entries
            if not entries.keys().isdisjoint(batch.keys):  # noted before: moved here
                self._lose(list(map(entries.get, batch.keys)))
            entries.update(dict.fromkeys(batch.keys, batch))
            self._batches.append(batch)
            self.bytes_used += batch.cost
            while self.bytes_used > self.max_bytes and len(self._batches) > 1:
                old = self._batches.popleft()
                if not old.live:
                    self._dead -= 1
                    continue
                for k in old.keys:  # unless a later Store noted it again
                    if entries.get(k) is old:
                        del entries[k]
                self._lose([old] * old.live)
                self._dead -= 1
            if self._dead > 64 and 2 * self._dead > len(self._batches):
                self._compact()

    def forget(self, keys: Sequence[bytes], tier: int) -> None:
        """``keys`` left ``tier`` (evicted or removed): when it is the table's last tier, the
        pool no longer has them and their entries go (a batch with none left gives back its
        bytes)."""
        if tier != self.last_tier or not keys:
            return
        with self._lock:
            self._lose(list(map(self._entries.pop, keys, itertools.repeat(None))))
            if self._dead > 64 and 2 * self._dead > len(self._batches):
                self._compact()

    def _lose(self, batches: list[_Batch | None]) -> None:
        """Each entry a batch no longer answers for, one per key (None: no entry); a batch
        with none left gives back its bytes, keys and tokens (its shell waits for
        ``_compact``). Lock held. One C-level count per batch: a Store's keys are few
        batches."""
        for batch in set(batches):
            if batch is None:
                continue
            batch.live -= batches.count(batch)
            if not batch.live:
                self.bytes_used -= batch.cost
                self._dead += 1
                batch.keys, batch.tokens, batch.pos, batch.lookahead = (), None, None, None

    def _compact(self) -> None:
        """Batches with no live key leave the queue (lock held; called once they are half of
        it): a batch kept alive by one long-lived key does not keep the dead ones behind it."""
        self._batches = deque(b for b in self._batches if b.live)
        self._dead = 0

    def _info(self, key: bytes
              ) -> tuple[bytes, bytes | None, Namespace, int, bytes | None] | None:
        """(parent, tokens, namespace, lookahead per key, lookahead tokens) of a noted key
        (lock held)."""
        batch = self._entries.get(key)
        if batch is None:
            return None
        i = batch.place(key)
        step = self.page_size * 8
        tokens = batch.tokens[i * step:(i + 1) * step] if batch.tokens is not None else None
        ahead = batch.ahead * 8
        return ((batch.keys[i - 1] if i else batch.parent), tokens, batch.namespace,
                batch.ahead, batch.lookahead[i * ahead:(i + 1) * ahead]
                if batch.lookahead is not None else None)

    def parent_of(self, key: bytes) -> bytes:
        with self._lock:
            got = self._info(key)
        return got[0] if got is not None else b""

    def runs(self, keys: Sequence[bytes], chain: bool = True) -> list[Run]:
        """``keys`` in order, cut where one is not the parent of the next (or where the
        tokens, or their lookahead tokens, stop or start being known, or the namespace
        changes). A key the table does not know follows the key
        before it when ``chain`` (the keys of one Store), else stands alone."""
        with self._lock:
            batch = self._entries.get(keys[0]) if keys else None
            if batch is not None and batch.keys == tuple(keys):
                # one Store's keys as it gave them: its chain, whole
                return [Run(list(keys), batch.parent,
                            None if batch.tokens is None else [batch.tokens], batch.namespace,
                            batch.ahead,
                            None if batch.lookahead is None else [batch.lookahead])]
            out: list[Run] = []
            for i, k in enumerate(keys):
                parent, tokens, namespace, ahead, lookahead = self._info(k) or (
                    keys[i - 1] if chain and i else b"", None,
                    out[-1].namespace if chain and out else NO_NAMESPACE, 0, None)
                last = out[-1] if out else None
                if (last is not None and parent and parent == last.keys[-1]
                        and (tokens is None) == (last.tokens is None)
                        and namespace == last.namespace and ahead == last.ahead):
                    last.keys.append(k)
                    if tokens is not None and last.tokens is not None:
                        last.tokens.append(tokens)
                    if lookahead is not None and last.lookahead is not None:
                        last.lookahead.append(lookahead)
                    continue
                out.append(Run([k], parent, [tokens] if tokens is not None else None,
                               namespace, ahead,
                               [lookahead] if lookahead is not None else None))
        return out
