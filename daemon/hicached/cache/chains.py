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

Primitives:

- ``Run``: keys that follow one another in one chain, the parent of the first, their tokens
  (``page_size`` per key, or None when not all of them are known).
- ``ChainTable(max_bytes, page_size)``: ``note(keys, parent, token_ids)`` (one Store's batch,
  kept whole; the oldest batches go first), ``runs(keys, chain)`` (the keys, in order, cut
  into runs), ``parent_of(key)``, ``bytes_used``, ``entries``.

Thread-safe (one lock of its own, taken inside the pool cache's or a tier's lock, never
around one).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

ENTRY_OVERHEAD_BYTES = 200
"""Bytes one key's entry costs beyond its parent and tokens (the key, its slot in the index,
its share of the batch), charged against ``max_bytes``."""


@dataclass(slots=True)
class Run:
    keys: list[bytes]
    parent: bytes
    """The key before ``keys[0]`` in its chain; "" when none is known (the chain's start)."""
    tokens: list[bytes] | None = field(default=None)
    """Each key's tokens as little-endian int64 bytes, or None when one of them is unknown."""

    def token_ids(self) -> np.ndarray | None:
        if self.tokens is None:
            return None
        return np.frombuffer(b"".join(self.tokens), dtype="<i8")


@dataclass(eq=False, slots=True)
class _Batch:
    """What one Store said: its keys, the parent of the first, their tokens."""

    keys: tuple[bytes, ...]
    parent: bytes
    tokens: bytes | None
    cost: int


class ChainTable:
    def __init__(self, max_bytes: int, page_size: int) -> None:
        self.max_bytes, self.page_size = max_bytes, page_size
        self._entries: dict[bytes, tuple[_Batch, int]] = {}
        self._batches: deque[_Batch] = deque()
        self.bytes_used = 0
        self._lock = threading.Lock()

    @property
    def entries(self) -> int:
        return len(self._entries)

    def note(self, keys: Sequence[bytes], parent: bytes = b"",
             token_ids: np.ndarray | None = None) -> None:
        """``keys`` are one chain after ``parent``; ``token_ids`` (validated by the caller:
        ``page_size`` per key) their tokens. The oldest batches go first when the table is
        over its budget; the batch just noted always stays (its own events need it). A few
        C-level passes per batch: a Store pays no Python loop over its keys here."""
        if not keys:
            return
        raw = (np.ascontiguousarray(token_ids, dtype="<i8").tobytes()
               if token_ids is not None else None)
        batch = _Batch(tuple(keys), parent, raw, len(keys) * (ENTRY_OVERHEAD_BYTES
                                                              + len(keys[0]))
                       + len(parent) + (len(raw) if raw else 0))
        with self._lock:
            self._entries.update(zip(batch.keys, zip(itertools.repeat(batch),
                                                     range(len(keys))), strict=True))
            self._batches.append(batch)
            self.bytes_used += batch.cost
            while self.bytes_used > self.max_bytes and len(self._batches) > 1:
                old = self._batches.popleft()
                self.bytes_used -= old.cost
                entries = self._entries
                for k in old.keys:  # unless a later Store noted it again
                    got = entries.get(k)
                    if got is not None and got[0] is old:
                        del entries[k]

    def _info(self, key: bytes) -> tuple[bytes, bytes | None] | None:
        """(parent, tokens) of a noted key (lock held)."""
        got = self._entries.get(key)
        if got is None:
            return None
        batch, i = got
        step = self.page_size * 8
        tokens = batch.tokens[i * step:(i + 1) * step] if batch.tokens is not None else None
        return (batch.keys[i - 1] if i else batch.parent), tokens

    def parent_of(self, key: bytes) -> bytes:
        with self._lock:
            got = self._info(key)
        return got[0] if got is not None else b""

    def runs(self, keys: Sequence[bytes], chain: bool = True) -> list[Run]:
        """``keys`` in order, cut where one is not the parent of the next (or where the
        tokens stop or start being known). A key the table does not know follows the key
        before it when ``chain`` (the keys of one Store), else stands alone."""
        with self._lock:
            got = self._entries.get(keys[0]) if keys else None
            if got is not None and got[1] == 0 and got[0].keys == tuple(keys):
                batch = got[0]  # one Store's keys as it gave them: its chain, whole
                step = self.page_size * 8
                pages = (None if batch.tokens is None else
                         [batch.tokens[i:i + step] for i in range(0, len(batch.tokens), step)])
                return [Run(list(keys), batch.parent, pages)]
            out: list[Run] = []
            for i, k in enumerate(keys):
                parent, tokens = self._info(k) or (keys[i - 1] if chain and i else b"", None)
                last = out[-1] if out else None
                if (last is not None and parent and parent == last.keys[-1]
                        and (tokens is None) == (last.tokens is None)):
                    last.keys.append(k)
                    if tokens is not None and last.tokens is not None:
                        last.tokens.append(tokens)
                    continue
                out.append(Run([k], parent, [tokens] if tokens is not None else None))
        return out
