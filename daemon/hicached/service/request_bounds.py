"""The largest legal request of each keyed call: what a front end may receive before decoding.

Decoding a request holds the interpreter lock for as long as it takes; a Lookup of 1.5 M keys
(49 MiB) took a neighbour's call past half a second before ``TOO_MANY_KEYS`` could refuse it.
A front end asks here first and refuses anything larger unread (``RESOURCE_EXHAUSTED``, the
request's size and its bound in the metadata), as the fast path refuses an oversized frame.

Primitives:

- ``KEYED_METHODS``: the calls whose size follows from their keys: Lookup, RemoveKeys,
  ReleaseHolds (keys only) and Store, LoadKeys (keys and a page of device indices per key,
  and for a Store its tokens and up to ``MAX_LOOKAHEAD_TOKENS`` lookahead tokens per key).
- ``RequestBounds(max_keys, page_tokens)``: ``bound(method)``, the bytes of the largest legal
  request in protobuf encoding (None: the method is not bounded here, only by the transport's
  ``max_message_bytes``); ``check(method, nbytes)`` raises the refusal. ``page_tokens`` tells
  the largest page size of the daemon's pools at the moment of asking (indices per key), and is
  asked only of a request larger than the keys alone allow.
"""

from __future__ import annotations

from collections.abc import Callable

from hicache.errors import ResourceExhausted
from hicache.keys import MAX_KEY_BYTES, MAX_LOOKAHEAD_TOKENS

KEYS_ONLY = frozenset({"Lookup", "RemoveKeys", "ReleaseHolds"})
WITH_INDICES = frozenset({"Store", "LoadKeys"})
KEYED_METHODS = KEYS_ONLY | WITH_INDICES

KEY_BYTES = MAX_KEY_BYTES + 2
"""A key on the wire: its tag, its length (one byte up to 127) and its bytes."""
INDEX_BYTES = 8
"""A device index: little-endian int64 in a bytes field."""
TOKEN_BYTES = 11
"""A token id in a packed repeated int64: at most 10 bytes of varint (a negative one), and the
unpacked form's tag."""
FIXED_BYTES = 64 << 10
"""Everything else of a keyed request (pool or session names, the parent key, integers),
with room to spare."""


class RequestBounds:
    def __init__(self, max_keys: int, page_tokens: Callable[[], int]) -> None:
        """``max_keys``: the daemon's ``max_keys_per_call``; ``page_tokens``: the largest
        ``page_size`` of its pools now (0 without pools)."""
        self.max_keys = max_keys
        self._page_tokens = page_tokens
        self.keys_only = max_keys * KEY_BYTES + FIXED_BYTES
        """The bound of a keys-only call, and what any keyed request may be without asking
        about pools."""

    def bound(self, method: str) -> int | None:
        if method in KEYS_ONLY:
            return self.keys_only
        if method in WITH_INDICES:
            store, pages = method == "Store", self._page_tokens()
            per_token = INDEX_BYTES + (TOKEN_BYTES if store else 0)
            # (lookahead tokens come only with a page's own tokens)
            ahead = MAX_LOOKAHEAD_TOKENS * TOKEN_BYTES if store and pages else 0
            return self.keys_only + self.max_keys * (pages * per_token + ahead)
        return None

    def check(self, method: str, nbytes: int) -> None:
        """Refuse a request of ``nbytes`` that no legal ``method`` call reaches."""
        if nbytes <= self.keys_only or method not in KEYED_METHODS:
            return  # the common case: no pool is asked about
        limit = self.bound(method)
        if limit is not None and nbytes > limit:
            raise ResourceExhausted(
                f"a {method} request of {nbytes} bytes is larger than any legal one "
                f"({limit} bytes: max_keys_per_call {self.max_keys} keys of up to "
                f"{MAX_KEY_BYTES} bytes{' and their pages' if method in WITH_INDICES else ''})"
                f"; it was not read", metadata={"field": "request", "method": method,
                                                "length": nbytes, "limit": limit})
