"""The daemon's table of named pools, each with its cache, under one memory budget.

Primitives:

- ``PoolTable(budget_bytes, options, sessions_of, pinner)``: ``create(spec)`` (idempotent:
  the same spec returns the existing pool, another spec is ``POOL_SPEC_CONFLICT``), ``get``,
  ``cache`` (the pool's ``PoolCache``), ``list``, ``delete`` (refused with ``POOL_IN_USE``
  while sessions are open), ``close_all``.
- ``charge(spec)``: what a pool costs the budget: its pages and, per page, its tables and key
  index. ``used_bytes``: the charges of all pools; a pool that would exceed the budget is
  ``HOST_MEMORY_INSUFFICIENT`` naming every number.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from hicache.errors import HostMemoryInsufficient, PoolInUse, PoolNotFound, PoolSpecConflict
from hicache.specs import PoolSpec
from hicached.cache.pool_cache import KEY_INDEX_BYTES, PoolCache
from hicached.core.memory import Pinner
from hicached.core.pool import HostPool, MemoryOptions


def charge(spec: PoolSpec) -> int:
    """Budget bytes of a pool: page memory plus its tables and key index."""
    pages = spec.resolved_size_tokens() // spec.page_size
    return pages * (spec.page_bytes + HostPool.metadata_bytes_per_page(spec) + KEY_INDEX_BYTES)


class PoolTable:
    def __init__(self, budget_bytes: int, options: MemoryOptions,
                 sessions_of: Callable[[str], int] = lambda name: 0,
                 pinner: Pinner | None = None) -> None:
        """``pinner`` page-locks every pool it creates (the CUDA driver's, on GPU hosts)."""
        self.budget_bytes = budget_bytes
        self.options = options
        self.pinner = pinner
        self._sessions_of = sessions_of
        self._pools: dict[str, HostPool] = {}
        self._caches: dict[str, PoolCache] = {}
        self._lock = threading.Lock()
        self._creating = threading.Lock()

    def create(self, spec: PoolSpec) -> tuple[HostPool, bool]:
        """The pool for ``spec`` and whether it was created now."""
        with self._creating:  # one allocation at a time keeps the budget check honest
            with self._lock:
                existing = self._pools.get(spec.name)
            if existing is not None:
                if existing.spec != spec:
                    raise PoolSpecConflict(
                        f"pool {spec.name} exists with a different spec",
                        metadata={"pool": spec.name, "existing": _summary(existing.spec),
                                  "requested": _summary(spec)},
                    )
                return existing, False
            need = charge(spec)
            used = self.used_bytes
            if used + need > self.budget_bytes:
                raise HostMemoryInsufficient(
                    f"pool {spec.name} needs {need} bytes (pages and their index); the daemon "
                    f"budget of {self.budget_bytes} bytes has {self.budget_bytes - used} left",
                    metadata={"requested_bytes": need, "budget_bytes": self.budget_bytes,
                              "used_bytes": used, "pool": spec.name},
                )
            pool = HostPool(spec, self.options, pinner=self.pinner)
            with self._lock:
                self._pools[spec.name] = pool
                self._caches[spec.name] = PoolCache(pool)
            return pool, True

    def get(self, name: str) -> HostPool:
        with self._lock:
            pool = self._pools.get(name)
        if pool is None:
            raise PoolNotFound(f"no pool named {name!r}", metadata={"pool": name})
        return pool

    def cache(self, name: str) -> PoolCache:
        with self._lock:
            cache = self._caches.get(name)
        if cache is None:
            raise PoolNotFound(f"no pool named {name!r}", metadata={"pool": name})
        return cache

    def entries(self) -> list[tuple[HostPool, PoolCache]]:
        """Every pool with its cache."""
        with self._lock:
            return [(p, self._caches[n]) for n, p in self._pools.items()]

    def list(self) -> list[HostPool]:
        with self._lock:
            return list(self._pools.values())

    def delete(self, name: str, wait_seconds: float = 10.0) -> None:
        """Remove the pool and free its memory once copies still running on it (of sessions
        closed under them) have ended; the memory is never unmapped under a copy."""
        with self._creating:
            pool = self.get(name)
            open_sessions = self._sessions_of(name)
            if open_sessions:
                raise PoolInUse(f"pool {name} has {open_sessions} open session(s)",
                                metadata={"pool": name, "sessions": open_sessions})
            with self._lock:
                self._pools.pop(name, None)
                self._caches.pop(name, None)
        pool.close(wait_seconds)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(charge(p.spec) for p in self._pools.values())

    def close_all(self, wait_seconds: float = 10.0) -> None:
        """Close every pool, waiting at most ``wait_seconds`` in all for copies in flight."""
        with self._lock:
            pools, self._pools, self._caches = list(self._pools.values()), {}, {}
        deadline = time.monotonic() + wait_seconds
        for p in pools:
            p.close(max(deadline - time.monotonic(), 0.0))


def _summary(spec: PoolSpec) -> str:
    g = spec.geometry
    return (f"{g.kind.value}/{g.dtype.value}/{spec.layout.value}/page={spec.page_size}/"
            f"layers={g.layer_num}/tokens={spec.size_tokens or spec.size_bytes}")
