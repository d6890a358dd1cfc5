"""Keyed pages with known bytes, for tests of a pool cache on its own (no server, no copy
engine): a key's page holds bytes that are a function of the key alone, written by ``store``
as the daemon's copy would between ``begin_store`` and ``finish_store``."""

from __future__ import annotations

import numpy as np

from hicached.cache.pool_cache import PoolCache
from hicached.core.pool import HostPool


def pattern(key: bytes, n: int) -> np.ndarray:
    """The bytes a key's page holds in these tests: a function of the key alone."""
    seed = int.from_bytes(key[-3:].ljust(3, b"\0"), "little") + 1
    return np.random.default_rng(seed).integers(1, 256, n, dtype=np.uint8)


def write(pool: HostPool, page: int, data: np.ndarray) -> None:
    at = 0
    for view in pool.page_views(page):
        n = len(view)
        np.frombuffer(view, dtype=np.uint8)[:] = data[at:at + n]
        at += n


def read(pool: HostPool, page: int) -> np.ndarray:
    return np.concatenate([np.frombuffer(v, dtype=np.uint8) for v in pool.page_views(page)])


def store(cache: PoolCache, keys: list[bytes]) -> None:
    """A Store as the daemon runs it: pages taken, their bytes written, the keys ready."""
    ticket = cache.begin_store(keys)
    for i, page in zip(ticket.positions.tolist(), ticket.pages.tolist(), strict=True):
        write(cache.pool, page, pattern(ticket.keys[i], cache.pool.spec.page_bytes))
    cache.finish_store(ticket, True)
