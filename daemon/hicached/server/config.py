"""Daemon configuration: one frozen dataclass, validated on construction, plus TOML loading.

Primitives:

- ``ServerConfig``: every setting of ``hicached serve`` with its default and meaning (the
  default socket is ``hicache.paths.default_socket_path()``).
- ``parse_size("64GiB")``: sizes with binary/decimal suffixes.
- ``config_from_mapping(d)``: build a config from TOML-shaped data (file, env, flags merged by
  ``__main__`` in that precedence); ``[[pool]]`` tables declare pools that exist from startup.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from hicache.errors import SpecInvalid
from hicache.paths import (
    DEFAULT_STATE_DIR,
    FAST_PATH_SUFFIX,
    IDENTITY_SUFFIX,
    UNIX_PATH_MAX,
    default_socket_path,
    too_long,
    unix_path,
)
from hicache.polling import DEFAULT_MAX_US
from hicache.specs import (
    CanarySpec,
    DType,
    KeyFormat,
    KVGeometry,
    Layout,
    MemberSpec,
    PoolKind,
    PoolSpec,
)
from hicached.cache.holds import HoldPolicy
from hicached.cache.pool_cache import EVICTION
from hicached.core.system import available_bytes
from hicached.cuda.paths import Path as CopyPath
from hicached.publish.kv_event_config import KvEventsConfig
from hicached.service.budget_config import BudgetConfig
from hicached.service.identity import AccessRule
from hicached.tiers.config import DiskTierConfig
from hicached.tiers.mooncake_config import MooncakeTierConfig

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_size(value: object) -> int:
    """``123``, ``"64GiB"``, ``"1.5 GB"`` -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise SpecInvalid(f"cannot read size {value!r}", metadata={"value": value})
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one daemon process."""

    listen: tuple[str, ...] = ()
    """gRPC targets: ``unix:/path`` (default: a 0600 socket in the runtime directory) and,
    opt-in, ``host:port`` TCP: only with TLS and client authentication (``tls_client_ca`` or
    ``auth_token_file``) unless ``insecure_tcp``."""
    socket_mode: int = 0o600
    """Permission bits of ``unix:`` API sockets: 0o600 (the daemon's user only) or 0o660 (its
    group too: workers running as other users in the service's group)."""
    socket_group: str = ""
    """Group the ``unix:`` API sockets are given ("" = the daemon's own group)."""
    access: tuple[AccessRule, ...] = ()
    """``[[access]]`` rules: pools matching a glob may be opened only by listed uids / gids
    (identified through the identity socket beside each API socket)."""
    shm_dir: str = "/dev/shm"
    """The only directory whose files workers may hand over as device buffers."""
    state_dir: str = DEFAULT_STATE_DIR
    """Where pools live as files that outlive the daemon (memory and tables, re-attached on
    the next start; a hugetlbfs mount works too); one daemon per directory. "" = pools in
    anonymous memory, lost when the daemon exits."""
    accept_shm_paths: bool = True
    """Accept shared-memory buffers named by path (under ``shm_dir``). False: CPU workers must
    hand over sealed memfds through the identity socket, which they cannot shrink."""
    fast_path: bool = True
    """Serve the data calls (Store, LoadKeys, Lookup, Backup, Load) also on ``<socket>.fast``
    beside each ``unix:`` API socket, in a compact binary framing that skips Python gRPC's
    per-call cost; clients use it when ``GetInfo.fast_path`` offers it. False: gRPC only."""
    fast_path_spin_us: int = DEFAULT_MAX_US
    """The longest a fast-path connection's thread polls for the worker's next request after
    a reply before it sleeps (a sleeping CPU of a virtual machine takes 40-80 us to wake).
    The window adapts per connection (``hicache.polling``): it grows while requests come
    back to back and falls to 0 when they do not, so an idle or slow connection never
    polls; at most a quarter of the CPUs poll at once. 0: never poll (measured in
    bench_fastpath.py)."""
    fast_path_body_timeout_s: float = 5.0
    """The longest a fast-path frame's body may take to arrive once its header has: a
    connection slower than that is closed (a stalled or hostile sender holds no memory)."""
    fast_path_inflight_bytes: int = 256 << 20
    """Bytes of fast-path frames being read, over every connection; a frame that would take
    more waits (up to ``fast_path_body_timeout_s``) for others to finish, then is refused with
    ``OVERLOADED``. A frame's buffer grows with what has arrived, never with what its header
    announces."""
    max_keys_per_call: int = 65_536
    """Keys one Lookup, Store, LoadKeys or RemoveKeys may name; more: ``TOO_MANY_KEYS``."""
    metrics_listen: str = "127.0.0.1:9464"
    """HOST:PORT of the Prometheus endpoint; empty disables it; port 0 picks a free one."""
    memory_budget_bytes: int = 0
    """Bytes all pools together may use; 0 = half of the memory available at start."""
    reserve_bytes: int = 1 << 30
    """Memory left to the host: no pool may take MemAvailable minus this."""
    lease_seconds: float = 5.0
    """A session that neither heartbeats nor transfers for this long is reaped."""
    max_lease_seconds: float = 0.0
    """The longest lease a worker may ask for; longer ones are clamped (the reply says so), so
    a dead worker's mappings (GPU memory included) are released within this bound. 0 = 60 s,
    or lease_seconds when that is longer."""
    copy_threads: int = 0
    """Threads per copy (0 = a quarter of the usable CPUs, 1 to 8:
    ``core.system.default_copy_threads``; the rest of the node is the inference servers')."""
    copy_spin_us: int = 0
    """How long copy threads spin after a job before sleeping (0: they sleep at once). A spin
    saves the next copy a wake-up and takes a CPU meanwhile."""
    grpc_threads: int = 16
    """Threads serving control calls (sessions, heartbeats, pools, health, the rest); data
    calls run on their own executor, so no transfer ever holds one of these."""
    max_data_rpcs: int = 0
    """Data calls (Backup, Load, Store, LoadKeys, Lookup) at once, on their own executor;
    past it they are refused at once with OVERLOADED. 0 = grpc_threads - 4 (at least 1)."""
    max_pending_rpcs: int = 256
    """Calls accepted beyond grpc_threads, waiting for a thread; past it gRPC itself answers
    RESOURCE_EXHAUSTED. Bounds the queue a flood can build."""
    health_listen: tuple[str, ...] = ()
    """Extra targets serving only ``grpc.health.v1``, on their own server and threads, so
    probes never need the API and a flood of API calls cannot delay them."""
    max_watchers: int = 4
    """WatchEvents streams served at once; each holds one of the grpc_threads while open."""
    grace_seconds: float = 10.0
    """On SIGTERM: how long in-flight transfers may take to finish."""
    max_hold_ms: int = 30_000
    """The longest a Lookup's hold lasts, whatever its ``hold_ms`` asks (a worker that never
    loads cannot keep pages from the others for longer)."""
    max_held_fraction: float = 0.25
    """The share of a pool's pages one session may hold at once; past it a Lookup holds
    fewer (``held``), never fails."""
    eviction: str = "reuse"
    """Which ready pages a full pool evicts first: ``reuse`` (pages used again outlive pages
    used once by a margin each pool learns from its own traffic, and of one batch the
    deepest pages go first: ``hicached.cache.reuse_lru``) or ``lru`` (least recently
    used)."""
    max_message_bytes: int = 64 << 20
    """Largest request accepted (index batches travel as bytes: 8 per index)."""
    tls_cert: str = ""
    """PEM certificate for TCP listeners."""
    tls_key: str = ""
    """PEM private key for TCP listeners."""
    tls_client_ca: str = ""
    """PEM CA: TCP clients must present a certificate it signed (mutual TLS)."""
    auth_token_file: str = ""
    """File holding a bearer token TCP clients must send (``authorization: Bearer ...``), over
    TLS. Unix-socket callers are not asked: the socket's permissions are their boundary."""
    insecure_tcp: bool = False
    """Allow TCP listeners without TLS or client authentication (tests, isolated networks)."""
    hugepages: bool = True
    """Ask for transparent huge pages for pool memory."""
    cuda_driver: str = ""
    """CUDA driver library for IPC attachment and pinning ('' = libcuda.so.1). Pools are
    pinned and cuda_ipc sessions accepted only when it loads and reports a device."""
    cuda_copy_paths: tuple[str, ...] = ("dma",)
    """The ways copies between a GPU and the pools may go, chosen per batch by the rate each
    measured on that device (``hicached.cuda.paths``): ``dma`` (the copy engines, a driver
    call per run of pages, layer and component: always allowed), ``batch`` (the same copies
    in one ``cuMemcpyBatchAsync`` call, CUDA 12.8 drivers), ``kernel`` (the page kernel over
    the mapped pool, one launch per batch or layer group; compiled with NVRTC, the
    ``[cuda]`` extra). A way a device lacks is skipped and said once; a batch no allowed way
    can take goes by ``dma``. Until the GPU check has measured the others on a GPU, only
    ``dma`` is on by default."""
    pools: tuple[PoolSpec, ...] = field(default=())
    """Pools that exist from startup."""
    disk: DiskTierConfig | None = None
    """``[tier.disk]``: the local disk tier below host memory (None: none)."""
    mooncake: MooncakeTierConfig | None = None
    """``[tier.mooncake]``: the cluster tier, a Mooncake Store shared by the nodes (None:
    none)."""
    kv_events: KvEventsConfig = field(default_factory=KvEventsConfig)
    """``[kv_events]``: the KV event stream routers follow (off unless ``endpoint`` is
    set)."""
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    """``[budget]``: whether pools share the memory budget by demand (``elastic``), their
    floors, ceilings and tenants, the tenants' quotas (``service.budget_config``)."""
    log_format: str = "text"
    """``text`` or ``json`` (one object per line)."""
    log_level: str = "INFO"
    """Python logging level name."""

    def __post_init__(self) -> None:
        if not self.listen:
            object.__setattr__(self, "listen", (f"unix:{default_socket_path()}",))
        for setting in ("listen", "health_listen"):
            for target in getattr(self, setting):
                if not target.startswith("unix:") and ":" not in target:
                    raise SpecInvalid(f"{setting} target {target!r} is neither unix:PATH nor "
                                      "HOST:PORT", metadata={"setting": setting})
        if bool(self.tls_cert) != bool(self.tls_key):
            raise SpecInvalid("tls_cert and tls_key go together")
        if (self.tls_client_ca or self.auth_token_file) and not self.tls_cert:
            raise SpecInvalid("tls_client_ca and auth_token_file need TLS (tls_cert, tls_key): "
                              "a client certificate or token is only checked over TLS")
        tcp = [t for t in self.listen if not t.startswith("unix:")]
        authenticated = self.tls_cert and (self.tls_client_ca or self.auth_token_file)
        if tcp and not authenticated and not self.insecure_tcp:
            raise SpecInvalid(
                f"TCP listener {tcp[0]} without client authentication: give tls_cert + tls_key "
                "and tls_client_ca (mutual TLS) or auth_token_file, or insecure_tcp to accept "
                "anyone who can reach the port", metadata={"listen": tcp[0]})
        for name, low, high in _RANGES:
            value = getattr(self, name)
            if not low <= value <= high or (name in _ABOVE_LOW and value == low):
                raise SpecInvalid(f"{name} is within {'(' if name in _ABOVE_LOW else '['}"
                                  f"{low}, {high}], not {value}", metadata={name: value})
        if not self.max_lease_seconds:
            object.__setattr__(self, "max_lease_seconds", max(60.0, self.lease_seconds))
        if not self.lease_seconds <= self.max_lease_seconds:
            raise SpecInvalid("max_lease_seconds must be at least lease_seconds",
                              metadata={"lease_seconds": self.lease_seconds,
                                        "max_lease_seconds": self.max_lease_seconds})
        if not self.max_data_rpcs:
            object.__setattr__(self, "max_data_rpcs", max(self.grpc_threads - 4, 1))
        beside_api = (IDENTITY_SUFFIX, *((FAST_PATH_SUFFIX,) if self.fast_path else ()))
        for target, suffixes in [*((t, beside_api) for t in self.listen),
                                 *((t, ()) for t in self.health_listen)]:
            long = too_long(unix_path(target), suffixes) if target.startswith("unix:") else None
            if long is not None:
                n = len(os.fsencode(long))
                also = (f" (the daemon also listens on "
                        f"{' and '.join('<socket>' + s for s in suffixes)})" if suffixes else "")
                raise SpecInvalid(
                    f"Unix socket path {long[:200]!r} is {n} bytes, over the {UNIX_PATH_MAX} a "
                    f"Unix socket's path may have{also}: choose a shorter path",
                    metadata={"listen": target[:200], "path_bytes": n,
                              "max_bytes": UNIX_PATH_MAX})
        if not 0 <= self.max_watchers < self.grpc_threads:
            raise SpecInvalid("max_watchers must be >= 0 and below grpc_threads (each stream "
                              "holds an RPC thread)",
                              metadata={"max_watchers": self.max_watchers,
                                        "grpc_threads": self.grpc_threads})
        if self.socket_mode not in (0o600, 0o660):
            raise SpecInvalid("socket_mode is 0o600 or 0o660 (never world-accessible)",
                              metadata={"socket_mode": oct(self.socket_mode)})
        if self.log_format not in ("text", "json"):
            raise SpecInvalid("log_format is text or json")
        if self.state_dir and not os.path.isabs(self.state_dir):
            raise SpecInvalid("state_dir must be an absolute path (or empty: no state)",
                              metadata={"state_dir": self.state_dir})
        if not os.path.isabs(self.shm_dir):
            raise SpecInvalid("shm_dir must be an absolute path",
                              metadata={"shm_dir": self.shm_dir})
        self.hold_policy()  # validates max_hold_ms and max_held_fraction
        if not self.cuda_copy_paths or set(self.cuda_copy_paths) - set(CUDA_COPY_PATHS):
            raise SpecInvalid(f"cuda_copy_paths is a non-empty list of "
                              f"{', '.join(CUDA_COPY_PATHS)}, not "
                              f"{list(self.cuda_copy_paths)!r}",
                              metadata={"cuda_copy_paths": ",".join(self.cuda_copy_paths)})
        if self.eviction not in EVICTION:
            raise SpecInvalid(f"eviction is one of {', '.join(EVICTION)}, not "
                              f"{self.eviction!r}", metadata={"eviction": self.eviction})
        names = [p.name for p in self.pools]
        if len(names) != len(set(names)):
            raise SpecInvalid("declared pool names must be unique")

    def hold_policy(self) -> HoldPolicy:
        return HoldPolicy(self.max_hold_ms, self.max_held_fraction)

    def effective_budget(self) -> int:
        if self.memory_budget_bytes:
            return self.memory_budget_bytes
        return max(available_bytes() - self.reserve_bytes, 0) // 2


CUDA_COPY_PATHS = tuple(p.value for p in CopyPath)

_RANGES: tuple[tuple[str, float, float], ...] = (
    ("lease_seconds", 0, math.inf), ("grace_seconds", 0, math.inf),
    ("memory_budget_bytes", 0, math.inf), ("reserve_bytes", 0, math.inf),
    ("copy_threads", 0, math.inf), ("grpc_threads", 1, math.inf),
    ("fast_path_spin_us", 0, 100_000), ("copy_spin_us", 0, 100_000),
    ("fast_path_body_timeout_s", 0, 3600), ("fast_path_inflight_bytes", 1 << 20, math.inf),
    ("max_keys_per_call", 1, math.inf), ("max_data_rpcs", 0, math.inf),
    ("max_pending_rpcs", 0, math.inf))
"""The numeric settings' bounds, both ends allowed but in ``_ABOVE_LOW``."""
_ABOVE_LOW = {"lease_seconds", "fast_path_body_timeout_s"}

_SIZE_FIELDS = {"memory_budget_bytes", "reserve_bytes", "max_message_bytes",
                "fast_path_inflight_bytes"}
_ALIASES = {"memory_budget": "memory_budget_bytes", "reserve": "reserve_bytes"}


def pool_from_mapping(d: Mapping[str, object]) -> PoolSpec:
    """A ``[[pool]]`` table: name, kind, dtype, layout, page_size, geometry, size or
    size_tokens, optional canary_read_bytes, key_format (``digest``, ``vllm``) and
    ``[[pool.side]]`` tables."""
    d = dict(d)

    def geometry(g: dict[str, object]) -> KVGeometry:
        kind = PoolKind(str(g.pop("kind", "MHA")).upper())
        dt = g.pop("dtype", "UINT8" if kind in (PoolKind.DSA_INDEXER, PoolKind.OPAQUE)
                   else "BFLOAT16")
        dims = {k: int(str(g.pop(k))) for k in ("layer_num", "head_num", "head_dim", "v_head_dim",
                                           "kv_lora_rank", "qk_rope_head_dim", "index_head_dim",
                                           "quant_block_size", "row_bytes") if k in g}
        return KVGeometry(kind, DType(str(dt).upper()), **dims)

    try:
        sides = [MemberSpec(str(s.pop("name")), geometry(s))
                 for s in (dict(x) for x in d.pop("side", []))]  # type: ignore[attr-defined]
        name = str(d.pop("name"))
        page_size = int(d.pop("page_size"))  # type: ignore[call-overload]
        layout = Layout(str(d.pop("layout", "layer_first")).lower())
        size_tokens = int(d.pop("size_tokens", 0))  # type: ignore[call-overload]
        size_bytes = parse_size(d.pop("size", 0))
        canary = int(str(d.pop("canary_read_bytes", 0)))
        key_format = KeyFormat(str(d.pop("key_format", "digest")).lower())
        anchor = geometry(d)
    except (KeyError, ValueError, TypeError) as exc:
        raise SpecInvalid(f"pool table is invalid: {exc}") from None
    if d:
        raise SpecInvalid(f"unknown pool keys: {sorted(d)}")
    return PoolSpec(name, anchor, page_size, layout, size_tokens=size_tokens,
                    size_bytes=size_bytes, side_pools=tuple(sides),
                    canary=CanarySpec(canary) if canary else None, key_format=key_format)


def access_rule(r: Mapping[str, object]) -> AccessRule:
    """An ``[[access]]`` table: ``pools`` (a glob), ``uids`` and/or ``gids`` (lists)."""
    unknown = set(r) - {"pools", "uids", "gids"}
    if "pools" not in r or unknown:
        raise SpecInvalid("an [[access]] rule has pools (a glob) and uids / gids lists",
                          metadata={"unknown": ",".join(sorted(unknown))})
    ids = {k: tuple(int(str(x)) for x in r.get(k, ())) for k in ("uids", "gids")}  # type: ignore[attr-defined]
    return AccessRule(str(r["pools"]), ids["uids"], ids["gids"])


def config_from_mapping(d: Mapping[str, object]) -> ServerConfig:
    known = {f.name for f in fields(ServerConfig)}
    kwargs: dict[str, object] = {}
    for key, value in d.items():
        key = _ALIASES.get(key, key)
        if key == "pool":
            kwargs["pools"] = tuple(pool_from_mapping(p) for p in value)  # type: ignore[attr-defined]
            continue
        if key == "tier":
            tiers = dict(value)  # type: ignore[call-overload]
            disk, mooncake = tiers.pop("disk", None), tiers.pop("mooncake", None)
            if tiers:
                raise SpecInvalid(f"unknown tiers {sorted(tiers)} (known: disk, mooncake)")
            kwargs["disk"] = DiskTierConfig.from_mapping(disk, parse_size) if disk else None
            kwargs["mooncake"] = (MooncakeTierConfig.from_mapping(mooncake, parse_size)
                                  if mooncake else None)
            continue
        if key == "budget":
            kwargs["budget"] = BudgetConfig.from_mapping(dict(value), parse_size)  # type: ignore[call-overload]
            continue
        if key == "kv_events":
            kwargs["kv_events"] = KvEventsConfig.from_mapping(dict(value), parse_size)  # type: ignore[call-overload]
            continue
        if key not in known:
            raise SpecInvalid(f"unknown setting {key!r}", metadata={"setting": key})
        if key in _SIZE_FIELDS:
            value = parse_size(value)
        elif key == "socket_mode" and isinstance(value, str):  # "0660" in TOML or env
            value = int(value, 8)
        elif key == "access":
            value = tuple(access_rule(r) for r in value)  # type: ignore[attr-defined]
        elif key in ("listen", "health_listen"):
            value = (value,) if isinstance(value, str) else tuple(value)  # type: ignore[arg-type]
        elif key == "cuda_copy_paths":  # a list, or comma-separated (flags, environment)
            items = [value] if isinstance(value, str) else list(value)  # type: ignore[call-overload]
            value = tuple(x.strip() for v in items for x in str(v).split(",") if x.strip())
        kwargs[key] = value
    return ServerConfig(**kwargs)  # type: ignore[arg-type]
