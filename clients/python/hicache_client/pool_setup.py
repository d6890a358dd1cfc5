"""An engine's pool on the daemon: created as asked, adopted as another instance created it, or
fitted to what the daemon's memory budget has left.

Every instance and rank of an engine asks for its pool when its link comes up (SGLang's linker,
vLLM's offloading spec); the first creates it, the others find it there. Instances of a model
whose device pools differ in size (other memory fractions) still share one pool: a pool there
that differs from the asked spec in size only, or only in how its rows are named
(``same_storage``), is used as it is. A size the engine derived itself (not one its user set)
gives way to the daemon's budget: rather than no cache at all, the pool gets this rank's share
of what the budget has left.

Primitives:

- ``BudgetShare(shards)``: the asked size is a default that may shrink; ``shards`` pools of
  this engine (one per tensor-parallel rank, or one shared) divide what is left.
- ``ensure_pool(client, spec, create, wait_seconds, share) -> PoolSpec``: the pool's spec as
  it is on the daemon now (created, adopted or fitted); raises what the daemon answered
  otherwise (``POOL_SPEC_CONFLICT`` for another geometry, ``HOST_MEMORY_INSUFFICIENT`` when
  even the share is less than a page, ``POOL_NOT_FOUND`` for a pool others must create).
- ``fitted(spec, exc, share)``: the spec shrunk to the share, from the refusal's metadata
  (what the asked pool would have cost, the budget, what is used), or None.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from hicache.errors import HostMemoryInsufficient, PoolSpecConflict
from hicache.specs import PoolSpec, same_storage
from hicache_client.client import HiCacheClient

log = logging.getLogger("hicache_client.pool_setup")


@dataclass(frozen=True)
class BudgetShare:
    shards: int
    """How many pools of this engine divide what the daemon's budget has left (MHA: one per
    tensor-parallel rank; a pool every rank shares: 1)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.shards, int) and self.shards >= 1):
            raise ValueError(f"BudgetShare.shards must be >= 1, got {self.shards!r}")


def fitted(spec: PoolSpec, exc: HostMemoryInsufficient, share: BudgetShare) -> PoolSpec | None:
    """``spec`` at this rank's share of the budget left, in whole pages (its cost per token
    from what the daemon said the asked size would cost), or None below one page."""
    try:
        asked = int(exc.metadata["requested_bytes"])
        left = int(exc.metadata["budget_bytes"]) - int(exc.metadata["used_bytes"])
    except (KeyError, ValueError):
        return None
    tokens = spec.resolved_size_tokens()
    if asked <= 0 or tokens <= 0 or left <= 0:
        return None
    pages = (left // share.shards) * tokens // asked // spec.page_size
    if pages < 1 or pages * spec.page_size >= tokens:
        return None
    return dataclasses.replace(spec, size_tokens=pages * spec.page_size, size_bytes=0)


def ensure_pool(client: HiCacheClient, spec: PoolSpec, *, create: bool, wait_seconds: float,
                share: BudgetShare | None = None) -> PoolSpec:
    try:
        if not create:
            raise PoolSpecConflict("use the pool as created")
        # a large pool may take minutes to build: wait a deadline's worth, then leave it to
        # the link's thread (POOL_NOT_READY) rather than hold the server's start
        try:
            client.create_pool(spec, wait_seconds=wait_seconds)
            return spec
        except HostMemoryInsufficient as exc:
            smaller = fitted(spec, exc, share) if share is not None else None
            if smaller is None:
                raise
            log.warning("hicached's memory budget cannot hold pool %s at %d tokens (%s); "
                        "creating it with %d, this rank's share of what is left", spec.name,
                        spec.resolved_size_tokens(), exc, smaller.size_tokens)
            client.create_pool(smaller, wait_seconds=wait_seconds)
            return smaller
    except PoolSpecConflict as exc:
        return _adopt(client, spec, exc)


def _adopt(client: HiCacheClient, spec: PoolSpec, conflict: PoolSpecConflict) -> PoolSpec:
    """The pool there, if it is ``spec`` but for its size; else ``conflict`` is raised."""
    there = client.get_pool(spec.name).spec
    sized = dataclasses.replace(spec, size_tokens=there.size_tokens, size_bytes=there.size_bytes)
    if not same_storage(there, sized):
        raise conflict
    log.info("using pool %s as created (%d tokens) by another worker", spec.name,
             there.resolved_size_tokens())
    return there
