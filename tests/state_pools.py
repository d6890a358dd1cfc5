"""A small keyed pool kept in state files, and pages written with a recognisable pattern: what
the restart tests (and the child process they crash) open, store into and read back.

Primitives: ``PS``, ``SPEC``; ``open_pool(state, spec)`` (a ``HostPool`` + ``PoolCache`` over
the state directory, recovered when re-attached); ``page_bytes(pool, page)``;
``write_page(pool, page, tag)`` and ``pattern(pool, tag)`` (the bytes it writes);
``store(pool, cache, key, tag, finish)``.
"""

from __future__ import annotations

from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicached.cache import key_slots
from hicached.cache.pool_cache import PoolCache
from hicached.core.pool import HostPool, MemoryOptions
from hicached.core.state_file import Outcome

PS = 4
SPEC = PoolSpec("st", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 1, 8), PS,
                size_tokens=PS * 16)


def open_pool(state: str, spec: PoolSpec = SPEC) -> tuple[HostPool, PoolCache]:
    pages = spec.resolved_size_tokens() // spec.page_size
    pool = HostPool(spec, MemoryOptions(hugepages=False, reserve_bytes=0, state_dir=state),
                    extra_tables=[key_slots.table_spec(pages)])
    cache = PoolCache(pool)
    if pool.outcome is Outcome.REATTACHED:
        cache.recover()
    return pool, cache


def page_bytes(pool: HostPool, page: int) -> bytes:
    """Every byte of one page, all components and layers."""
    out = b""
    for c in pool.components:
        for layer in range(c.layer_num):
            start = c.offset + page * c.addressing.page_pitch + layer * c.addressing.layer_stride
            n = c.comp.units_per_page(PS) * c.addressing.unit_stride
            out += pool.raw_bytes()[start:start + n].tobytes()
    return out


def write_page(pool: HostPool, page: int, tag: int) -> None:
    for c in pool.components:
        for layer in range(c.layer_num):
            start = c.offset + page * c.addressing.page_pitch + layer * c.addressing.layer_stride
            n = c.comp.units_per_page(PS) * c.addressing.unit_stride
            pool.raw_bytes()[start:start + n] = (tag * 7 + layer) % 251


def pattern(pool: HostPool, tag: int) -> bytes:
    """The bytes ``write_page`` writes for ``tag``: what a restarted pool must hold."""
    out = b""
    for c in pool.components:
        n = c.comp.units_per_page(PS) * c.addressing.unit_stride
        for layer in range(c.layer_num):
            out += bytes([(tag * 7 + layer) % 251]) * n
    return out


def store(pool: HostPool, cache: PoolCache, key: bytes, tag: int, finish: bool = True
          ) -> int:
    t = cache.begin_store([key])
    page = int(t.pages[0])
    write_page(pool, page, tag)
    if finish:
        cache.finish_store(t, ok=True)
    return page
