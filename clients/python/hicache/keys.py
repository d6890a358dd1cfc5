"""Cache keys: what names a page, how a batch of them is checked, how SGLang computes them.

A key is 1..64 opaque bytes naming one whole page of a pool (the pool is the namespace: model,
rank and geometry). SGLang names a page by a chained SHA-256: the digest of the previous page's
digest followed by this page's token ids.

Primitives:

- ``MAX_KEY_BYTES``: 64.
- ``check_keys(keys, field, unique, limit)``: the keys as ``bytes``; ``TOO_MANY_KEYS`` for more
  than ``limit``, ``KEY_INVALID`` for keys that are empty, too long or not bytes,
  ``DUPLICATE_KEY`` (when ``unique``) for keys given twice: one violation per kind, with the
  count and the first position. ``raise_too_many(count, limit)``: that first refusal alone
  (the fast path's decoder uses it before it builds the keys).
- ``SameWidthKeys(keys, width)``: a batch known to be bytes of one width (decoded so).
- ``check_chain(count, page_size, token_ids, parent_key)``: a Store's chain (``token_ids``:
  ``page_size`` per key, non-negative, else ``TOKEN_IDS_INVALID``; ``parent_key``: "" or a
  key, else ``KEY_INVALID`` naming ``parent_key``), as (the tokens as little-endian int64
  bytes, or None; the parent). ``token_ids`` may already be such bytes (the fast path's
  frame carries them so): checked as they are, with no array made (a 1-page Store's
  tokens cost ~1 us here, where numpy's small-array calls cost several).
- ``check_lookahead(count, per_key, token_ids, with_tokens)``: a Store's lookahead tokens
  (vLLM's lookahead block hashes: the tokens after each page its key's hash covers;
  ``per_key`` at most ``MAX_LOOKAHEAD_TOKENS``, that many per key, non-negative, only with
  the pages' own tokens, else ``TOKEN_IDS_INVALID`` naming the field), as little-endian int64
  bytes, or None.
- ``Namespace(lora_name, cache_salt)``: what besides its tokens names a page to a router (the
  LoRA adapter, "" = the base model; the request's cache salt, "" = none), as the engines'
  own events say it; ``NO_NAMESPACE``; ``check_namespace(lora_name, cache_salt)``: at most
  ``MAX_NAME_BYTES`` UTF-8 bytes each, else ``KEY_INVALID`` naming the field.
- ``encode_keys(keys)``: keys as a worker may give them (bytes, or hex strings as SGLang's
  ``hash_value``) as bytes for the wire; ``KEY_INVALID`` for a string that is not hex.
- ``sglang_page_hashes(token_ids, page_size, prior_hash)``: SGLang's ``get_hash_str(token_ids,
  prior_hash, page_size)``, computed the same way (``sglang/srt/mem_cache/cpp_utils/
  hash_binding.cpp``): per page, SHA-256 of the prior page's 32-byte digest (when there is one)
  and the page's token ids as little-endian uint32, or, when a token id does not fit in 32
  bits, a 0xff byte and the ids as uint64. Hex strings, one per page, the last page possibly
  partial, exactly as SGLang returns them.
- ``sglang_page_keys(...)``: the same as 32-byte keys, for whole pages only (what a cache
  stores).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from hicache.errors import (
    DuplicateKey,
    KeyInvalid,
    TokenIdsInvalid,
    TooManyKeys,
    Violation,
    raise_violations,
)

MAX_KEY_BYTES = 64
_WIDE_TAG = b"\xff"
_U32_MAX = (1 << 32) - 1


class SameWidthKeys(list[bytes]):
    """Keys known to be bytes of one ``width`` (the fast path's framing decodes them so):
    ``check_keys`` need not look at each."""

    __slots__ = ("width",)

    def __init__(self, keys: Sequence[bytes], width: int) -> None:
        super().__init__(keys)
        self.width = width


def check_keys(keys: Sequence[object], field: str = "keys", unique: bool = False,
               limit: int | None = None) -> list[bytes]:
    """Every key 1..MAX_KEY_BYTES bytes (and, with ``unique``, none twice); at most ``limit``
    of them (``TOO_MANY_KEYS``, checked first). A valid batch costs a few C-level passes; only
    a bad one is walked key by key, and each kind of fault is reported once, with its count and
    first position, so that the error stays small whatever the batch."""
    if limit is not None and len(keys) > limit:
        raise_too_many(len(keys), limit, field)
    if type(keys) is SameWidthKeys and 1 <= keys.width <= MAX_KEY_BYTES and not unique:
        return keys
    batch = list(keys)
    if not batch:
        return []
    if set(map(type, batch)) == {bytes}:
        fast: list[bytes] = batch  # type: ignore[assignment]
        lengths = set(map(len, fast))
        if (min(lengths) >= 1 and max(lengths) <= MAX_KEY_BYTES) and (
                not unique or len(set(fast)) == len(fast)):
            return fast
    return _check_each(batch, field, unique)


def raise_too_many(count: int, limit: int, field: str = "keys") -> None:
    """``TOO_MANY_KEYS`` for a call naming ``count`` keys where the daemon takes ``limit``."""
    raise TooManyKeys(f"{field} has {count} keys; the daemon takes at most {limit} per call "
                      f"(max_keys_per_call): split the batch",
                      metadata={"field": field, "count": count, "max": limit})


class _Fault:
    """One kind of bad key: how many, and the first (position and what to say of it)."""

    __slots__ = ("count", "first", "meta")

    def __init__(self) -> None:
        self.count, self.first = 0, -1
        self.meta: dict[str, object] = {}

    def add(self, pos: int, **meta: object) -> None:
        if not self.count:
            self.first, self.meta = pos, meta
        self.count += 1


def _check_each(keys: Sequence[object], field: str, unique: bool) -> list[bytes]:
    out: list[bytes] = []
    not_bytes, bad_length, repeated = _Fault(), _Fault(), _Fault()
    first_at: dict[bytes, int] = {}
    for pos, key in enumerate(keys):
        if not isinstance(key, bytes | bytearray | memoryview):
            not_bytes.add(pos, type=type(key).__name__)
            continue
        k = bytes(key)
        if not 1 <= len(k) <= MAX_KEY_BYTES:
            bad_length.add(pos, length=len(k))
        elif unique:
            seen = first_at.setdefault(k, pos)
            if seen != pos:
                repeated.add(pos, first_position=seen)
        out.append(k)
    violations: list[Violation] = []
    for fault, reason, what in (
            (not_bytes, KeyInvalid.reason, "not bytes (first: {type})"),
            (bad_length, KeyInvalid.reason,
             f"not 1..{MAX_KEY_BYTES} bytes long (first: {{length}} bytes)"),
            (repeated, DuplicateKey.reason,
             "repeated: one batch names each page once (first repeats {field}"
             "[{first_position}])")):
        if fault.count:
            said = what.format(field=field, **fault.meta)
            violations.append(Violation(
                field, reason, f"{fault.count} key(s) of {field} {said}; first at "
                f"{field}[{fault.first}]",
                {"field": field, "position": fault.first, "count": fault.count, **fault.meta}))
    violations.sort(key=lambda v: int(v.metadata["position"]))  # type: ignore[call-overload]
    raise_violations(violations)
    return out


def check_chain(count: int, page_size: int,
                token_ids: Sequence[int] | np.ndarray | bytes | None,
                parent_key: bytes = b"") -> tuple[bytes | None, bytes]:
    """What a Store says of its keys' chain, checked: the tokens (little-endian int64 bytes,
    None when none were given) and the parent key. Nothing else of the Store depends on them,
    but a bad one refuses the Store whole, before any page is taken. ``bytes`` tokens are
    little-endian int64 already (as the fast path's frame carries them)."""
    if len(parent_key) > MAX_KEY_BYTES:
        raise KeyInvalid(f"parent_key is {len(parent_key)} bytes; a key is at most "
                         f"{MAX_KEY_BYTES}", metadata={"field": "parent_key",
                                                       "length": len(parent_key)})
    if token_ids is None or len(token_ids) == 0:
        return None, bytes(parent_key)
    return _token_bytes("token_ids", token_ids, count * page_size,
                        f"{count} key(s) of {page_size} tokens"), bytes(parent_key)


MAX_LOOKAHEAD_TOKENS = 16
"""The most lookahead tokens a Store may give per key. vLLM 0.34 hashes
``num_hash_lookahead_tokens`` tokens after each block into its hash: 1 with EAGLE's drafters,
``num_speculative_tokens`` with a multi-module MTP chain (a few); the bound keeps what the
largest legal Store may be (``RequestBounds``) within 11 bytes x 16 per key more."""


def check_lookahead(count: int, per_key: int,
                    token_ids: Sequence[int] | np.ndarray | bytes | None,
                    with_tokens: bool) -> bytes | None:
    """A Store's lookahead tokens, checked (``TOKEN_IDS_INVALID`` naming the field): ``per_key``
    (``lookahead_tokens``) at most ``MAX_LOOKAHEAD_TOKENS``, ``token_ids`` that many per key,
    non-negative, and only beside the pages' own tokens (``with_tokens``); the ids as
    little-endian int64 bytes, or None when none were given."""
    if not 0 <= per_key <= MAX_LOOKAHEAD_TOKENS:
        raise TokenIdsInvalid(
            f"lookahead_tokens is {per_key}; it is 0 to {MAX_LOOKAHEAD_TOKENS}",
            metadata={"field": "lookahead_tokens", "value": per_key,
                      "max": MAX_LOOKAHEAD_TOKENS})
    given = token_ids is not None and len(token_ids) > 0
    if not given and not per_key:
        return None
    if not with_tokens:
        raise TokenIdsInvalid(
            "lookahead_token_ids without token_ids: a page's lookahead tokens are told "
            "only with its own", metadata={"field": "lookahead_token_ids", "token_ids": 0})
    return _token_bytes("lookahead_token_ids", token_ids if given else b"", count * per_key,
                        f"{count} key(s) of {per_key} lookahead tokens")


def _token_bytes(field: str, token_ids: Sequence[int] | np.ndarray | bytes | None,
                 expected: int, what: str) -> bytes:
    """``token_ids`` as little-endian int64 bytes, ``expected`` ids, none negative
    (``TOKEN_IDS_INVALID`` naming ``field``); ``bytes`` are checked as they are."""
    if isinstance(token_ids, bytes):
        raw = token_ids
        if len(raw) % 8:
            raise TokenIdsInvalid(f"{field} is {len(raw)} bytes, not whole int64 ids",
                                  metadata={"field": field, "bytes": len(raw)})
    else:
        tokens = np.asarray(token_ids)
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise TokenIdsInvalid(f"{field} must be a flat sequence of integers",
                                  metadata={"field": field, "dtype": str(tokens.dtype)})
        if tokens.dtype.kind == "u" and tokens.size and int(tokens.max()) >= 1 << 63:
            raise TokenIdsInvalid(f"{field} has an id of 2**63 or more",
                                  metadata={"field": field,
                                            "position": int(np.argmax(tokens >= 1 << 63))})
        raw = np.ascontiguousarray(tokens, dtype="<i8").tobytes()
    if len(raw) != 8 * expected:
        raise TokenIdsInvalid(
            f"{field} has {len(raw) // 8} ids for {what}: {expected} expected (or none)",
            metadata={"field": field, "count": len(raw) // 8, "expected": expected})
    signs = raw[7::8]  # each id's top byte: a negative id's has its high bit set
    if signs.translate(None, _NON_NEGATIVE_TOP):
        first = next(i for i, b in enumerate(signs) if b & 0x80)
        raise TokenIdsInvalid(f"{field}[{first}] is negative: token ids are >= 0",
                              metadata={"field": field, "position": first})
    return raw


class Namespace(NamedTuple):
    lora_name: str = ""
    """The LoRA adapter whose KV the pages are ("" = the base model)."""
    cache_salt: str = ""
    """The cache salt of the request that wrote them ("" = none)."""


NO_NAMESPACE = Namespace()
MAX_NAME_BYTES = 255
"""A ``lora_name`` or ``cache_salt`` is at most this many UTF-8 bytes."""


def check_namespace(lora_name: str = "", cache_salt: str = "") -> Namespace:
    """A Store's namespace, checked (``KEY_INVALID`` naming the field for one that is not a
    string, is not valid Unicode or is longer than ``MAX_NAME_BYTES`` in UTF-8)."""
    if not lora_name and not cache_salt:
        return NO_NAMESPACE
    for field, value in (("lora_name", lora_name), ("cache_salt", cache_salt)):
        if not isinstance(value, str):
            raise KeyInvalid(f"{field} must be a string", metadata={"field": field})
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            raise KeyInvalid(f"{field} is not valid Unicode",
                             metadata={"field": field}) from None
        if size > MAX_NAME_BYTES:
            raise KeyInvalid(f"{field} is {size} bytes in UTF-8; at most {MAX_NAME_BYTES}",
                             metadata={"field": field, "length": size})
    return Namespace(lora_name, cache_salt)


_NON_NEGATIVE_TOP = bytes(range(0x80))
"""The top bytes of non-negative little-endian int64 ids (deleted by ``translate``: what
remains is a negative id's)."""


def encode_keys(keys: Sequence[bytes | str], field: str = "keys") -> list[bytes]:
    batch = list(keys)
    if all(type(k) is bytes for k in batch):
        return batch  # type: ignore[return-value]
    out: list[bytes] = []
    for pos, k in enumerate(keys):
        if isinstance(k, str):
            try:
                k = bytes.fromhex(k)
            except ValueError:
                raise KeyInvalid(f"{field}[{pos}] is a string but not hex",
                                 metadata={"field": field, "position": pos}) from None
        out.append(bytes(k))
    return out


def _page_digest(prior: bytes | None, tokens: np.ndarray) -> bytes:
    h = hashlib.sha256()
    if prior is not None:
        h.update(prior)
    if tokens.size and int(tokens.max()) > _U32_MAX:
        h.update(_WIDE_TAG)
        h.update(tokens.astype("<u8").tobytes())
    else:
        h.update(tokens.astype("<u4").tobytes())
    return h.digest()


def _digests(token_ids: Sequence[int] | np.ndarray, page_size: int,
             prior_hash: str | bytes | None, whole_pages_only: bool) -> list[bytes]:
    if page_size < 1:
        raise ValueError("page_size must be positive")
    tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    if tokens.size and int(tokens.min()) < 0:
        raise ValueError("token ids must be non-negative")
    prior: bytes | None
    if isinstance(prior_hash, str):
        prior = bytes.fromhex(prior_hash) if prior_hash else None
    else:
        prior = prior_hash or None
    if prior is not None and len(prior) != 32:
        raise ValueError("prior_hash must be a 32-byte SHA-256 digest (or its hex)")
    end = tokens.size - tokens.size % page_size if whole_pages_only else tokens.size
    out: list[bytes] = []
    for start in range(0, end, page_size):
        prior = _page_digest(prior, tokens[start:start + page_size])
        out.append(prior)
    return out


def sglang_page_hashes(token_ids: Sequence[int] | np.ndarray, page_size: int,
                       prior_hash: str | bytes | None = None) -> list[str]:
    """What SGLang's ``get_hash_str(token_ids, prior_hash, page_size)`` returns."""
    return [d.hex() for d in _digests(token_ids, page_size, prior_hash, False)]


def sglang_page_keys(token_ids: Sequence[int] | np.ndarray, page_size: int,
                     prior_hash: str | bytes | None = None) -> list[bytes]:
    """Keys of the whole pages of ``token_ids`` (a partial last page has none)."""
    return _digests(token_ids, page_size, prior_hash, True)
