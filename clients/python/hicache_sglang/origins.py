"""What SGLang knows of the pages it offloads and does not hand its linker: their tokens and the
key of the page before them, which the daemon's KV events tell routers (Dynamo's indexer and
sgl-router match a request to pages by its tokens; pages told without them never match).

SGLang 0.5.23 calls ``UnifiedCacheLinker.offload(transfers)`` from
``UnifiedCacheLinkerWrapper._offload_node(node_id, transfers)`` with a tree node's page keys
and device slots only. The tokens are in the request whose insert (or match) made the tree
back the node up, a few frames further up; the node's place in that request is its ancestors'
page count (``tree_core.get_prefix_hash_values``, which SGLang's Python and Rust tree cores
both answer). ``NodeOrigins.of(keys)`` reads them from the calling frames and checks them with
SGLang's own page hash: the first page's tokens, chained to the parent's key, must hash to the
first key. Any other caller, an SGLang whose frames differ, a bigram (EAGLE) key or a check
that fails answer ``None``: the pages are stored without tokens, as any linker's are, and
``misses`` counts them. The cost on the scheduler's thread is a few frames' locals and one
page's hash per offloaded node (no copy of the tokens: a view of SGLang's array).

Its LoRA name is the one SGLang's own events give the request's namespace (``extra_key``): the
tree's event recorder keeps the table the scheduler fills as adapters load.

Primitives: ``Origin(tokens, parent_key, cache_salt, lora_name)``;
``NodeOrigins(linker, page_size)``: ``of(keys)``, ``found``, ``misses``; ``REQUEST_FRAMES``.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import numpy as np

REQUEST_FRAMES = 8
"""How far above the wrapper's frame the request's key is looked for (SGLang 0.5.23: the
cache's ``insert`` is the fourth)."""


class Origin(NamedTuple):
    tokens: np.ndarray
    """The pages' tokens, ``page_size`` per key, in order (int64)."""
    parent_key: str
    """The key of the page before the first ("" at the start of a prompt)."""
    cache_salt: str = ""
    """The request's cache salt ("" = none), as SGLang's own events tell it."""
    lora_name: str = ""
    """The request's LoRA adapter ("" = none or unnamed), as SGLang's own events name it."""


class NodeOrigins:
    def __init__(self, linker: object, page_size: int) -> None:
        self._linker, self._page_size = linker, page_size
        self.found = 0
        """Offloads whose tokens were found."""
        self.misses = 0
        """Offloads stored without tokens (not found, or found and not SGLang's pages)."""

    def of(self, keys: list[str]) -> Origin | None:
        """The tokens and parent key of the node SGLang is offloading as ``keys``, read from
        the caller of the linker's ``offload`` (``of`` <- ``offload`` <- the wrapper)."""
        try:
            origin = self._read(sys._getframe(2), keys)
        except Exception:  # an SGLang whose frames or tree differ: stored without tokens
            origin = None
        if origin is None:
            self.misses += 1
        else:
            self.found += 1
        return origin

    def _read(self, frame: Any, keys: list[str]) -> Origin | None:
        here = frame.f_locals
        wrapper, node_id = here.get("self"), here.get("node_id")
        if node_id is None or not keys or \
                getattr(wrapper, "cache_linker", None) is not self._linker:
            return None
        key = _request_key(frame.f_back)
        if key is None or getattr(key, "is_bigram", False):
            return None
        before = wrapper.cache.tree_core.get_prefix_hash_values(node_id)
        page = self._page_size
        start, end = len(before) * page, (len(before) + len(keys)) * page
        raw = key.raw_token_ids()
        if end > len(raw):
            return None  # the node is not on this request's path
        parent = str(before[-1]) if before else ""
        if _hash_page(key[start:start + page], parent, page) != keys[0]:
            return None  # these tokens are not the node's
        # a view of SGLang's int64 array (numpy reads its buffer), a copy of anything else
        return Origin(np.asarray(raw, dtype=np.int64)[start:end], parent,
                      str(getattr(key, "cache_salt", None) or ""),
                      _lora_name(wrapper.cache.tree_core, getattr(key, "extra_key", None)))


def _request_key(frame: Any) -> Any:
    """The request's ``RadixKey`` in the nearest frame that has one (an ``insert``'s
    ``params.key``, a match's ``key``)."""
    for _ in range(REQUEST_FRAMES):
        if frame is None:
            return None
        here = frame.f_locals
        params = here.get("params")
        for key in (getattr(params, "key", None), here.get("key")):
            if key is not None and hasattr(key, "raw_token_ids"):
                return key
        frame = frame.f_back
    return None


def _lora_name(tree_core: Any, extra_key: str | None) -> str:
    """The LoRA name SGLang's own events give pages of ``extra_key``'s namespace: its event
    recorder's name table (``KvEventLoraNames``, filled by the scheduler as adapters load), read
    as the recorder reads it (``resolve`` in Dynamo's format, ``get`` otherwise); "" where the
    cache publishes no events or the namespace has no name."""
    if not extra_key:
        return ""
    recorder = getattr(tree_core, "kv_events", None)
    # the Python tree core's recorder keeps the table public, the Rust core's adapter private
    names = getattr(recorder, "lora_names", None) or getattr(recorder, "_lora_names", None)
    if names is None:
        return ""
    dynamo = bool(getattr(recorder, "dynamo_format", getattr(recorder, "_dynamo_format", False)))
    got = names.resolve(extra_key) if dynamo else names.get(extra_key)
    return str(got or "")


def _hash_page(key: Any, parent: str, page: int) -> str:
    """SGLang's storage key of one page (``key``: its tokens, as SGLang's ``RadixKey``)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    got = get_storage_hash_str(key, parent or None, page_size=page)
    return str(got[0] if isinstance(got, list) else got)
