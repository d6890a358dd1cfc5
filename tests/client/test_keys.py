"""Cache keys: batch checks, and SGLang's chained page hashes computed exactly as SGLang does."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache.errors import HiCacheError
from hicache.keys import (
    MAX_KEY_BYTES,
    MAX_LOOKAHEAD_TOKENS,
    MAX_NAME_BYTES,
    NO_NAMESPACE,
    Namespace,
    check_chain,
    check_keys,
    check_lookahead,
    check_namespace,
    sglang_page_hashes,
    sglang_page_keys,
)
from tests.sglang_reference import sglang_get_hash_str, sglang_native_hash


@pytest.fixture(scope="module")
def sglang() -> Iterator[ModuleType]:
    yield sglang_native_hash()


def test_keys_are_1_to_64_bytes() -> None:
    assert check_keys([b"a", b"b" * MAX_KEY_BYTES, bytearray(b"c")]) == [b"a", b"b" * 64, b"c"]
    for bad, length in ((b"", 0), (b"x" * 65, 65)):
        with pytest.raises(HiCacheError) as exc:
            check_keys([b"ok", bad], "keys")
        assert exc.value.reason == "KEY_INVALID"
        assert exc.value.metadata == {"field": "keys", "position": "1", "length": str(length),
                                      "count": "1"}
    with pytest.raises(HiCacheError) as exc:
        check_keys(["text"])  # type: ignore[list-item]
    assert exc.value.reason == "KEY_INVALID"


def test_duplicates_are_named_where_a_batch_must_be_unique() -> None:
    assert check_keys([b"a", b"a"]) == [b"a", b"a"]  # Lookup / LoadKeys may repeat a key
    with pytest.raises(HiCacheError) as exc:
        check_keys([b"a", b"b", b"a", b""], unique=True)
    assert exc.value.reason == "DUPLICATE_KEY"
    assert exc.value.metadata["position"] == "2" and exc.value.metadata["first_position"] == "0"
    assert [v.reason for v in exc.value.violations] == ["DUPLICATE_KEY", "KEY_INVALID"]


def test_bad_keys_are_reported_once_per_kind_with_a_count_and_the_first_position() -> None:
    """A million empty keys make one violation, not a million (the error stays small)."""
    batch = [b"ok"] * 3 + [b""] * 1_000_000 + [b"x" * 65, 7, b"ok"]
    with pytest.raises(HiCacheError) as exc:
        check_keys(batch, unique=True)  # type: ignore[arg-type]
    got = {(v.reason, v.description.split(" key(s)")[0]): dict(v.metadata)
           for v in exc.value.violations}
    assert len(exc.value.violations) == 3
    assert got[("DUPLICATE_KEY", "3")]["position"] == 1  # b"ok" again at 1, 2 and the end
    assert got[("KEY_INVALID", "1000001")]["position"] == 3  # empty and 65 bytes: one kind
    assert got[("KEY_INVALID", "1")]["type"] == "int"
    assert exc.value.reason == "DUPLICATE_KEY"  # the first position's fault is raised
    assert len(str(exc.value)) < 400


def test_a_batch_over_the_limit_is_refused_before_any_key_is_checked() -> None:
    with pytest.raises(HiCacheError) as exc:
        check_keys([b""] * 11, limit=10)
    assert exc.value.reason == "TOO_MANY_KEYS"
    assert exc.value.metadata == {"field": "keys", "count": "11", "max": "10"}
    assert check_keys([b"a"] * 10, limit=10) == [b"a"] * 10


def _chain_refusal(tokens: object, count: int = 2, page: int = 4) -> dict[str, str]:
    with pytest.raises(HiCacheError) as exc:
        check_chain(count, page, tokens)  # type: ignore[arg-type]
    assert exc.value.reason == "TOKEN_IDS_INVALID"
    return exc.value.metadata


@pytest.mark.parametrize("form", ["list", "int64", "uint64", "int32", "frame"])
def test_a_chain_s_tokens_are_the_same_int64_bytes_in_every_form(form: str) -> None:
    ids = [0, 1, 2**31, 2**40, 5, 6, 7, 2**63 - 1] if form != "int32" else list(range(8))
    given_ = (ids if form == "list" else np.array(ids, dtype="<i8").tobytes() if form == "frame"
              else np.array(ids, dtype=form))
    raw, parent = check_chain(2, 4, given_, b"p")  # type: ignore[arg-type]
    assert raw == np.array(ids, dtype="<i8").tobytes() and parent == b"p"
    assert check_chain(2, 4, None, b"") == (None, b"") == check_chain(2, 4, b"")


@pytest.mark.parametrize("form", ["list", "int64", "frame"])
@pytest.mark.parametrize("at", [0, 5, 7])
def test_a_negative_token_id_is_refused_where_it_is(form: str, at: int) -> None:
    ids = list(range(8))
    ids[at] = -1 if at != 5 else -(2**62)
    given_ = {"list": ids, "int64": np.array(ids, dtype=np.int64),
              "frame": np.array(ids, dtype="<i8").tobytes()}[form]
    assert _chain_refusal(given_) == {"field": "token_ids", "position": str(at)}


def test_token_ids_of_the_wrong_size_or_kind_are_refused() -> None:
    assert _chain_refusal(list(range(7))) == {"field": "token_ids", "count": "7",
                                              "expected": "8"}
    assert _chain_refusal(bytes(8 * 9)) == {"field": "token_ids", "count": "9",
                                            "expected": "8"}
    assert _chain_refusal(bytes(8 * 8 + 3)) == {"field": "token_ids", "bytes": "67"}
    assert _chain_refusal(np.zeros(8, dtype=np.float32))["dtype"] == "float32"
    assert _chain_refusal(np.zeros((2, 4), dtype=np.int64))["field"] == "token_ids"
    big = np.arange(8, dtype=np.uint64)
    big[3] = 2**63
    assert _chain_refusal(big) == {"field": "token_ids", "position": "3"}


def _lookahead_refusal(count: int, per_key: int, ids: object, with_tokens: bool = True
                       ) -> dict[str, str]:
    with pytest.raises(HiCacheError) as exc:
        check_lookahead(count, per_key, ids, with_tokens)  # type: ignore[arg-type]
    assert exc.value.reason == "TOKEN_IDS_INVALID"
    return exc.value.metadata


@pytest.mark.parametrize("form", ["list", "int64", "frame"])
def test_lookahead_tokens_are_per_key_int64_bytes_beside_the_pages_own(form: str) -> None:
    """vLLM's lookahead block hashes: ``per_key`` tokens after each of ``count`` pages, as the
    same little-endian int64 bytes whatever form they came in; none is None."""
    ids = [3, 4, 2**40, 2**63 - 1, 0, 1]  # 3 keys, 2 tokens after each
    given_ = {"list": ids, "int64": np.array(ids, dtype=np.int64),
              "frame": np.array(ids, dtype="<i8").tobytes()}[form]
    assert check_lookahead(3, 2, given_, True) == np.array(  # type: ignore[arg-type]
        ids, dtype="<i8").tobytes()
    assert check_lookahead(3, 0, None, True) is None
    assert check_lookahead(3, 0, b"", False) is None  # no tokens, no lookahead: as before
    assert check_lookahead(1, MAX_LOOKAHEAD_TOKENS, list(range(MAX_LOOKAHEAD_TOKENS)),
                           True) is not None


def test_lookahead_tokens_of_the_wrong_count_sign_or_place_are_refused() -> None:
    assert _lookahead_refusal(3, 2, list(range(5))) == {
        "field": "lookahead_token_ids", "count": "5", "expected": "6"}
    assert _lookahead_refusal(3, 2, None) == {  # a count with no ids
        "field": "lookahead_token_ids", "count": "0", "expected": "6"}
    assert _lookahead_refusal(3, 0, [1, 2, 3]) == {  # ids with no count
        "field": "lookahead_token_ids", "count": "3", "expected": "0"}
    assert _lookahead_refusal(3, 2, [0, 1, 2, -3, 4, 5]) == {
        "field": "lookahead_token_ids", "position": "3"}
    assert _lookahead_refusal(1, 1, bytes(7)) == {"field": "lookahead_token_ids",
                                                  "bytes": "7"}
    assert _lookahead_refusal(1, MAX_LOOKAHEAD_TOKENS + 1, list(range(17))) == {
        "field": "lookahead_tokens", "value": "17", "max": str(MAX_LOOKAHEAD_TOKENS)}
    assert _lookahead_refusal(1, -1, None) == {"field": "lookahead_tokens", "value": "-1",
                                               "max": str(MAX_LOOKAHEAD_TOKENS)}
    assert _lookahead_refusal(2, 1, [5, 6], with_tokens=False) == {
        "field": "lookahead_token_ids", "token_ids": "0"}  # only beside the pages' tokens


def test_the_client_sends_lookahead_rows_as_one_count_and_their_ids() -> None:
    from hicache_client.client import _lookahead_bytes

    assert _lookahead_bytes([[1, 2], [3, 4], [5, 6]]) == (
        2, np.arange(1, 7, dtype="<i8").tobytes())
    assert _lookahead_bytes(np.array([[9]], dtype=np.int32)) == (1, np.int64(9).tobytes())
    assert _lookahead_bytes(None) == _lookahead_bytes([]) == _lookahead_bytes([[], []]) == (
        0, None)
    for bad in ([[1, 2], [3]], [1, 2, 3], [[1.5]]):  # ragged, flat, not ids
        with pytest.raises(HiCacheError) as exc:
            _lookahead_bytes(bad)  # type: ignore[arg-type]
        assert exc.value.reason == "TOKEN_IDS_INVALID"
        assert exc.value.metadata["field"] == "lookahead_token_ids"


def test_a_namespace_is_two_short_strings() -> None:
    assert check_namespace() == NO_NAMESPACE == Namespace("", "")
    assert check_namespace("a" * MAX_NAME_BYTES, "\u00e9" * 127) == ("a" * 255, "\u00e9" * 127)
    for bad, field, meta in ((("a" * 256, ""), "lora_name", {"length": "256"}),
                             (("", "\u00e9" * 128), "cache_salt", {"length": "256"}),
                             (("\ud800", ""), "lora_name", {}),
                             (("", b"salt"), "cache_salt", {})):
        with pytest.raises(HiCacheError) as exc:
            check_namespace(*bad)  # type: ignore[arg-type]
        assert exc.value.reason == "KEY_INVALID"
        assert exc.value.metadata == {"field": field, **meta}


def test_chain_of_two_pages_by_hand() -> None:
    import hashlib

    tokens = [1, 2, 3, 4, 5, 6, 7]
    first = hashlib.sha256(np.array([1, 2, 3], "<u4").tobytes()).digest()
    second = hashlib.sha256(first + np.array([4, 5, 6], "<u4").tobytes()).digest()
    third = hashlib.sha256(second + np.array([7], "<u4").tobytes()).digest()
    assert sglang_page_hashes(tokens, 3) == [first.hex(), second.hex(), third.hex()]
    assert sglang_page_keys(tokens, 3) == [first, second]  # whole pages only
    assert sglang_page_keys(tokens[3:6], 3, prior_hash=first.hex()) == [second]
    assert sglang_page_keys(tokens[3:6], 3, prior_hash=first) == [second]


def test_bad_hash_inputs_are_refused() -> None:
    for args in (([-1], 1, None), ([1], 0, None), ([1], 1, "ab")):
        with pytest.raises(ValueError):
            sglang_page_hashes(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize("page_size", [1, 4, 16, 64])
def test_matches_sglang_for_typical_prompts(sglang: ModuleType, page_size: int) -> None:
    rng = np.random.default_rng(page_size)
    for n in (0, 1, page_size, 3 * page_size + 1, 257):
        tokens = rng.integers(0, 152_064, size=n).tolist()  # a Qwen-sized vocabulary
        assert sglang_page_hashes(tokens, page_size) == sglang_get_hash_str(
            sglang, tokens, None, page_size)


@given(tokens=st.lists(st.integers(0, (1 << 63) - 1), max_size=40),
       page_size=st.integers(1, 9), prior=st.one_of(st.none(), st.binary(min_size=32,
                                                                           max_size=32)))
def test_matches_sglang_for_any_tokens_and_prior(sglang: ModuleType, tokens: list[int],
                                                 page_size: int, prior: bytes | None) -> None:
    """Wide token ids (beyond uint32) switch SGLang to its 0xff-tagged uint64 encoding."""
    prior_hex = prior.hex() if prior else None
    ours = sglang_page_hashes(tokens, page_size, prior_hex)
    assert ours == sglang_get_hash_str(sglang, tokens, prior_hex, page_size)
    if tokens:  # the unpaged form is the one-page chain of every token
        assert sglang_page_hashes(tokens, len(tokens), prior_hex) == [
            sglang_get_hash_str(sglang, tokens, prior_hex, None)]
