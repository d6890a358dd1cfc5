"""The spec's settings: vLLM's ``kv_connector_extra_config`` JSON object, typed and checked.

vLLM hands the offloading spec one flat object, shared with its own connector. Its keys are
vLLM's (``VLLM_KEYS``: the spec's name and module path, the offloaded block size, event and
prompt-only switches) or ours (``SpecConfig``'s fields); any other key is refused at vLLM's
start-up with ``SPEC_INVALID`` naming it, as is a bad value.

Primitives:

- ``VLLM_KEYS``: the keys vLLM's ``OffloadingConnector`` reads itself (0.33 and 0.34 alike).
- ``SpecConfig``: ``hicache_client.engine_config.EngineConfig`` (the fields every engine
  integration has, checked there) and the spec's own; frozen, one docstring per field.
- ``SpecConfig.from_extra(extra)``: build it from the extra config (vLLM's keys left out).

Deadlines are short on purpose: the scheduler's thread waits on the daemon only in lookups,
each at most ``lookup_timeout_s``, and a daemon that does not answer within them is skipped
(misses, stores dropped) while it is probed (``hicache_client.link``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from hicache.errors import SpecInvalid
from hicache_client.engine_config import EngineConfig

VLLM_KEYS = frozenset({
    "spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "canonical_layout",
    "self_describing_kv_events", "offload_prompt_only", "sync_load_budget_bytes"})


@dataclass(frozen=True)
class SpecConfig(EngineConfig):
    """``EngineConfig``'s fields (where the daemon is, deadlines, holds, the pool's size and
    name, the session) and the spec's own."""

    SECTION: ClassVar[str] = "kv_connector_extra_config"
    ENGINE_KEYS: ClassVar[frozenset[str]] = VLLM_KEYS

    lookup_hold_ms: int = 30000
    """How long a lookup's hit is held (capped by the daemon's ``max_hold_ms``): the daemon
    keeps the pages from eviction until vLLM's ``complete_load`` or the request's end releases
    them. A ``lookup`` answer older than half of it is asked again."""
    pool_prefix: str = "vllm"
    """First part of the pool name; the rest is derived from model, format and geometry."""
    shm_dir: str = "/dev/shm"
    """CPU workers over TCP only: where the staging buffers are files the daemon maps. On the
    Unix socket they are sealed memfds passed by fd."""
    worker_id: str = ""
    """Name shown in ``hicachectl sessions``; default ``vllm-<host>-<pid>-rank<r>``."""
    load_retry_s: float = 10.0
    """How long after its first try a load that fails (the daemon restarting or hung under
    it) is tried again before it is given up; keys the daemon says are gone give it up at
    once. Given up, its blocks are recomputed (or the request failed) with
    ``hicache_vllm.connector``'s connector; with vLLM's own ``OffloadingConnector``, which
    cannot be told, a load waits at least as long as its hold (``lookup_hold_ms``) and then
    stops the engine (docs/api.md, "Use with vLLM")."""
    staging_blocks: int = 256
    """CPU workers: offloaded blocks one transfer moves at once through the worker's staging
    buffers (one area for stores, one for loads); larger jobs go in rounds."""
    cuda_sharing: str = "fd"
    """GPU workers on vLLM 0.34: how vLLM's KV cache reaches the daemon. ``"fd"``: vLLM keeps
    its default extensible KV cache (virtual memory), exportable because
    ``HicachedOffloadingConnector`` declares ``KVCacheAccess.EXPORTS_FD``; its physical
    allocations travel as file descriptors over the daemon's Unix socket (a ``target`` over
    TCP, where no fd travels, is refused at start). ``"legacy_ipc"``, the fallback: the
    connector declares ``LEGACY_IPC``, vLLM turns its extensible KV cache off (and sizes the
    cache from profiling estimates) and the worker shares CUDA IPC handles: for a daemon
    reached over TCP, or an engine that sets what the extensible cache refuses
    (``--no-enable-extensible-kv-cache``, ``kv_cache_memory_bytes``,
    ``num_gpu_blocks_override``). vLLM 0.33 always shares CUDA IPC handles; CPU workers stage
    (nothing to choose)."""

    SHARINGS: ClassVar[tuple[str, ...]] = ("fd", "legacy_ipc")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check(self.cuda_sharing in self.SHARINGS, "cuda_sharing", self.cuda_sharing,
                   f"one of {', '.join(self.SHARINGS)}")
        self.check_seconds("load_retry_s")
        self.check_counts("staging_blocks")
        self.check(self.lookup_hold_ms >= 100, "lookup_hold_ms", self.lookup_hold_ms,
                   ">= 100 (a hit vLLM loads must be held)")
        self.check(self.staging_blocks >= 1, "staging_blocks", self.staging_blocks, ">= 1")

    @classmethod
    def from_extra(cls, extra: Any) -> SpecConfig:
        """The config from vLLM's ``kv_connector_extra_config`` (vLLM's own keys skipped)."""
        if hasattr(extra, "get") and extra.get("canonical_layout"):
            raise SpecInvalid("kv_connector_extra_config.canonical_layout is not supported: "
                              "hicached keeps each rank's own pages",
                              metadata={"field": "canonical_layout"})
        return super().from_extra(extra)
