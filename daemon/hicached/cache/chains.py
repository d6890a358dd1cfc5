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
- ``ChainTable(max_bytes, page_size)``: ``note(keys, parent, token_ids)``, ``runs(keys)`` (the
  keys, in order, cut into runs), ``parent_of(key)``, ``bytes_used``, ``entries``.

Thread-safe (one lock of its own, taken inside the pool cache's or a tier's lock, never
around one).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

ENTRY_OVERHEAD_BYTES = 200
"""Bytes one entry costs beyond its parent and tokens (the key, the tuple, the ordered
dict's node), charged against ``max_bytes``."""


@dataclass
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


class ChainTable:
    def __init__(self, max_bytes: int, page_size: int) -> None:
        self.max_bytes, self.page_size = max_bytes, page_size
        self._entries: OrderedDict[bytes, tuple[bytes, bytes | None]] = OrderedDict()
        self.bytes_used = 0
        self._lock = threading.Lock()

    @property
    def entries(self) -> int:
        return len(self._entries)

    @staticmethod
    def _cost(key: bytes, parent: bytes, tokens: bytes | None) -> int:
        return ENTRY_OVERHEAD_BYTES + len(key) + len(parent) + (len(tokens) if tokens else 0)

    def note(self, keys: Sequence[bytes], parent: bytes = b"",
             token_ids: np.ndarray | None = None) -> None:
        """``keys`` are one chain after ``parent``; ``token_ids`` (validated by the caller:
        ``page_size`` per key) their tokens. The oldest entries go first when the table is
        over its budget; the batch just noted always stays (its own events need it)."""
        if not keys:
            return
        raw = (np.ascontiguousarray(token_ids, dtype="<i8").tobytes()
               if token_ids is not None else None)
        step = self.page_size * 8
        with self._lock:
            prev = parent
            for i, k in enumerate(keys):
                tokens = raw[i * step:(i + 1) * step] if raw is not None else None
                old = self._entries.pop(k, None)
                if old is not None:
                    self.bytes_used -= self._cost(k, *old)
                    if tokens is None and old[0] == prev:
                        tokens = old[1]  # the same page noted again without its tokens
                self._entries[k] = (prev, tokens)
                self.bytes_used += self._cost(k, prev, tokens)
                prev = k
            while self.bytes_used > self.max_bytes and len(self._entries) > len(keys):
                k, old = self._entries.popitem(last=False)
                self.bytes_used -= self._cost(k, *old)

    def parent_of(self, key: bytes) -> bytes:
        with self._lock:
            got = self._entries.get(key)
        return got[0] if got is not None else b""

    def runs(self, keys: Sequence[bytes], chain: bool = True) -> list[Run]:
        """``keys`` in order, cut where one is not the parent of the next (or where the
        tokens stop or start being known). A key the table does not know follows the key
        before it when ``chain`` (the keys of one Store), else stands alone."""
        out: list[Run] = []
        with self._lock:
            entries = self._entries
            for i, k in enumerate(keys):
                parent, tokens = entries.get(k, (keys[i - 1] if chain and i else b"", None))
                last = out[-1] if out else None
                if (last is not None and parent and parent == last.keys[-1]
                        and (tokens is None) == (last.tokens is None)):
                    last.keys.append(k)
                    if tokens is not None and last.tokens is not None:
                        last.tokens.append(tokens)
                    continue
                out.append(Run([k], parent, [tokens] if tokens is not None else None))
        return out
