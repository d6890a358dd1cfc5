"""``[budget]``: one memory budget shared by the pools, by their demand.

Without it (``elastic = false``, the default) every pool keeps the size its spec gives it, and
the budget only refuses a pool that would not fit. With it, a pool is charged its floor when
it is made, holds a share of the budget that grows while it is busy (its Stores evict) and
shrinks when it is idle or another needs the memory more (its least recently used page is
older than the other's), never below its floor nor above its ceiling; pools belong to
tenants, whose byte quotas cap what their pools hold together and whose guaranteed share no
other tenant can take (``service.memory_budget``).

Primitives: ``BudgetConfig`` (``from_mapping``), ``PoolShare`` (a ``[[budget.pools]]`` rule),
``TenantQuota`` (a ``[[budget.tenants]]`` entry); ``share_for(config, name)``.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

from hicache.errors import SpecInvalid
from hicached.tiers.config import table_settings


@dataclass(frozen=True)
class PoolShare:
    """The bounds of the pools whose names match ``pools``."""

    pools: str
    """A glob over pool names; the first rule that matches a pool is its own."""
    floor_bytes: int = 0
    """Page memory the pool always keeps (charged when it is made): no other pool takes it."""
    ceiling_bytes: int = 0
    """The most page memory it may hold (0: its spec's size, which also bounds it)."""
    tenant: str = ""
    """Who the pool belongs to ("" : the default tenant)."""

    def __post_init__(self) -> None:
        if not self.pools:
            raise SpecInvalid("a [[budget.pools]] rule names its pools (a glob)")
        if self.floor_bytes < 0 or self.ceiling_bytes < 0:
            raise SpecInvalid("floor_bytes and ceiling_bytes are >= 0",
                              metadata={"pools": self.pools})
        if self.ceiling_bytes and self.floor_bytes > self.ceiling_bytes:
            raise SpecInvalid(f"pools {self.pools}: floor_bytes {self.floor_bytes} is above "
                              f"ceiling_bytes {self.ceiling_bytes}",
                              metadata={"pools": self.pools, "field": "floor_bytes"})


@dataclass(frozen=True)
class TenantQuota:
    """What one tenant's pools may hold together."""

    name: str
    quota_bytes: int = 0
    """The most page memory its pools hold together (0: no quota but the budget). A pool of
    a tenant at its quota evicts its own pages rather than grow."""
    guaranteed_bytes: int = -1
    """What no other tenant can take from it under pressure (-1: its fair share, the budget's
    page memory (what the pools' tables leave of it) split evenly over the tenants with pools,
    capped by its quota)."""

    def __post_init__(self) -> None:
        if self.quota_bytes < 0 or self.guaranteed_bytes < -1:
            raise SpecInvalid(f"tenant {self.name!r}: quota_bytes >= 0, guaranteed_bytes >= 0 "
                              "(or -1: the fair share)", metadata={"tenant": self.name})
        if self.quota_bytes and self.guaranteed_bytes > self.quota_bytes:
            raise SpecInvalid(f"tenant {self.name!r}: guaranteed_bytes is above quota_bytes",
                              metadata={"tenant": self.name, "field": "guaranteed_bytes"})


@dataclass(frozen=True)
class BudgetConfig:
    elastic: bool = False
    """Pools share the budget by demand (see the module's docstring); False: each keeps its
    spec's size."""
    interval_seconds: float = 1.0
    """How often shares are rebalanced between pools."""
    grow_step_bytes: int = 64 << 20
    """A busy pool's share grows by at least this much at a time (fewer, larger steps)."""
    step_fraction: float = 0.05
    """The most of the budget one rebalance moves from one pool to another."""
    pools: tuple[PoolShare, ...] = ()
    """``[[budget.pools]]``: floors, ceilings and tenants by pool name."""
    tenants: tuple[TenantQuota, ...] = ()
    """``[[budget.tenants]]``: quotas and guaranteed shares."""
    pin_unit_bytes: int = 2 << 20
    """On a host that page-locks pools for CUDA, a pool's locked memory follows its share in
    units of about this many bytes or more (at most 4,096 a pool): smaller units lock and give
    back closer to the share, larger ones make fewer driver registrations."""

    def __post_init__(self) -> None:
        if not (0 < self.interval_seconds < math.inf):
            raise SpecInvalid("budget interval_seconds is a positive number of seconds",
                              metadata={"field": "interval_seconds"})
        if self.pin_unit_bytes < 4096:
            raise SpecInvalid("budget pin_unit_bytes is at least 4096 (an OS page)",
                              metadata={"field": "pin_unit_bytes"})
        if self.grow_step_bytes < 0 or not (0 < self.step_fraction <= 1):
            raise SpecInvalid("budget grow_step_bytes >= 0 and 0 < step_fraction <= 1",
                              metadata={"field": "step_fraction"})
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise SpecInvalid("a tenant is listed twice in [[budget.tenants]]",
                              metadata={"field": "tenants"})

    def tenant(self, name: str) -> TenantQuota:
        for t in self.tenants:
            if t.name == name:
                return t
        return TenantQuota(name)

    @classmethod
    def from_mapping(cls, d: Mapping[str, object],
                     parse_size: Callable[[object], int]) -> BudgetConfig:
        """The ``[budget]`` table as TOML gives it (sizes as numbers or "2GiB")."""
        def table(kind: type, entries: object, sizes: tuple[str, ...]) -> tuple[object, ...]:
            own = {f.name for f in fields(kind)}
            out = []
            for e in entries if isinstance(entries, list) else []:
                if not isinstance(e, Mapping) or set(e) - own:
                    raise SpecInvalid(f"a [[budget.{'pools' if kind is PoolShare else 'tenants'}]]"
                                      f" entry has only {sorted(own)}",
                                      metadata={"field": kind.__name__})
                out.append(kind(**{k: (parse_size(v) if k in sizes and v != -1 else v)
                                   for k, v in e.items()}))
            return tuple(out)

        try:
            kwargs = table_settings(cls, d, parse_size, "budget", {})
            kwargs["pools"] = table(PoolShare, kwargs.get("pools", []),
                                    ("floor_bytes", "ceiling_bytes"))
            kwargs["tenants"] = table(TenantQuota, kwargs.get("tenants", []),
                                      ("quota_bytes", "guaranteed_bytes"))
            return cls(**kwargs)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise SpecInvalid(f"budget settings have the wrong type: {exc}",
                              metadata={"field": "budget"}) from None


def share_for(config: BudgetConfig, name: str) -> PoolShare:
    """The rule of pool ``name`` (the first that matches; none: no floor, no ceiling but its
    size, the default tenant)."""
    for rule in config.pools:
        if fnmatch.fnmatchcase(name, rule.pools):
            return rule
    return PoolShare("*")
