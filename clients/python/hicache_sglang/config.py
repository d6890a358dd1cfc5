"""The linker's settings: SGLang's ``linker_extra_config`` JSON object, typed and checked.

Primitives:

- ``LinkerConfig``: ``hicache_client.engine_config.EngineConfig`` (the fields every engine
  integration has, checked there) and the linker's own; frozen, one docstring per field.
- ``LinkerConfig.from_extra(extra)``: build it from the JSON object SGLang passes
  (``--unified-cache-external-linker-config '{..., "linker_extra_config": {...}}'``); an unknown
  field or a bad value raises ``hicache.errors.SpecInvalid`` naming it, at SGLang's start-up.

Deadlines are short on purpose: the scheduler calls ``lookup`` and ``offload`` on its own
thread, and a sidecar that does not answer within them is skipped (no hits, loads declined,
offloads dropped) while a background thread probes it (``hicache_client.link``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hicache_client.engine_config import EngineConfig


@dataclass(frozen=True)
class LinkerConfig(EngineConfig):
    """``EngineConfig``'s fields (where the daemon is, deadlines, holds, the pool's size and
    name, the session) and the linker's own."""

    SECTION: ClassVar[str] = "linker_extra_config"

    lookup_hold_ms: int = 5000
    """How long a ``lookup``'s hit is held for this worker's coming load (the daemon keeps
    the pages from eviction until the load consumes them, ``cancel_queued_load`` or this
    passes; capped by the daemon's ``max_hold_ms``). A hit is then a promise: a load of it
    cannot fail for a key evicted meanwhile. 0: no holds (a hit another worker's stores evict
    before the load aborts the batch)."""
    pool_size_ratio: float = 4.0
    """Without ``pool_size_tokens`` / ``pool_size_bytes``: the host pool holds this many times
    SGLang's device pool (its ``size``, whole pages), so it keeps what the device evicts (a
    pool no larger than the device holds little the device does not), and a request as long
    as the device pool can be held whole (a session holds at most the daemon's
    ``max_held_fraction``, a quarter by default, of a pool). Where the daemon's memory budget
    cannot give that much, the pool gets the part of what it has left that is this rank's
    (``hicache_client.pool_setup``)."""
    pool_prefix: str = "sgl"
    """First part of the pool name; the rest is derived from model, format and geometry."""
    shm_dir: str = "/dev/shm"
    """CPU workers over TCP only: where the device KV buffers are re-homed as files so the
    daemon can map them. On the Unix socket they are sealed memfds passed by fd."""
    worker_id: str = ""
    """Name shown in ``hicachectl sessions``; default ``sglang-<host>-<pid>-tp<rank>``."""
    layer_events: int = 0
    """CUDA: interprocess events per load (layer groups); 0 = one per layer up to 64."""
    max_inflight_offloads: int = 64
    """Offloads queued at once; beyond it an offload is dropped (counted) rather than wait."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_counts("layer_events", "max_inflight_offloads")
        self.check(self.max_inflight_offloads >= 1, "max_inflight_offloads",
                   self.max_inflight_offloads, ">= 1")
