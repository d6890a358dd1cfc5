"""The spec's settings: vLLM's ``kv_connector_extra_config`` JSON object, typed and checked.

vLLM hands the offloading spec one flat object, shared with its own connector. Its keys are
vLLM's (``VLLM_KEYS``: the spec's name and module path, the offloaded block size, event and
prompt-only switches) or ours (``SpecConfig``'s fields); any other key is refused at vLLM's
start-up with ``SPEC_INVALID`` naming it, as is a bad value.

Primitives:

- ``VLLM_KEYS``: the keys vLLM 0.33's ``OffloadingConnector`` reads itself.
- ``SpecConfig``: frozen, one docstring per field, validated in ``__post_init__``.
- ``SpecConfig.from_extra(extra)``: build it from the extra config (vLLM's keys left out).

Deadlines are short on purpose: the scheduler's thread waits on the daemon only in lookups,
each at most ``lookup_timeout_s``, and a daemon that does not answer within them is skipped
(misses, stores dropped) while it is probed (``hicache_client.link``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from hicache.errors import SpecInvalid
from hicache.paths import default_target
from hicache.polling import DEFAULT_MAX_US

VLLM_KEYS = frozenset({
    "spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "canonical_layout",
    "self_describing_kv_events", "offload_prompt_only", "sync_load_budget_bytes"})

_PREFIX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,31}\Z")


def _check(ok: bool, name: str, value: object, want: str) -> None:
    if not ok:
        raise SpecInvalid(f"kv_connector_extra_config.{name} must be {want}, got {value!r}",
                          metadata={"field": name, "value": repr(value)[:200]})


@dataclass(frozen=True)
class SpecConfig:
    target: str = field(default_factory=default_target)
    """The daemon's gRPC address, ``unix:/path/to/hicached.sock`` or ``host:port``; default:
    where every client looks (``hicache.paths.default_target()``)."""
    lookup_timeout_s: float = 0.2
    """Deadline of a ``Lookup`` (on vLLM's scheduler thread): past it the blocks asked are
    misses and the link is late (not called until the daemon answers again)."""
    rpc_timeout_s: float = 5.0
    """Deadline of a ``LoadKeys`` or ``Store`` (the worker's transfer threads) and of set-up
    calls."""
    reconnect_interval_s: float = 1.0
    """Seconds between attempts to reach the daemon again while it is down."""
    down_after_s: float = 10.0
    """How long calls may keep missing their deadlines before the link is taken down and a
    new session opened (until then the daemon is skipped while it is probed)."""
    lookup_hold_ms: int = 30000
    """How long a lookup's hit is held (capped by the daemon's ``max_hold_ms``): the daemon
    keeps the pages from eviction until vLLM's ``complete_load`` or the request's end releases
    them. A ``lookup`` answer older than half of it is asked again."""
    load_retry_s: float = 10.0
    """How long after its first try a load that fails (the daemon restarting or hung under
    it) is tried again before it is given up; keys the daemon says are gone give it up at
    once. Given up, its blocks are recomputed (or the request failed) with
    ``hicache_vllm.connector``'s connector; with vLLM's own ``OffloadingConnector``, which
    cannot be told, a load waits at least as long as its hold (``lookup_hold_ms``) and then
    stops the engine (docs/api.md, "Use with vLLM")."""
    pool_size_tokens: int = 0
    """Host pool size in tokens; 0 = ``pool_size_ratio`` times vLLM's own KV cache."""
    pool_size_bytes: int = 0
    """Host pool size in bytes instead (rounded down to whole pages); 0 = unset."""
    pool_size_ratio: float = 4.0
    """Without ``pool_size_tokens`` / ``pool_size_bytes``: the host pool holds this many times
    vLLM's KV cache (its blocks), so it keeps what vLLM evicts, and a request as long as the
    KV cache can be held whole (a session holds at most the daemon's ``max_held_fraction``, a
    quarter by default, of a pool). Where the daemon's memory budget cannot give that much,
    the pool gets this rank's share of what it has left (``hicache_client.pool_setup``)."""
    pool_prefix: str = "vllm"
    """First part of the pool name; the rest is derived from model, format and geometry."""
    namespace: str = ""
    """Extra namespace part (a deployment or tenant); pools differ when it differs."""
    lease_ms: int = 0
    """Session lease; 0 = the daemon's default. Heartbeats keep a live worker's session."""
    shm_dir: str = "/dev/shm"
    """CPU workers over TCP only: where the staging buffers are files the daemon maps. On the
    Unix socket they are sealed memfds passed by fd."""
    staging_blocks: int = 256
    """CPU workers: offloaded blocks one transfer moves at once through the worker's staging
    buffers (one area for stores, one for loads); larger jobs go in rounds."""
    worker_id: str = ""
    """Name shown in ``hicachectl sessions``; default ``vllm-<host>-<pid>-rank<r>``."""
    poll_us: int = DEFAULT_MAX_US
    """The longest a fast-path call polls for its reply before its thread sleeps; 0 = never."""

    def __post_init__(self) -> None:
        _check(isinstance(self.target, str) and bool(self.target), "target", self.target,
               "a non-empty address")
        for name in ("lookup_timeout_s", "rpc_timeout_s", "reconnect_interval_s",
                     "down_after_s", "load_retry_s"):
            v = getattr(self, name)
            _check(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                   and 0 < v <= 600, name, v, "a number of seconds in (0, 600]")
        for name in ("pool_size_tokens", "pool_size_bytes", "lease_ms", "lookup_hold_ms",
                     "staging_blocks"):
            v = getattr(self, name)
            _check(isinstance(v, int) and not isinstance(v, bool) and v >= 0, name, v,
                   "a non-negative integer")
        _check(self.lookup_hold_ms >= 100, "lookup_hold_ms", self.lookup_hold_ms,
               ">= 100 (a hit vLLM loads must be held)")
        _check(self.staging_blocks >= 1, "staging_blocks", self.staging_blocks, ">= 1")
        _check(isinstance(self.poll_us, int) and not isinstance(self.poll_us, bool)
               and 0 <= self.poll_us <= 100_000, "poll_us", self.poll_us,
               "microseconds in [0, 100000]")
        _check(isinstance(self.pool_size_ratio, int | float)
               and not isinstance(self.pool_size_ratio, bool)
               and math.isfinite(self.pool_size_ratio) and 0 < self.pool_size_ratio <= 1024,
               "pool_size_ratio", self.pool_size_ratio, "a number in (0, 1024]")
        _check(not (self.pool_size_tokens and self.pool_size_bytes), "pool_size_bytes",
               self.pool_size_bytes, "unset when pool_size_tokens is set")
        for name in ("pool_prefix", "namespace", "shm_dir", "worker_id"):
            _check(isinstance(getattr(self, name), str), name, getattr(self, name), "a string")
        _check(bool(_PREFIX.match(self.pool_prefix)), "pool_prefix", self.pool_prefix,
               "1-32 ASCII letters, digits and '-', a letter or digit first")

    @classmethod
    def from_extra(cls, extra: Any) -> SpecConfig:
        """The config from vLLM's ``kv_connector_extra_config`` (vLLM's own keys skipped)."""
        if extra is None:
            extra = {}
        if not hasattr(extra, "items"):
            raise SpecInvalid("kv_connector_extra_config must be a JSON object",
                              metadata={"value": repr(extra)[:200]})
        ours = {k: v for k, v in extra.items() if k not in VLLM_KEYS}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k)[:64] for k in set(ours) - known)
        if unknown:  # bounded: the first few names, each cut short
            names = ",".join(unknown[:8])[:400]
            raise SpecInvalid(f"kv_connector_extra_config: unknown fields {names} "
                              f"({len(unknown)} in all); known: {sorted(known | VLLM_KEYS)}",
                              metadata={"unknown": names, "count": len(unknown)})
        if extra.get("canonical_layout"):
            raise SpecInvalid("kv_connector_extra_config.canonical_layout is not supported: "
                              "hicached keeps each rank's own pages",
                              metadata={"field": "canonical_layout"})
        return cls(**ours)
