"""Which hicached pool a worker's pages live in: the key namespace.

A hicached pool is a key namespace. Two workers share pages exactly when their pool names are
equal, so the name carries everything that makes KV bytes different for the same tokens:

- the model (path and revision) and an optional operator namespace;
- the page format: ``FORMAT_TAG`` (how this linker lays pages out: token-major rows per layer,
  SGLang's device layout) and SGLang's own ``storage_format_tag`` when the pool has one;
- the geometry (kind, store dtype, heads / dims / row width, layers, page size);
- the shard: MHA KV differs per tensor-parallel rank (one pool per rank); MLA KV is the same on
  every TP rank (one shared pool, rank 0 writes, every rank reads). Context- and
  pipeline-parallel ranks always differ.

Primitives:

- ``FORMAT_TAG``: this linker's page format.
- ``Shard``: tp / cp / pp ranks and whether the KV is replicated across TP ranks.
- ``pool_name(prefix, model, geometry, page_size, shard, ...)``: a readable, valid pool name
  (``hicache_client.pool_names``: ``<prefix>-<model basename>-<12 hex digest>-<shard>``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.specs import KVGeometry
from hicache_client import pool_names

FORMAT_TAG = "hicached-token-major-v1"


@dataclass(frozen=True)
class Shard:
    tp_rank: int = 0
    tp_size: int = 1
    cp_rank: int = 0
    pp_rank: int = 0
    replicated: bool = False
    """The KV is identical on every TP rank (MLA): one pool for all of them."""

    @property
    def writer(self) -> bool:
        """This rank writes the pool (every rank of an unreplicated pool, rank 0 otherwise)."""
        return not self.replicated or self.tp_rank == 0

    def suffix(self) -> str:
        tp = "tpall" if self.replicated else f"tp{self.tp_rank}of{self.tp_size}"
        return f"{tp}-cp{self.cp_rank}-pp{self.pp_rank}"


def pool_name(prefix: str, model: str, geometry: KVGeometry, page_size: int, shard: Shard,
              *, revision: str = "", namespace: str = "", format_tag: str | None = None
              ) -> str:
    """The pool this shard's pages go to; equal only for byte-compatible KV."""
    return pool_names.pool_name(prefix, model, [
        FORMAT_TAG, format_tag or "", model, revision, namespace, repr(geometry),
        str(page_size)], shard.suffix())
