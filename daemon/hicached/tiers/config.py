"""``[tier.disk]``: the disk tier's settings, typed and validated.

Primitives: ``DiskTierConfig`` (frozen; ``from_mapping`` reads the TOML table, sizes as
``"100GiB"`` or bytes), ``share(pool_bytes, budget_bytes, page_bytes)``: the pages one pool
may keep on disk; ``table_settings``: any tier's table as keyword arguments.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

from hicache.errors import SpecInvalid

FSYNC_POLICIES = ("batch", "never")


@dataclass(frozen=True)
class DiskTierConfig:
    path: str
    """Directory of the page and index files (one pair per pool); created if missing."""
    capacity_bytes: int
    """Disk bytes all pools together may use; each pool gets the share of it its host pool
    has of the memory budget, enforced by LRU."""
    o_direct: bool = False
    """Bypass the page cache (O_DIRECT, through aligned bounce buffers)."""
    fsync: str = "batch"
    """``batch``: a page is on the device before its index record is written (a power loss
    cannot leave a record naming unwritten bytes); ``never``: the page cache decides (a
    process crash is still safe; checksums catch what a power loss tears)."""
    io_threads: int = 2
    """Pages a pool moves to or from disk at once (a spill batch, a LoadKeys promotion)."""
    preallocate: bool = True
    """Reserve the files' blocks when the tier opens (``posix_fallocate``): a filesystem
    without the space refuses the tier at start (the pool serves without it, logged, and
    ``hicache_tier_failing`` says so) instead of failing spills later. False: sparse files
    (a full disk then fails spills, backed off)."""
    spill_ahead_bytes: int = 1 << 30
    """How much of each pool's least recently used keys is kept written ahead of eviction: the
    bound of the spill queue. Evicting a key not yet written drops it (counted)."""

    def __post_init__(self) -> None:
        if not os.path.isabs(self.path):
            raise SpecInvalid("tier.disk.path must be an absolute directory",
                              metadata={"path": self.path})
        if self.capacity_bytes <= 0 or self.spill_ahead_bytes <= 0:
            raise SpecInvalid("tier.disk.capacity and spill_ahead must be positive",
                              metadata={"capacity_bytes": self.capacity_bytes})
        if self.io_threads < 1:
            raise SpecInvalid("tier.disk.io_threads must be >= 1")
        if self.fsync not in FSYNC_POLICIES:
            raise SpecInvalid(f"tier.disk.fsync is one of {FSYNC_POLICIES}",
                              metadata={"fsync": self.fsync})

    @classmethod
    def from_mapping(cls, d: Mapping[str, object], parse_size: Callable[[object], int]
                     ) -> DiskTierConfig:
        kwargs = table_settings(cls, d, parse_size, "tier.disk",
                                {"capacity": "capacity_bytes",
                                 "spill_ahead": "spill_ahead_bytes"})
        if "path" not in kwargs or "capacity_bytes" not in kwargs:
            raise SpecInvalid("[tier.disk] needs path and capacity")
        return cls(**kwargs)  # type: ignore[arg-type]

    def share(self, pool_bytes: int, budget_bytes: int, page_bytes: int) -> int:
        """Pages one pool may keep on disk: its share of the budget, of the capacity."""
        if page_bytes <= 0 or budget_bytes <= 0:
            return 0
        return int(self.capacity_bytes * min(pool_bytes / budget_bytes, 1.0)) // page_bytes


def table_settings(cls: type, d: Mapping[str, object], parse_size: Callable[[object], int],
                   table: str, aliases: Mapping[str, str]) -> dict[str, object]:
    """A TOML table (a tier's, ``[budget]``) as keyword arguments of its config class: names
    through ``aliases``, ``*_bytes`` as sizes (``"4GiB"``), ``*_seconds`` as floats; an
    unknown name is ``SPEC_INVALID``."""
    known = {f.name for f in fields(cls)}
    kwargs: dict[str, object] = {}
    for key, value in d.items():
        key = aliases.get(key, key)
        if key not in known:
            raise SpecInvalid(f"unknown {table} setting {key!r}", metadata={"setting": key})
        if key.endswith("_bytes"):
            value = parse_size(value)
        elif key.endswith("_seconds"):
            value = float(value)  # type: ignore[arg-type]
        kwargs[key] = value
    return kwargs
