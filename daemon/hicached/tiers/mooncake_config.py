"""``[tier.mooncake]``: the cluster tier's settings, typed and validated.

Primitives: ``MooncakeTierConfig`` (frozen; ``from_mapping`` reads the TOML table, sizes as
``"4GiB"`` or bytes, durations in seconds), ``WRITE_POLICIES``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hicache.errors import SpecInvalid
from hicached.tiers.config import table_settings

WRITE_POLICIES = ("through", "evict")
PROTOCOLS = ("tcp", "rdma")


@dataclass(frozen=True)
class MooncakeTierConfig:
    master: str
    """The Mooncake master's RPC address, ``host:port``."""
    local_hostname: str
    """The address other nodes reach this daemon's transfer engine at (``host`` or
    ``host:port``): this node's IP on the cluster network, never a loopback address in a
    real cluster."""
    metadata_server: str = "P2PHANDSHAKE"
    """Transfer-engine metadata: ``P2PHANDSHAKE`` (no etcd), ``etcd://host:port`` or
    ``http://host:port/metadata``."""
    protocol: str = "tcp"
    """``tcp`` or ``rdma`` (where the node has RDMA devices: ``rdma_devices``)."""
    rdma_devices: str = ""
    """Comma-separated RDMA device names for ``protocol = "rdma"``."""
    segment_bytes: int = 0
    """Host memory this daemon lends to the cluster store (Mooncake's global segment),
    outside the pools' budget. 0: it only uses the segments of other nodes or of a store
    service. A node's segment goes away with its daemon: ``replicas`` >= 2 keeps keys through
    one daemon's restart."""
    local_buffer_bytes: int = 16 << 20
    """Mooncake's own transfer buffer for unregistered memory (pool memory is registered,
    so pages never pass through it)."""
    key_prefix: str = "hicache"
    """First part of every key in the store: ``<prefix>/<pool namespace>/<key hex>``; lets
    several clusters or deployments share one master."""
    write_policy: str = "through"
    """``through``: every stored key is put shortly after its Store (asynchronously; Store
    never waits on the network). ``evict``: keys are put ahead of their eviction from host
    memory, the oldest first (as the disk tier is filled)."""
    replicas: int = 1
    """Copies the store keeps of each key, on different segments."""
    timeout_seconds: float = 0.15
    """How long a call to the store may take before the tier is marked down and served
    without: a Lookup waits at most this long (keep it under the engines'
    ``lookup_timeout_s``, 0.2 s, or a stalled master makes the worker's link late with it);
    a get or put waits this plus its bytes at ``floor_bytes_per_second``."""
    floor_bytes_per_second: int = 100_000_000
    """The slowest the store may move pages before a get or put counts as stalled."""
    retry_seconds: float = 2.0
    """How often a down tier is probed in the background until it answers again."""
    queue_bytes: int = 1 << 30
    """Per pool, the most page bytes waiting to be put (held against reuse). Keys beyond it
    are not put (counted as dropped); Store never blocks on the tier."""
    batch_pages: int = 64
    """Pages per put call."""
    put_retry_seconds: float = 30.0
    """How long a key the store did not take (write policy ``through``) is tried again, backed
    off, before it is dropped: keep it above Mooncake's ``client_ttl`` (10 s by default: a
    dead node's segment is still placed on until then)."""

    def __post_init__(self) -> None:
        for name in ("master", "local_hostname"):
            if not getattr(self, name):
                raise SpecInvalid(f"tier.mooncake.{name} is required",
                                  metadata={"setting": name})
        if ":" not in self.master:
            raise SpecInvalid("tier.mooncake.master is host:port",
                              metadata={"master": self.master})
        if self.protocol not in PROTOCOLS:
            raise SpecInvalid(f"tier.mooncake.protocol is one of {PROTOCOLS}",
                              metadata={"protocol": self.protocol})
        if self.write_policy not in WRITE_POLICIES:
            raise SpecInvalid(f"tier.mooncake.write_policy is one of {WRITE_POLICIES}",
                              metadata={"write_policy": self.write_policy})
        if not self.key_prefix or "/" in self.key_prefix:
            raise SpecInvalid("tier.mooncake.key_prefix is a non-empty name without '/'",
                              metadata={"key_prefix": self.key_prefix})
        if self.segment_bytes < 0 or self.local_buffer_bytes <= 0 or self.queue_bytes <= 0:
            raise SpecInvalid("tier.mooncake sizes must be positive (segment may be 0)",
                              metadata={"segment_bytes": self.segment_bytes})
        if self.replicas < 1 or self.batch_pages < 1:
            raise SpecInvalid("tier.mooncake.replicas and batch_pages must be >= 1",
                              metadata={"replicas": self.replicas})
        if self.floor_bytes_per_second <= 0:
            raise SpecInvalid("tier.mooncake.floor_bytes_per_second must be positive")
        if not 0 <= self.put_retry_seconds <= 3600:
            raise SpecInvalid("tier.mooncake.put_retry_seconds is in [0, 3600]",
                              metadata={"put_retry_seconds": self.put_retry_seconds})
        if not (0 < self.timeout_seconds <= 60 and 0 < self.retry_seconds <= 600):
            raise SpecInvalid("tier.mooncake.timeout_seconds is in (0, 60], retry_seconds "
                              "in (0, 600]", metadata={"timeout_seconds": self.timeout_seconds})

    @classmethod
    def from_mapping(cls, d: Mapping[str, object], parse_size: Callable[[object], int]
                     ) -> MooncakeTierConfig:
        kwargs = table_settings(cls, d, parse_size, "tier.mooncake", {
            "segment_size": "segment_bytes", "local_buffer_size": "local_buffer_bytes",
            "queue_size": "queue_bytes", "master_server_addr": "master"})
        if "master" not in kwargs or "local_hostname" not in kwargs:
            raise SpecInvalid("[tier.mooncake] needs master and local_hostname")
        return cls(**kwargs)  # type: ignore[arg-type]
