"""The daemon's table of named pools, each with its cache, under one memory budget.

Primitives:

- ``PoolTable(budget_bytes, options, sessions_of, pinner)``: ``create_async(spec)``
  (idempotent: the same spec, or one of the same storage (``same_storage``), returns the
  existing pool or build, another spec is ``POOL_SPEC_CONFLICT``; a new pool builds in the
  background: ``pool_build``), ``builds()``, ``get`` (``POOL_NOT_READY`` while a pool builds
  or after its build failed), ``cache`` (the pool's ``PoolCache``), ``list``, ``delete``
  (refused with ``POOL_IN_USE`` while sessions are open), ``close_all``.
- ``charge(spec)``: what a pool costs the budget: its pages and, per page, its tables and key
  index. ``used_bytes``: the charges of all pools; a pool that would exceed the budget is
  ``HOST_MEMORY_INSUFFICIENT`` naming every number.
- With a ``MemoryBudget`` whose config is elastic (``[budget] elastic = true``), a pool is
  charged its floor and its tables, only its floor's memory is faulted in (and, on a host
  that page-locks pools for CUDA, locked), and it joins the budget once built
  (``memory_budget``): its share then grows and shrinks with its demand, its locked memory
  with it (``core.pin_units``: locked before pages are handed out, unlocked before it is
  given back).
- With a state directory (``options.state_dir``) pools live in files that outlive the daemon:
  a pool whose saved state matches is re-attached and its cache recovered
  (``PoolCache.recover``) while it builds; ``recover_saved(declared)`` starts that for every
  saved pool the config does not declare; ``delete`` removes the files, ``close_all`` keeps
  them. ``on_attach(pool, recovered)`` reports how each pool was found, ``on_drop(name,
  outcome)`` a saved pool that could not be re-attached (its files are removed).
- ``PoolListener``: told when a pool's tiers serve (``attached(name, stack)``) and when a
  pool is deleted, before its tiers close (``deleting(name, stack)``): the KV event
  publisher. Every pool's event log keeps ``chain_bytes`` of its keys' chains.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from typing import Protocol

from hicache.errors import (
    HiCacheError,
    HostMemoryInsufficient,
    PoolInUse,
    PoolNotFound,
    PoolSpecConflict,
)
from hicache.locks import lock
from hicache.paths import remove_state
from hicache.specs import PoolSpec, same_storage
from hicached.cache import key_slots
from hicached.cache.chains import ChainTable
from hicached.cache.events import EventLog
from hicached.cache.holds import HoldPolicy
from hicached.cache.index_types import KEY_INDEX_BYTES
from hicached.cache.pool_cache import PoolCache
from hicached.core.memory import Pinner
from hicached.core.pool import HostPool, MemoryOptions
from hicached.core.state_file import Outcome, saved_specs
from hicached.service.memory_budget import MemoryBudget
from hicached.service.pool_build import PoolBuild
from hicached.tiers.config import DiskTierConfig
from hicached.tiers.mooncake import MooncakeStore
from hicached.tiers.stack import TierStack, build_stack

log = logging.getLogger(__name__)


class PoolListener(Protocol):
    def attached(self, name: str, stack: TierStack) -> None: ...

    def deleting(self, name: str, stack: TierStack) -> None: ...


def charge(spec: PoolSpec) -> int:
    """Budget bytes of a pool: page memory plus its tables and key index."""
    pages = spec.resolved_size_tokens() // spec.page_size
    return pages * (spec.page_bytes + HostPool.metadata_bytes_per_page(spec) + KEY_INDEX_BYTES)


class PoolTable:
    def __init__(self, budget_bytes: int, options: MemoryOptions,
                 sessions_of: Callable[[str], int] = lambda name: 0,
                 pinner: Pinner | None = None,
                 on_attach: Callable[[HostPool, dict[str, int]], None] = lambda p, r: None,
                 on_drop: Callable[[str, str], None] = lambda name, outcome: None,
                 on_delete: Callable[[str], None] = lambda name: None,
                 disk: DiskTierConfig | None = None,
                 observe_disk: Callable[[str, float], None] = lambda op, s: None,
                 cluster_store: MooncakeStore | None = None,
                 hold_policy: HoldPolicy | None = None, chain_bytes: int = 0,
                 eviction: str = "lru", listener: PoolListener | None = None,
                 budget: MemoryBudget | None = None) -> None:
        """``pinner`` page-locks every pool it creates (the CUDA driver's, on GPU hosts);
        ``hold_policy``: the limits on every pool's holds; ``eviction``: every pool's
        eviction policy (``PoolCache``'s);
        ``disk`` gives every pool a disk tier below it (its share of the capacity),
        ``cluster_store`` a part of the cluster store; ``on_delete(name)``: a pool was
        deleted (what others keep per pool name goes)."""
        self.budget_bytes = budget_bytes
        self.options = options
        self.pinner = pinner
        self._on_attach = on_attach
        self._on_drop = on_drop
        self._on_delete = on_delete
        self.disk = disk
        self._observe_disk = observe_disk
        self.cluster_store = cluster_store
        self.hold_policy = hold_policy or HoldPolicy()
        self.chain_bytes = chain_bytes
        self.eviction = eviction
        self.listener = listener
        self.budget = budget if budget is not None and budget.config.elastic else None
        """The shared budget pools join (None: every pool keeps its size). Page-locked
        pools are locked by units that follow their shares (``core.pin_units``)."""
        self._stacks: dict[str, TierStack] = {}
        """Every pool's tiers (its pool and cache with them), from when its build opened
        them."""
        self._ready: dict[str, TierStack] = {}
        """The pools that serve: built, not deleted."""
        self._sessions_of = sessions_of
        self._builds: dict[str, PoolBuild] = {}
        self._closed = False
        self._lock = lock("pool_table")
        self._creating = lock("pool_table.creating")

    def _open(self, spec: PoolSpec, on_progress: Callable[[int], None]) -> HostPool:
        """Build (or re-attach) the pool, its cache (recovering saved keys) and tiers."""
        pages = spec.resolved_size_tokens() // spec.page_size
        resident = self.budget.bounds(spec)[0] if self.budget is not None else None
        pool = HostPool(spec, self.options, pinner=self.pinner, on_progress=on_progress,
                        extra_tables=[key_slots.table_spec(pages)], resident_pages=resident)
        try:
            cache = self._new_cache(pool)
            recovered = cache.recover() if pool.outcome is Outcome.REATTACHED else {}
        except BaseException:
            pool.close(0)
            raise
        try:
            stack = build_stack(pool, cache, self.disk, self.budget_bytes, self._observe_disk,
                                self.cluster_store)
            stack.start()
        except BaseException:
            pool.close(0)
            raise
        with self._lock:
            self._stacks[spec.name] = stack
        attached = joined = False
        try:
            if self.listener is not None:
                self.listener.attached(spec.name, stack)
                attached = True
            if recovered:
                log.info("pool %s re-attached (generation %d): %d keys, %d raw pages kept, "
                         "%d damaged slots dropped", spec.name,
                         pool.state.generation if pool.state else 0, recovered["keys"],
                         recovered["raw_pages"], recovered["damaged"])
            self._on_attach(pool, recovered)
            if self.budget is not None:
                self.budget.join(cache.sizing, _tables(spec))
                joined = True
        except BaseException:  # a build that fails here leaves nothing behind either
            if joined and self.budget is not None:
                self.budget.leave(spec.name)
            if attached and self.listener is not None:
                self.listener.deleting(spec.name, stack)
            self._close_tiers(spec.name)
            pool.close(0)
            raise
        return pool

    def _new_cache(self, pool: HostPool) -> PoolCache:
        chains = ChainTable(self.chain_bytes, pool.page_size)
        return PoolCache(pool, EventLog(chains=chains), policy=self.hold_policy,
                         eviction=self.eviction)

    def _close_tiers(self, name: str, remove: bool = False) -> None:
        with self._lock:
            stack = self._stacks.pop(name, None)
        if stack is not None:
            stack.close(remove_files=remove)

    def stack(self, name: str) -> TierStack:
        """The pool's tiers, for keyed calls (``POOL_NOT_FOUND`` / ``POOL_NOT_READY``)."""
        with self._lock:
            got, build = self._ready.get(name), self._builds.get(name)
        if got is None:
            raise self._missing(name, build)
        return got

    def stacks(self) -> list[tuple[str, TierStack]]:
        with self._lock:
            return list(self._ready.items())

    def recover_saved(self, declared: Collection[str] = ()) -> list[PoolBuild]:
        """Re-attach, in the background, every pool the state directory holds that is not in
        ``declared`` (those are created from the config and re-attach by themselves). Unusable
        state is removed with a log line; a pool the budget cannot hold is dropped too."""
        builds: list[PoolBuild] = []
        if not self.options.state_dir:
            return builds
        for name, (spec, why) in saved_specs(self.options.state_dir).items():
            if name in declared:
                continue
            if spec is None:
                log.warning("saved state of pool %s is unusable (%s): removed", name, why)
                remove_state(self.options.state_dir, name)
                self._on_drop(name, Outcome.COLD_VERSION.value if why.startswith("version")
                              else Outcome.COLD_UNTRUSTED.value if why.startswith("untrusted")
                              else Outcome.COLD_CORRUPT.value)
                continue
            try:
                build, _ = self.create_async(spec)
            except HiCacheError as exc:
                log.warning("saved pool %s not re-attached (%s): its state is removed",
                            name, exc)
                remove_state(self.options.state_dir, name)
                self._on_drop(name, "dropped_" + exc.reason.lower())
                continue
            if isinstance(build, PoolBuild):
                builds.append(build)
        return builds

    def create_async(self, spec: PoolSpec) -> tuple[HostPool | PoolBuild, bool]:
        """The pool for ``spec`` and whether it was created now: a new pool builds in the
        background, its ``PoolBuild`` returned at once (the budget is reserved now). A failed
        build of the same spec is started again."""
        with self._creating:  # one at a time keeps the budget check honest
            existing = self._existing(spec)
            if existing is not None and not (isinstance(existing, PoolBuild)
                                             and existing.error is not None):
                return existing, False
            with self._lock:
                self._builds.pop(spec.name, None)
            self._check_budget(spec)
            build = PoolBuild(spec, spec.resolved_size_tokens() // spec.page_size
                              * spec.page_bytes, lambda progress: self._open(spec, progress))
            with self._lock:
                self._builds[spec.name] = build
            build.start(self._built)
            return build, True

    def _built(self, build: PoolBuild, pool: HostPool | None) -> None:
        name = build.spec.name
        with self._lock:
            current = pool is not None and not self._closed and self._builds.get(name) is build
            stack = self._stacks.get(name) if current else None
            if stack is not None:
                self._ready[name] = stack
                del self._builds[name]
        if pool is not None and stack is None:
            self._close_tiers(name)
            pool.close()  # the table closed (or the build was dropped) meanwhile

    def _existing(self, spec: PoolSpec) -> HostPool | PoolBuild | None:
        """The pool or build of that name, refusing another spec."""
        with self._lock:
            ready = self._ready.get(spec.name)
            existing = ready.pool if ready is not None else self._builds.get(spec.name)
        if existing is not None and not same_storage(existing.spec, spec):
            raise PoolSpecConflict(
                f"pool {spec.name} exists with a different spec ({_summary(existing.spec)}; "
                f"asked: {_summary(spec)}): use that spec, another name, or DeletePool first",
                metadata={"pool": spec.name, "existing": _summary(existing.spec),
                          "requested": _summary(spec)},
            )
        return existing

    def _check_budget(self, spec: PoolSpec) -> None:
        if self.budget is not None:  # the floors fit, with the floors of the builds under way
            self.budget.admit(spec, _tables(spec), self._building_floors())
            return
        need = charge(spec)
        used = self.used_bytes
        if used + need > self.budget_bytes:
            raise HostMemoryInsufficient(
                f"pool {spec.name} needs {need} bytes (pages and their index); the daemon "
                f"budget of {self.budget_bytes} bytes has {self.budget_bytes - used} left",
                metadata={"requested_bytes": need, "budget_bytes": self.budget_bytes,
                          "used_bytes": used, "pool": spec.name},
            )

    def get(self, name: str) -> HostPool:
        return self.stack(name).pool

    def cache(self, name: str) -> PoolCache:
        return self.stack(name).cache

    @staticmethod
    def _missing(name: str, build: PoolBuild | None) -> Exception:
        if build is not None:
            return build.not_ready()
        return PoolNotFound(f"no pool named {name!r}", metadata={"pool": name})

    def build(self, name: str) -> PoolBuild | None:
        """The background build of ``name``, while it runs or after it failed."""
        with self._lock:
            return self._builds.get(name)

    def builds(self) -> list[PoolBuild]:
        with self._lock:
            return list(self._builds.values())

    def entries(self) -> list[tuple[HostPool, PoolCache]]:
        """Every pool with its cache."""
        with self._lock:
            return [(s.pool, s.cache) for s in self._ready.values()]

    def list(self) -> list[HostPool]:
        with self._lock:
            return [s.pool for s in self._ready.values()]

    def max_page_tokens(self) -> int:
        """The largest ``page_size`` of the pools now (0 without pools)."""
        with self._lock:
            return max((s.pool.spec.page_size for s in self._ready.values()), default=0)

    def delete(self, name: str, wait_seconds: float = 10.0) -> None:
        """Remove the pool and free its memory once copies still running on it (of sessions
        closed under them) have ended; the memory is never unmapped under a copy."""
        with self._creating:
            with self._lock:
                build = self._builds.get(name)
                if build is not None and build.error is not None:
                    del self._builds[name]  # a failed build holds nothing: just forget it
                    return
            pool = self.get(name)
            open_sessions = self._sessions_of(name)
            if open_sessions:
                raise PoolInUse(f"pool {name} has {open_sessions} open session(s)",
                                metadata={"pool": name, "sessions": open_sessions})
            with self._lock:
                stack = self._ready.pop(name, None)
            if self.budget is not None:
                self.budget.leave(name)
        if self.listener is not None and stack is not None:
            self.listener.deleting(name, stack)
        self._close_tiers(name, remove=True)
        pool.close(wait_seconds, remove_state=True)
        self._on_delete(name)

    @property
    def used_bytes(self) -> int:
        """Charges of the pools and of the builds under way (reserved when they start); with
        an elastic budget, the pools' shares and tables, and the builds' floors."""
        if self.budget is not None:
            return self.budget.used_bytes + self._building_floors()
        with self._lock:
            return sum(charge(s.pool.spec) for s in self._ready.values()) + sum(
                charge(b.spec) for b in self._builds.values() if b.error is None)

    def _building_floors(self) -> int:
        """What the builds under way are charged under an elastic budget: floors and tables."""
        assert self.budget is not None
        with self._lock:
            specs = [b.spec for b in self._builds.values()
                     if b.error is None and b.spec.name not in self._ready]
        return sum(self.budget.bounds(s)[0] * s.page_bytes + _tables(s) for s in specs)

    def close_all(self, wait_seconds: float = 10.0) -> None:
        """Close every pool, waiting at most ``wait_seconds`` in all for copies in flight."""
        with self._lock:
            self._closed = True  # builds that finish from now on are closed at once
            pools = [s.pool for s in self._ready.values()]
            self._ready = {}
        for p in pools:
            self._close_tiers(p.spec.name)  # spillers hand their pages back first
        deadline = time.monotonic() + wait_seconds
        for p in pools:
            p.close(max(deadline - time.monotonic(), 0.0))


def _tables(spec: PoolSpec) -> int:
    """Budget bytes of a pool's tables and key index (charged whatever its share)."""
    pages = spec.resolved_size_tokens() // spec.page_size
    return pages * (HostPool.metadata_bytes_per_page(spec) + KEY_INDEX_BYTES)


def _summary(spec: PoolSpec) -> str:
    g = spec.geometry
    return (f"{g.kind.value}/{g.dtype.value}/{spec.layout.value}/page={spec.page_size}/"
            f"layers={g.layer_num}/" + (f"tokens={spec.size_tokens}" if spec.size_tokens
                                          else f"bytes={spec.size_bytes}"))
