"""Which hicached pools a vLLM engine's blocks live in, and how a block is a page there.

A hicached pool is a key namespace: two engines share blocks exactly when their pool names are
equal, so the name carries everything that makes KV bytes differ for the same tokens: the
model, an operator namespace, this spec's page format (``FORMAT_TAG``, never SGLang's: vLLM
and SGLang lay KV out differently and never share a pool by accident), vLLM's KV cache layout
and dtype, the geometry (layers, bytes per layer and block, tokens per block) and the shard.

A page is one offloaded block (vLLM's ``OffloadKey``, ``blocks_per_chunk`` of its KV blocks)
of one rank: per layer, that rank's canonical page bytes of each of its blocks, back to back.
The daemon moves whole pages only and never reads inside them; the pool is described to it as
``OPAQUE`` rows (``page_bytes / tokens_per_block`` bytes per token row and layer), one buffer
per layer holding what vLLM's canonical tensor holds. Its keys are vLLM's ``OffloadKey``s
(``KeyFormat.VLLM``): the daemon's KV events name each block by vLLM's own block hash.

MHA KV differs per tensor-parallel rank: one pool per rank, every rank writes its own, and a
block is a hit only when every rank's pool holds it. MLA KV is the same on every rank (vLLM's
``replicated_layout``): one pool, rank 0 writes, every rank reads.

Primitives:

- ``FORMAT_TAG``: this spec's page format.
- ``Plan.from_config(offloading_config, spec_config)``: the pools and geometry both sides
  derive alike (the scheduler's manager and every worker); ``SpecInvalid`` for what is not
  served (several KV cache groups, layers whose pages differ in size).
- ``Plan.pool_spec(rank, size_tokens)`` / ``Plan.pool_names``: the pool of a rank and every
  pool a lookup must find a block in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hicache.errors import SpecInvalid
from hicache.specs import DType, KeyFormat, KVGeometry, PoolKind, PoolSpec
from hicache_client import pool_names
from hicache_vllm.config import SpecConfig

FORMAT_TAG = "hicached-vllm-canonical-block-v1"


@dataclass(frozen=True)
class Plan:
    model: str
    """The model as vLLM names it (path or hub id)."""
    ident: tuple[str, ...]
    """Everything that makes pages differ but the rank (hashed into the pool names)."""
    layers: int
    """Layers of the (one) KV cache group: one buffer each."""
    layer_block_bytes: int
    """One rank's bytes of one layer of one vLLM block."""
    block_tokens: int
    """Tokens of one vLLM KV block."""
    blocks_per_chunk: int
    """vLLM blocks per offloaded block (one page)."""
    world_size: int
    replicated: bool
    """MLA: one pool for every rank, written by rank 0."""
    prefix: str

    @classmethod
    def from_config(cls, config: Any, spec_config: SpecConfig) -> Plan:
        groups = config.groups
        if len(groups) != 1:
            raise SpecInvalid(f"hicached serves models with one KV cache group; this one has "
                              f"{len(groups)} (hybrid or sliding-window models)",
                              metadata={"groups": len(groups)})
        (group,) = groups
        layers = len(group.layer_names)
        bpc = int(config.cache.blocks_per_chunk)
        block_tokens = int(group.tokens_per_block)  # vLLM's KV block (a page has bpc of them)
        per_block = int(config.worker_kv_bytes_per_block)
        if layers < 1 or per_block % layers or (per_block // layers) % block_tokens:
            raise SpecInvalid(f"{per_block} KV bytes per block over {layers} layers and "
                              f"{block_tokens} tokens is not a whole row per token and layer",
                              metadata={"bytes_per_block": per_block, "layers": layers})
        par = config.parallel
        if par.pp_size != 1 or par.pcp_size != 1 or par.dcp_size != 1:
            raise SpecInvalid("hicached serves tensor parallelism only (no pipeline or "
                              "context parallelism yet)",
                              metadata={"pp": par.pp_size, "pcp": par.pcp_size,
                                        "dcp": par.dcp_size})
        replicated = bool(config.replicated_layout)
        ident = (FORMAT_TAG, config.model.name, config.model.dtype, str(config.kv_cache_layout),
                 spec_config.namespace, str(layers), str(per_block // layers),
                 str(block_tokens), str(bpc), str(par.world_size))  # not the DP rank: DP
        # engines share
        return cls(model=config.model.name, ident=ident, layers=layers,
                   layer_block_bytes=per_block // layers, block_tokens=block_tokens,
                   blocks_per_chunk=bpc, world_size=int(par.world_size),
                   replicated=replicated, prefix=spec_config.pool_prefix)

    @property
    def page_tokens(self) -> int:
        """Tokens of one page (an offloaded block)."""
        return self.block_tokens * self.blocks_per_chunk

    @property
    def row_bytes(self) -> int:
        """Bytes of one token row of one layer (what the daemon's geometry calls a token)."""
        return self.layer_block_bytes // self.block_tokens

    def geometry(self) -> KVGeometry:
        return KVGeometry(PoolKind.OPAQUE, DType.UINT8, layer_num=self.layers,
                          row_bytes=self.row_bytes)

    def pool_name(self, rank: int) -> str:
        shard = "rankall" if self.replicated else f"rank{rank}of{self.world_size}"
        return pool_names.pool_name(self.prefix, self.model, self.ident, shard)

    @property
    def pool_names(self) -> list[str]:
        """Every pool a block must be in to be a hit (one per rank; one for MLA)."""
        return [self.pool_name(r) for r in range(1 if self.replicated else self.world_size)]

    def writes(self, rank: int) -> bool:
        return not self.replicated or rank == 0

    def pool_spec(self, rank: int, size_tokens: int = 0, size_bytes: int = 0) -> PoolSpec:
        if not (size_tokens or size_bytes):
            size_tokens = self.page_tokens
        if size_tokens:
            size_tokens = max(size_tokens // self.page_tokens, 1) * self.page_tokens
        return PoolSpec(self.pool_name(rank), self.geometry(), self.page_tokens,
                        size_tokens=size_tokens, size_bytes=0 if size_tokens else size_bytes,
                        key_format=KeyFormat.VLLM)  # its KV events name blocks as vLLM's do
