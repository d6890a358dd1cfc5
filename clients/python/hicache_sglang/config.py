"""The linker's settings: SGLang's ``linker_extra_config`` JSON object, typed and checked.

Primitives:

- ``LinkerConfig``: frozen, one docstring per field, validated in ``__post_init__``.
- ``LinkerConfig.from_extra(extra)``: build it from the JSON object SGLang passes
  (``--unified-cache-external-linker-config '{..., "linker_extra_config": {...}}'``); an unknown
  field or a bad value raises ``hicache.errors.SpecInvalid`` naming it, at SGLang's start-up.

Deadlines are short on purpose: the scheduler calls ``lookup`` and ``offload`` on its own
thread, and a sidecar that does not answer within them is skipped (no hits, loads declined,
offloads dropped) while a background thread probes it (``hicache_client.link``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from hicache.errors import SpecInvalid
from hicache.paths import default_target
from hicache.polling import DEFAULT_MAX_US


def _check(ok: bool, name: str, value: object, want: str) -> None:
    if not ok:
        raise SpecInvalid(f"linker_extra_config.{name} must be {want}, got {value!r}",
                          metadata={"field": name, "value": repr(value)})


@dataclass(frozen=True)
class LinkerConfig:
    target: str = field(default_factory=default_target)
    """The daemon's gRPC address, ``unix:/path/to/hicached.sock`` or ``host:port``; default:
    where every client looks (``hicache.paths.default_target()``)."""
    lookup_timeout_s: float = 0.2
    """Deadline of one ``Lookup`` (scheduler thread): past it the lookup reports no hit and
    the link is late (lookups skipped until the daemon answers again), so a hung daemon
    holds a request's admission once, this long. 0.2 s: ten times a healthy daemon's p99.9
    on a saturated 2-CPU host (benchmarks/bench_lookup_deadline.py, RESULTS.md)."""
    rpc_timeout_s: float = 5.0
    """Deadline of a ``LoadKeys`` or ``Store`` (linker threads) and of set-up calls."""
    reconnect_interval_s: float = 1.0
    """Seconds between attempts to reach the daemon again while it is down."""
    down_after_s: float = 10.0
    """How long calls may keep missing their deadlines (a daemon paused, swapping, stuck)
    before the link is taken down and a new session opened; until then the session is kept
    and the daemon is skipped (no hits, loads declined, offloads dropped) while it is probed."""
    lookup_hold_ms: int = 5000
    """How long a ``lookup``'s hit is held for this worker's coming load (the daemon keeps
    the pages from eviction until the load consumes them, ``cancel_queued_load`` or this
    passes; capped by the daemon's ``max_hold_ms``). A hit is then a promise: a load of it
    cannot fail for a key evicted meanwhile. 0: no holds (a hit another worker's stores evict
    before the load aborts the batch)."""
    pool_size_tokens: int = 0
    """Host pool size in tokens; 0 = ``pool_size_ratio`` times SGLang's device pool."""
    pool_size_bytes: int = 0
    """Host pool size in bytes instead (rounded down to whole pages); 0 = unset."""
    pool_size_ratio: float = 4.0
    """Without ``pool_size_tokens`` / ``pool_size_bytes``: the host pool holds this many times
    SGLang's device pool (its ``size``, whole pages), so it keeps what the device evicts (a
    pool no larger than the device holds little the device does not), and a request as long
    as the device pool can be held whole (a session holds at most the daemon's
    ``max_held_fraction``, a quarter by default, of a pool). Where the daemon's memory budget
    cannot give that much, the pool gets the part of what it has left that is this rank's
    (``hicache_client.link``)."""
    pool_prefix: str = "sgl"
    """First part of the pool name; the rest is derived from model, format and geometry."""
    namespace: str = ""
    """Extra namespace part (e.g. a deployment or tenant); pools differ when it differs."""
    layer_events: int = 0
    """CUDA: interprocess events per load (layer groups); 0 = one per layer up to 64."""
    lease_ms: int = 0
    """Session lease; 0 = the daemon's default. Heartbeats keep a live worker's session."""
    shm_dir: str = "/dev/shm"
    """CPU workers over TCP only: where the device KV buffers are re-homed as files so the
    daemon can map them. On the Unix socket they are sealed memfds passed by fd."""
    worker_id: str = ""
    """Name shown in ``hicachectl sessions``; default ``sglang-<host>-<pid>-tp<rank>``."""
    max_inflight_offloads: int = 64
    """Offloads queued at once; beyond it an offload is dropped (counted) rather than wait."""
    poll_us: int = DEFAULT_MAX_US
    """The longest a call over the daemon's fast path polls for its reply before its thread
    sleeps (``HiCacheClient(spin_us=...)``; the window adapts, ``hicache.polling``); 0 =
    never poll."""

    def __post_init__(self) -> None:
        _check(isinstance(self.target, str) and bool(self.target), "target", self.target,
               "a non-empty address")
        for name in ("lookup_timeout_s", "rpc_timeout_s", "reconnect_interval_s",
                     "down_after_s"):
            v = getattr(self, name)
            _check(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                   and 0 < v <= 600, name, v, "a number of seconds in (0, 600]")
        for name in ("pool_size_tokens", "pool_size_bytes", "layer_events", "lease_ms",
                     "max_inflight_offloads", "lookup_hold_ms"):
            v = getattr(self, name)
            _check(isinstance(v, int) and not isinstance(v, bool) and v >= 0, name, v,
                   "a non-negative integer")
        _check(isinstance(self.poll_us, int) and not isinstance(self.poll_us, bool)
               and 0 <= self.poll_us <= 100_000, "poll_us", self.poll_us,
               "microseconds in [0, 100000]")
        _check(isinstance(self.pool_size_ratio, int | float)
               and not isinstance(self.pool_size_ratio, bool)
               and math.isfinite(self.pool_size_ratio) and 0 < self.pool_size_ratio <= 1024,
               "pool_size_ratio", self.pool_size_ratio, "a number in (0, 1024]")
        _check(not (self.pool_size_tokens and self.pool_size_bytes), "pool_size_bytes",
               self.pool_size_bytes, "unset when pool_size_tokens is set")
        _check(self.max_inflight_offloads >= 1, "max_inflight_offloads",
               self.max_inflight_offloads, ">= 1")
        for name in ("pool_prefix", "namespace", "shm_dir", "worker_id"):
            _check(isinstance(getattr(self, name), str), name, getattr(self, name), "a string")
        _check(bool(self.pool_prefix) and self.pool_prefix.replace("-", "").isalnum(),
               "pool_prefix", self.pool_prefix, "letters, digits and '-'")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> LinkerConfig:
        """The config from SGLang's ``linker_extra_config`` (None or {} = all defaults)."""
        extra = dict(extra or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise SpecInvalid(f"linker_extra_config: unknown fields {unknown}; known: "
                              f"{sorted(known)}", metadata={"unknown": ",".join(unknown)})
        return cls(**extra)
