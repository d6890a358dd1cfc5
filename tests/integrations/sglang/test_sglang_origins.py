"""``hicache_sglang.origins``: the tokens and parent key of a node SGLang offloads, read from the
frames that call the linker, checked with SGLang's own page hash. Here the callers are small
functions shaped as SGLang 0.5.23's (the cache's ``insert(params)``, the wrapper's
``_offload_node(node_id, transfers)``); the keys and tokens are SGLang's own
(``RadixKey``, ``get_storage_hash_str``). The real callers: test_router_sglang.py and the
server tests.
"""

from __future__ import annotations

import types
from array import array
from typing import Any

import numpy as np
import pytest

from tests.helpers import require_module

require_module("sglang", "sglang==0.5.23 (scripts/setup.sh --test)")

from tests.sglang_harness import install_stand_ins  # noqa: E402

install_stand_ins()  # what SGLang's imports need and CPU hosts lack

from sglang.srt.mem_cache.events import KVCacheEventRecorder, KvEventLoraNames  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from hicache_sglang.origins import NodeOrigins, Origin  # noqa: E402

P = 4
TOKENS = array("q", range(100, 100 + 6 * P))


def page_keys(key: RadixKey) -> list[str]:
    got = get_storage_hash_str(key, None, page_size=P)
    assert isinstance(got, list)
    return got


class Linker:
    def __init__(self) -> None:
        self.origins = NodeOrigins(self, P)

    def offload(self, keys: list[str]) -> Origin | None:
        return self.origins.of(keys)


class Wrapper:
    """``UnifiedCacheLinkerWrapper`` as far as the linker's callers go: a tree whose nodes'
    ancestors are ``before[node_id]``."""

    def __init__(self, linker: Linker, before: dict[int, list[str]],
                 kv_events: Any = None) -> None:
        self.cache_linker = linker
        tree = types.SimpleNamespace(get_prefix_hash_values=lambda node_id: before[node_id],
                                     kv_events=kv_events)
        self.cache = types.SimpleNamespace(tree_core=tree)

    def _offload_node(self, node_id: int, transfers: list[str]) -> Origin | None:
        return self.cache_linker.offload(transfers)


def insert(params: Any, wrapper: Wrapper, node_id: int, keys: list[str]) -> Origin | None:
    return _apply(wrapper, node_id, keys)


def _apply(wrapper: Wrapper, node_id: int, keys: list[str]) -> Origin | None:
    return wrapper._offload_node(node_id, keys)


@pytest.mark.parametrize("salt", [None, "tenant-7"])
def test_a_nodes_tokens_and_parent_come_from_the_request_that_inserted_it(
        salt: str | None) -> None:
    key = RadixKey(TOKENS, cache_salt=salt)
    keys = page_keys(key)
    linker = Linker()
    wrapper = Wrapper(linker, {1: [], 2: keys[:2]})
    params = types.SimpleNamespace(key=key)
    head = insert(params, wrapper, 1, keys[:2])  # the first node: no parent
    assert head is not None and head.parent_key == ""
    assert head.tokens.tolist() == list(TOKENS[:2 * P])
    tail = insert(params, wrapper, 2, keys[2:5])  # below it, three pages
    assert tail is not None and tail.parent_key == keys[1]
    assert tail.tokens.dtype == np.int64 and tail.tokens.tolist() == list(TOKENS[2 * P:5 * P])
    assert head.cache_salt == tail.cache_salt == (salt or "")  # as SGLang's events say it
    assert (linker.origins.found, linker.origins.misses) == (2, 0)


def test_tokens_that_do_not_hash_to_the_nodes_keys_are_not_told() -> None:
    """A node placed one page off in the request, a request shorter than the node, another
    request's tokens, a bigram key: stored without tokens, counted."""
    key = RadixKey(TOKENS)
    keys = page_keys(key)
    linker = Linker()
    params = types.SimpleNamespace(key=key)
    off_by_one = Wrapper(linker, {2: keys[:1]})  # the tree says one page before, not two
    assert insert(params, off_by_one, 2, keys[2:4]) is None
    short = types.SimpleNamespace(key=RadixKey(TOKENS[:3 * P]))
    assert insert(short, Wrapper(linker, {2: keys[:2]}), 2, keys[2:5]) is None
    other = types.SimpleNamespace(key=RadixKey(array("q", range(500, 500 + 6 * P))))
    assert insert(other, Wrapper(linker, {2: keys[:2]}), 2, keys[2:4]) is None
    bigram = types.SimpleNamespace(key=RadixKey(TOKENS, is_bigram=True))
    assert insert(bigram, Wrapper(linker, {1: []}), 1, keys[:2]) is None
    assert (linker.origins.found, linker.origins.misses) == (0, 4)


def test_a_caller_that_is_not_this_linkers_wrapper_gets_nothing() -> None:
    key = RadixKey(TOKENS)
    keys = page_keys(key)
    linker, stranger = Linker(), Linker()
    params = types.SimpleNamespace(key=key)
    assert insert(params, Wrapper(stranger, {1: []}), 1, keys[:2]) is not None
    # another linker's wrapper calls this one: its node is not ours to tell
    wrapper = Wrapper(stranger, {1: []})
    wrapper.cache_linker = stranger
    assert _called_through(wrapper, linker, keys[:2]) is None
    assert linker.offload(keys[:2]) is None  # called directly: no wrapper at all
    assert linker.origins.misses == 2


def _called_through(wrapper: Wrapper, linker: Linker, keys: list[str]) -> Origin | None:
    node_id = 1  # noqa: F841 (read from this frame)
    self = wrapper  # noqa: F841 (as the wrapper's method has it)
    params = types.SimpleNamespace(key=RadixKey(TOKENS))  # noqa: F841
    return linker.offload(keys)


@pytest.mark.parametrize("dynamo_format", [False, True])
def test_a_lora_requests_pages_are_named_as_sglangs_own_events_name_them(
        dynamo_format: bool) -> None:
    """The name comes from the tree's own event recorder (SGLang's ``KVCacheEventRecorder`` and
    its ``KvEventLoraNames``, filled as the scheduler registers a request's adapter): the
    namespace's name where the table has one, "" for an unnamed namespace or no recorder."""
    names = KvEventLoraNames()
    names.register(types.SimpleNamespace(extra_key="ns-a", lora_id="id-a"), "adapter-a")
    recorder = KVCacheEventRecorder(enabled=True, page_size=P, dynamo_format=dynamo_format,
                                    lora_names=names)
    linker = Linker()
    told = {}
    for extra_key, kv_events in (("ns-a", recorder), ("ns-b", recorder), ("ns-a", None),
                                 (None, recorder)):
        key = RadixKey(TOKENS, extra_key=extra_key)
        keys = page_keys(key)  # the namespace seeds SGLang's page hash
        got = insert(types.SimpleNamespace(key=key), Wrapper(linker, {1: []}, kv_events), 1,
                     keys[:2])
        assert got is not None and got.tokens.tolist() == list(TOKENS[:2 * P])
        told[(extra_key, kv_events is not None)] = got.lora_name
    assert told == {("ns-a", True): "adapter-a", ("ns-b", True): "", ("ns-a", False): "",
                    (None, True): ""}
