"""The blocks of one transfer, as the scheduler hands them to the workers and they move them.

vLLM's scheduler sends each worker a pair of specs per job: its own device side (the
engine's KV blocks, in request order, with the logical index of the first: block ids on vLLM
0.33, pointers on 0.34, read by ``hicache_vllm.vllm_api`` into ``GroupBlocks``) and ours,
``HicachedLoadStoreSpec`` (the offloaded blocks' keys, one page each). An offloaded block may
span ``blocks_per_chunk`` engine blocks, and a load may begin or end inside one: the first
``skip`` engine blocks of the first page are not loaded.

Primitives:

- ``HicachedLoadStoreSpec(keys, chain)``: the pages of a job, by key (vLLM's ``OffloadKey``
  bytes); for a store, ``chain`` (``Chain``: their tokens, the key before the first and, with
  vLLM's lookahead block hashes, the tokens after each page its hash covers) when the
  scheduler knows the request: what routers are told of the pages.
- ``Job.of(keys, groups, blocks_per_chunk, chain, sync)``: keys, engine block ids, ``skip``
  (one KV cache group's blocks); ``rounds(n)`` splits it into runs of at most ``n`` pages,
  each with the engine blocks its pages hold (``JobRound``: keys, block ids, the rows of the
  staged pages those blocks are).
- ``Job.whole``: every page is whole (a store writes only whole pages).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from vllm.v1.kv_offload.base import LoadStoreSpec

from hicache_vllm.vllm_api import GroupBlocks


@dataclass(frozen=True)
class Chain:
    """What a store's pages are: their tokens (``page_tokens`` per key, in order) and the
    key of the page before the first ("" for a request's first page)."""

    token_ids: np.ndarray
    parent_key: bytes = b""
    lora_name: str = ""
    """The request's LoRA adapter ("" = the base model), as vLLM's own events name it."""
    cache_salt: str = ""
    """The request's cache salt ("" = none)."""
    lookahead: np.ndarray | None = None
    """With vLLM's lookahead block hashes (``num_hash_lookahead_tokens`` L > 0): per key, the
    L tokens after its page, which its hash covers too (int64, one row per key); None
    without."""

    def of_round(self, keys: Sequence[bytes], start: int, end: int) -> Chain:
        """The chain of pages ``start:end`` of the job whose keys are ``keys``."""
        per = len(self.token_ids) // len(keys)
        parent = self.parent_key if start == 0 else keys[start - 1]
        return Chain(self.token_ids[start * per:end * per], parent, self.lora_name,
                     self.cache_salt,
                     self.lookahead[start:end] if self.lookahead is not None else None)


class HicachedLoadStoreSpec(LoadStoreSpec):
    """The pages of one job, by key: what the manager hands the workers."""

    def __init__(self, keys: Sequence[bytes], chain: Chain | None = None) -> None:
        self.keys = list(keys)
        self.chain = chain
        """A store's tokens and parent (None: not known; the pages are told without)."""

    def __repr__(self) -> str:
        return f"HicachedLoadStoreSpec({len(self.keys)} keys)"


@dataclass(frozen=True)
class JobRound:
    keys: list[bytes]
    block_ids: np.ndarray
    """Engine block ids, in order."""
    rows: np.ndarray
    """Where each of those blocks is among the round's staged pages, counted in engine
    blocks (page ``i`` holds rows ``i * blocks_per_chunk ..``)."""


@dataclass(frozen=True)
class Job:
    keys: list[bytes]
    block_ids: np.ndarray
    skip: int
    blocks_per_chunk: int
    chain: Chain | None = None
    """A store's tokens and parent, when the scheduler knew them."""
    sync: bool = False
    """A load vLLM waits for within the step that runs its request (``expedited``)."""

    @classmethod
    def of(cls, keys: Sequence[bytes], groups: Sequence[GroupBlocks], blocks_per_chunk: int,
           chain: Chain | None = None, sync: bool = False) -> Job:
        if len(groups) != 1:
            raise ValueError(f"blocks of {len(groups)} KV cache groups in one job: the "
                             "spec serves one group")
        (group,) = groups
        block_ids = group.block_ids
        skip = group.first % blocks_per_chunk
        need = -(-(len(block_ids) + skip) // blocks_per_chunk)
        if need != len(keys):
            raise ValueError(f"{len(block_ids)} engine blocks (skipping {skip}) are not "
                             f"{len(keys)} pages of {blocks_per_chunk}")
        return cls(list(keys), block_ids, skip, blocks_per_chunk, chain, sync)

    @property
    def whole(self) -> bool:
        return self.skip == 0 and len(self.block_ids) == len(self.keys) * self.blocks_per_chunk

    def rounds(self, pages: int) -> Iterator[JobRound]:
        bpc = self.blocks_per_chunk
        logical = np.arange(len(self.block_ids), dtype=np.int64) + self.skip
        for start in range(0, len(self.keys), pages):
            end = min(start + pages, len(self.keys))
            sel = (logical >= start * bpc) & (logical < end * bpc)
            yield JobRound(self.keys[start:end], self.block_ids[sel],
                           logical[sel] - start * bpc)
