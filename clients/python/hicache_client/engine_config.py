"""What every engine integration's settings share: one base, its fields and its checks.

The SGLang linker (``hicache_sglang.config.LinkerConfig``, SGLang's ``linker_extra_config``)
and the vLLM spec (``hicache_vllm.config.SpecConfig``, vLLM's ``kv_connector_extra_config``)
each read one flat JSON object from the engine's command line. The fields both have (where the
daemon is, the deadlines of the link, the holds, the pool's size and name, the session) are
declared and checked here once; each integration adds its own and may give a field another
default. A bad value or an unknown key stops the engine's start with ``SPEC_INVALID`` naming
it, in an error bounded in size whatever the object holds.

Primitives:

- ``EngineConfig``: frozen, one docstring per field, validated in ``__post_init__``;
  ``SECTION`` names the JSON object in errors, ``ENGINE_KEYS`` the keys the engine reads
  itself (skipped). Subclasses call ``check`` for their own fields.
- ``EngineConfig.from_extra(extra)``: the config from the engine's JSON object.
- ``POOL_PREFIX``: what a pool name's first part may be.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from hicache.errors import SpecInvalid
from hicache.paths import default_target
from hicache.polling import DEFAULT_MAX_US

POOL_PREFIX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,31}\Z")
"""1-32 ASCII letters, digits and '-', a letter or digit first."""

C = TypeVar("C", bound="EngineConfig")


@dataclass(frozen=True)
class EngineConfig:
    SECTION: ClassVar[str] = "extra_config"
    """The JSON object's name, as errors name a field of it."""
    ENGINE_KEYS: ClassVar[frozenset[str]] = frozenset()
    """Keys of that object the engine reads itself: passed over."""

    target: str = field(default_factory=default_target)
    """The daemon's gRPC address, ``unix:/path/to/hicached.sock`` or ``host:port``; default:
    where every client looks (``hicache.paths.default_target()``)."""
    lookup_timeout_s: float = 0.2
    """Deadline of one ``Lookup`` (on the engine's scheduler thread): past it the blocks asked
    are misses and the link is late (lookups skipped until the daemon answers again), so a
    hung daemon holds a request's admission once, this long. 0.2 s: ten times a healthy
    daemon's p99.9 on a saturated 2-CPU host (benchmarks/bench_lookup_deadline.py)."""
    rpc_timeout_s: float = 5.0
    """Deadline of a ``LoadKeys`` or ``Store`` (the integration's own threads) and of set-up
    calls."""
    reconnect_interval_s: float = 1.0
    """Seconds between attempts to reach the daemon again while it is down."""
    down_after_s: float = 10.0
    """How long calls may keep missing their deadlines (a daemon paused, swapping, stuck)
    before the link is taken down and a new session opened; until then the session is kept
    and the daemon is skipped while it is probed."""
    lookup_hold_ms: int = 5000
    """How long a lookup's hit is held for this engine's coming load (capped by the daemon's
    ``max_hold_ms``): the daemon keeps the pages from eviction until the load consumes them,
    the engine lets them go or this passes."""
    pool_size_tokens: int = 0
    """Host pool size in tokens; 0 = ``pool_size_ratio`` times the engine's own KV cache."""
    pool_size_bytes: int = 0
    """Host pool size in bytes instead (rounded down to whole pages); 0 = unset."""
    pool_size_ratio: float = 4.0
    """Without ``pool_size_tokens`` / ``pool_size_bytes``: the host pool holds this many times
    the engine's KV cache, so it keeps what the engine evicts, and a request as long as the KV
    cache can be held whole (a session holds at most the daemon's ``max_held_fraction``, a
    quarter by default, of a pool). Where the daemon's memory budget cannot give that much,
    the pool gets this rank's share of what it has left (``hicache_client.pool_setup``)."""
    pool_prefix: str = "hicache"
    """First part of the pool name; the rest is derived from model, format and geometry."""
    namespace: str = ""
    """Extra namespace part (a deployment or tenant); pools differ when it differs."""
    lease_ms: int = 0
    """Session lease; 0 = the daemon's default. Heartbeats keep a live worker's session."""
    shm_dir: str = "/dev/shm"
    """CPU workers over TCP only: where buffers are files the daemon maps. On the Unix socket
    they are sealed memfds passed by fd."""
    worker_id: str = ""
    """Name shown in ``hicachectl sessions``; default: the engine, host, pid and rank."""
    poll_us: int = DEFAULT_MAX_US
    """The longest a call over the daemon's fast path polls for its reply before its thread
    sleeps (``HiCacheClient(spin_us=...)``; the window adapts, ``hicache.polling``); 0 =
    never poll."""

    def check(self, ok: bool, name: str, value: object, want: str) -> None:
        """``SPEC_INVALID`` naming ``name`` of ``SECTION`` unless ``ok``."""
        if not ok:
            raise SpecInvalid(f"{self.SECTION}.{name} must be {want}, got {value!r:.200}",
                              metadata={"field": name, "value": repr(value)[:200]})

    def check_seconds(self, *names: str) -> None:
        for name in names:
            v = getattr(self, name)
            self.check(isinstance(v, int | float) and not isinstance(v, bool)
                       and math.isfinite(v) and 0 < v <= 600, name, v,
                       "a number of seconds in (0, 600]")

    def check_counts(self, *names: str) -> None:
        for name in names:
            v = getattr(self, name)
            self.check(isinstance(v, int) and not isinstance(v, bool) and v >= 0, name, v,
                       "a non-negative integer")

    def __post_init__(self) -> None:
        self.check(isinstance(self.target, str) and bool(self.target), "target", self.target,
                   "a non-empty address")
        self.check_seconds("lookup_timeout_s", "rpc_timeout_s", "reconnect_interval_s",
                           "down_after_s")
        self.check_counts("pool_size_tokens", "pool_size_bytes", "lease_ms", "lookup_hold_ms")
        self.check(isinstance(self.poll_us, int) and not isinstance(self.poll_us, bool)
                   and 0 <= self.poll_us <= 100_000, "poll_us", self.poll_us,
                   "microseconds in [0, 100000]")
        self.check(isinstance(self.pool_size_ratio, int | float)
                   and not isinstance(self.pool_size_ratio, bool)
                   and math.isfinite(self.pool_size_ratio) and 0 < self.pool_size_ratio <= 1024,
                   "pool_size_ratio", self.pool_size_ratio, "a number in (0, 1024]")
        self.check(not (self.pool_size_tokens and self.pool_size_bytes), "pool_size_bytes",
                   self.pool_size_bytes, "unset when pool_size_tokens is set")
        for name in ("pool_prefix", "namespace", "shm_dir", "worker_id"):
            self.check(isinstance(getattr(self, name), str), name, getattr(self, name),
                       "a string")
        self.check(bool(POOL_PREFIX.match(self.pool_prefix)), "pool_prefix", self.pool_prefix,
                   "1-32 ASCII letters, digits and '-', a letter or digit first")

    @classmethod
    def from_extra(cls: type[C], extra: Any) -> C:
        """The config from the engine's JSON object (None: every default); the engine's own
        keys are passed over, any other unknown key refused (the first few named)."""
        if extra is None:
            extra = {}
        if not hasattr(extra, "items"):
            raise SpecInvalid(f"{cls.SECTION} must be a JSON object",
                              metadata={"value": repr(extra)[:200]})
        ours = {k: v for k, v in extra.items() if k not in cls.ENGINE_KEYS}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k)[:64] for k in set(ours) - known)
        if unknown:  # bounded: the first few names, each cut short
            names = ",".join(unknown[:8])[:400]
            raise SpecInvalid(f"{cls.SECTION}: unknown fields {names} ({len(unknown)} in "
                              f"all); known: {sorted(known | cls.ENGINE_KEYS)}",
                              metadata={"unknown": names, "count": len(unknown)})
        return cls(**ours)
