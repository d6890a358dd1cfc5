"""The daemon's cache events in the format SGLang's and vLLM's routers read.

SGLang 0.5.23 (``sglang/srt/disaggregation/kv_events.py``) publishes, on a ZeroMQ PUB socket,
three frames per message: a topic, an 8-byte big-endian sequence number and a msgpack
``KVEventBatch``: an array ``[ts, events, attn_dp_rank]`` whose events are maps tagged with
their class (``{"type": "BlockStored", ...}``, fields at their default left out). The structs
here have the same names, fields and options, so SGLang's own decoder reads them, and vLLM
0.33's (``vllm.distributed.kv_events``, the same tagged maps in an array ``[ts, events,
data_parallel_rank]``) too: ``medium`` and ``lora_name``, which vLLM requires, are always
sent. They are declared here because the daemon imports neither engine.

A page's block hash is what the engine that wrote it calls that block in its own events, by
the pool's ``key_format``: for ``DIGEST`` keys (SGLang's) SGLang's ``hash_str_to_int64`` of the
key's hex (its first 8 bytes, big-endian, signed), for ``VLLM`` keys (vLLM's ``OffloadKey``:
block hash + 4-byte group) vLLM's int block hash (the block hash's last 8 bytes, big-endian,
unsigned): the engine and the daemon report one block for one page. The blocks of one
``BlockStored`` are a chain, the first one's parent in ``parent_block_hash``.

vLLM's lookahead block hashes (0.34 with EAGLE / MTP and prefix caching, under its offloading
connector; 0.33 keeps the legacy hashes under any KV connector) cover the tokens after a block
too; vLLM's own ``BlockStored`` then says them (``lookahead_token_ids``: one list per block
hash; 0.33's and 0.34's decoders both have the field), and so does the daemon's where the
Store gave them. The field is left out of every event without them, and SGLang's decoder,
which has no such field, skips it where it is: it reads every message.

Primitives:

- ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``, ``KVEventBatch``: the structs.
- ``block_hash(key, key_format)``: the engine's block hash of a page key; ``block_hashes(keys,
  key_format)``: of many.
- ``engine_events(events, block_size, key_format)``: a pool's ``CacheEvent``s as engine
  events, in order, consecutive ones merged as SGLang merges its own (a chain continued,
  removals of one medium) up to ``MAX_BLOCKS`` blocks an event.
- ``messages(events)``: the events cut into messages of at most ``MESSAGE_EVENTS`` events and
  ``MESSAGE_BLOCKS`` blocks (a ClearPool of a million keys is many small messages).
- ``contents_events(contents, block_size, chains, key_format)``: a pool's contents (per tier,
  its keys) as ``BlockStored`` events, cut into the chains the pool knows (a snapshot).
- ``Encoder``: ``batch(events)`` -> the msgpack payload of one batch.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

import msgspec
import numpy as np

from hicache.keys import NO_NAMESPACE, Namespace
from hicache.specs import KeyFormat
from hicached.cache.chains import ChainTable
from hicached.cache.events import MEDIUM, CacheEvent, EventKind

MAX_BLOCKS = 4096
"""Blocks one engine event names at most (consecutive events merge up to it)."""
_SIGN = 1 << 63
_WRAP = 1 << 64


class _KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """SGLang's ``KVCacheEvent``: a map tagged ``type`` = the class name."""


class BlockStored(_KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None  # always sent (SGLang's default is None, vLLM requires the key)
    lora_name: str | None  # always sent, nil: vLLM 0.33's BlockStored requires the key
    cache_salt: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None
    """vLLM's: the tokens after each block its hash covers, one list per block hash; left out
    (None) without them (SGLang's struct has no such field)."""


class BlockRemoved(_KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(_KVCacheEvent):
    pass


EngineEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[EngineEvent]
    attn_dp_rank: int | None = None


_VLLM_HASH = slice(-12, -4)
"""Where vLLM's int block hash is in its ``OffloadKey``: the block hash's last 8 bytes (the
key ends with a 4-byte group index)."""


def _vllm_shaped(key_format: KeyFormat, width: int) -> bool:
    return key_format is KeyFormat.VLLM and width >= 12


def block_hash(key: bytes, key_format: KeyFormat = KeyFormat.DIGEST) -> int:
    """``DIGEST``: SGLang's ``hash_str_to_int64(key.hex())``; ``VLLM``: vLLM's
    ``maybe_convert_block_hash(get_offload_block_hash(key))`` (a key too short to be an
    ``OffloadKey`` is named as a digest)."""
    if _vllm_shaped(key_format, len(key)):
        return int.from_bytes(key[_VLLM_HASH], "big")
    value = int.from_bytes(key[:8], "big")
    return value - _WRAP if value >= _SIGN else value


def block_hashes(keys: Sequence[bytes], key_format: KeyFormat = KeyFormat.DIGEST) -> list[int]:
    """``block_hash`` of each key; keys of one width (SGLang's are all 32 bytes, vLLM's 36) in
    a few vectorized passes."""
    width = len(keys[0]) if keys else 0
    if width < 8 or len(keys) < 4 or any(len(k) != width for k in keys):
        return [block_hash(k, key_format) for k in keys]
    rows = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), width)
    if _vllm_shaped(key_format, width):
        return list(np.ascontiguousarray(rows[:, _VLLM_HASH]).view(">u8").ravel().tolist())
    return list(np.ascontiguousarray(rows[:, :8]).view(">i8").ravel().tolist())


def _stored(keys: Sequence[bytes], parent: bytes, tokens: list[int], block_size: int,
            medium: str, key_format: KeyFormat,
            namespace: Namespace = NO_NAMESPACE,
            lookahead: list[list[int]] | None = None) -> BlockStored:
    return BlockStored(block_hashes=block_hashes(keys, key_format),
                       parent_block_hash=block_hash(parent, key_format) if parent else None,
                       token_ids=tokens, block_size=block_size, lora_id=None, medium=medium,
                       lora_name=namespace.lora_name or None,
                       cache_salt=namespace.cache_salt or None,
                       lookahead_token_ids=lookahead)


def engine_events(events: Iterable[CacheEvent], block_size: int,
                  key_format: KeyFormat = KeyFormat.DIGEST) -> list[EngineEvent]:
    out: list[EngineEvent] = []
    for e in events:
        medium = MEDIUM[e.tier]
        last = out[-1] if out else None
        if e.kind is EventKind.STORED:
            tokens = e.token_ids.tolist() if e.token_ids is not None else []
            ahead = e.lookahead_rows
            if (isinstance(last, BlockStored) and last.medium == medium and e.parent
                    and len(last.block_hashes) + len(e.keys) <= MAX_BLOCKS
                    and last.block_hashes[-1] == block_hash(e.parent, key_format)
                    and bool(last.token_ids) == bool(tokens)
                    and last.lora_name == (e.namespace.lora_name or None)
                    and last.cache_salt == (e.namespace.cache_salt or None)
                    and (last.lookahead_token_ids is None) == (ahead is None)):
                last.block_hashes.extend(block_hashes(e.keys, key_format))
                last.token_ids.extend(tokens)
                if ahead is not None and last.lookahead_token_ids is not None:
                    last.lookahead_token_ids.extend(ahead)
            else:
                out.append(_stored(e.keys, e.parent, tokens, block_size, medium, key_format,
                                   e.namespace, ahead))
        elif (isinstance(last, BlockRemoved) and last.medium == medium
              and len(last.block_hashes) + len(e.keys) <= MAX_BLOCKS):
            last.block_hashes.extend(block_hashes(e.keys, key_format))
        else:
            out.append(BlockRemoved(block_hashes=block_hashes(e.keys, key_format),
                                    medium=medium))
    return out


def contents_events(contents: Mapping[int, Sequence[bytes]], block_size: int,
                    chains: ChainTable, key_format: KeyFormat = KeyFormat.DIGEST
                    ) -> list[BlockStored]:
    """What a pool holds, per tier, as ``BlockStored`` events (keys the chain table does not
    know stand alone: a snapshot claims no chain it was not told of)."""
    out: list[BlockStored] = []
    for tier, keys in sorted(contents.items()):
        for run in chains.runs(keys, chain=False):
            tokens = run.token_ids()
            out.append(_stored(run.keys, run.parent,
                               tokens.tolist() if tokens is not None else [], block_size,
                               MEDIUM[tier], key_format, run.namespace, run.lookahead_rows()))
    return out


MESSAGE_EVENTS = 256
MESSAGE_BLOCKS = 16_384
"""A message's bounds: about 150 KiB of block hashes at most."""


def messages(events: Sequence[EngineEvent]) -> list[list[EngineEvent]]:
    out: list[list[EngineEvent]] = []
    blocks = MESSAGE_BLOCKS
    for e in events:
        n = len(e.block_hashes) if isinstance(e, BlockStored | BlockRemoved) else 0
        if not out or len(out[-1]) >= MESSAGE_EVENTS or blocks + n > MESSAGE_BLOCKS:
            out.append([])
            blocks = 0
        out[-1].append(e)
        blocks += n
    return out


class Encoder:
    """One msgpack encoder (not thread-safe: the publisher's thread owns it)."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()

    def batch(self, events: list[EngineEvent]) -> bytes:
        return self._enc.encode(KVEventBatch(ts=time.time(), events=events))
