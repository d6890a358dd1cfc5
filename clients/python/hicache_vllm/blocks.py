"""The blocks of one transfer, as the scheduler hands them to the workers and they move them.

vLLM's scheduler sends each worker a pair of specs per job: its own ``GPULoadStoreSpec`` (the
engine's KV block ids, in request order, with the logical index of the first) and ours,
``HicachedLoadStoreSpec`` (the offloaded blocks' keys, one page each). An offloaded block may
span ``blocks_per_chunk`` engine blocks, and a load may begin or end inside one: the first
``skip`` engine blocks of the first page are not loaded.

Primitives:

- ``HicachedLoadStoreSpec(keys)``: the pages of a job, by key (vLLM's ``OffloadKey`` bytes).
- ``Job.of(keys, gpu_spec, blocks_per_chunk)``: keys, engine block ids, ``skip``; ``rounds(n)``
  splits it into runs of at most ``n`` pages, each with the engine blocks its pages hold
  (``JobRound``: keys, block ids, the rows of the staged pages those blocks are).
- ``Job.whole``: every page is whole (a store writes only whole pages).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LoadStoreSpec


class HicachedLoadStoreSpec(LoadStoreSpec):
    """The pages of one job, by key: what the manager hands the workers."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        self.keys = list(keys)

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

    @classmethod
    def of(cls, keys: Sequence[bytes], gpu_spec: Any, blocks_per_chunk: int) -> Job:
        block_ids = np.asarray(gpu_spec.block_ids, dtype=np.int64)
        indices = list(getattr(gpu_spec, "block_indices", ()) or (0,))
        skip = int(indices[0]) % blocks_per_chunk
        need = -(-(len(block_ids) + skip) // blocks_per_chunk)
        if need != len(keys) or len(indices) != 1:
            raise ValueError(f"{len(block_ids)} engine blocks (skipping {skip}) are not "
                             f"{len(keys)} pages of {blocks_per_chunk} in one group")
        return cls(list(keys), block_ids, skip, blocks_per_chunk)

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
