"""A removed key stays removed: RemoveKeys and ClearPool racing a spill to disk or a promotion
from it, deterministically (the writer stopped at a seam between its steps while the removal
runs to its end), in-process over the real spiller thread, disk tier and cache; then once more
after a restart of the disk tier (its index rebuilt from its files).

The stress version with real processes is tests/reliability/test_removals.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hicache import seams
from hicached.cache.pool_cache import PoolCache
from hicached.core.pool import HostPool
from hicached.tiers.disk import DiskTier
from hicached.tiers.stack import TierStack
from tests.helpers import make_pool, mha, spec

PS = 4


@pytest.fixture
def pool() -> Iterator[HostPool]:
    p = make_pool(spec(mha(), page_size=PS, size_tokens=PS * 4))
    yield p
    p.close()


def disk_for(pool: HostPool, where: Path) -> DiskTier:
    t = DiskTier(str(where), pool.spec.name, {"spec": {"name": pool.spec.name}},
                 pool.spec.page_bytes, 16)
    t.open()
    return t


def store(cache: PoolCache, pool: HostPool, key: bytes, fill: int) -> None:
    ticket = cache.begin_store([key])
    for page in ticket.pages.tolist():
        for view in pool.page_views(page):
            np.frombuffer(view, np.uint8)[:] = fill
    cache.finish_store(ticket, True)


def until(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.mark.parametrize("how", ["remove", "clear"])
def test_a_removal_while_the_spiller_writes_is_never_committed(
        pool: HostPool, tmp_path: Path, how: str) -> None:
    cache = PoolCache(pool)
    disk = disk_for(pool, tmp_path / "disk")
    stack = TierStack(pool, cache, disk, spill_window=4)
    with seams.Pause("spill.written") as stop:
        stack.start()
        store(cache, pool, b"doomed", 5)
        assert stop.wait_reached(), "the spiller did not write"
        # the page is on disk, its record not yet: the removal runs to its end meanwhile
        if how == "remove":
            assert stack.remove([b"doomed"]) == 1
        else:
            assert stack.clear() == 1
        assert stack.lookup([b"doomed"])[1] == b"\0"
        stop.release()
        until(lambda: disk.stats.not_committed == 1)
    assert stack.lookup([b"doomed"])[1] == b"\0", "the removed key came back from the disk"
    assert not disk.contains(b"doomed")
    stack.close()
    again = disk_for(pool, tmp_path / "disk")  # a restart rebuilds the index from the files
    assert not again.contains(b"doomed"), "the removed key came back after a restart"
    again.close()


def test_a_spill_that_began_after_the_removal_commits(pool: HostPool, tmp_path: Path) -> None:
    """The check is not a blanket refusal: a key stored again after its removal spills."""
    cache = PoolCache(pool)
    disk = disk_for(pool, tmp_path / "disk")
    stack = TierStack(pool, cache, disk, spill_window=4)
    stack.start()
    store(cache, pool, b"k", 1)
    until(lambda: disk.contains(b"k"))
    stack.remove([b"k"])
    store(cache, pool, b"k", 2)
    until(lambda: disk.contains(b"k"))
    assert disk.stats.not_committed == 0
    stack.close()


@pytest.mark.parametrize("how", ["remove", "clear"])
def test_a_removal_while_a_promotion_reads_is_never_served(
        pool: HostPool, tmp_path: Path, how: str) -> None:
    cache = PoolCache(pool)
    disk = disk_for(pool, tmp_path / "disk")
    stack = TierStack(pool, cache, disk, spill_window=4)
    stack.start()
    store(cache, pool, b"below", 9)
    until(lambda: disk.contains(b"below"))
    for i in range(4):  # host memory evicts it: only the disk has it
        store(cache, pool, b"other%d" % i, i)
    assert stack.lookup([b"below"])[1] == b"\x02"
    with seams.Pause("promote.read") as stop:
        import threading

        result: list[object] = []

        def load() -> None:
            try:
                result.append(stack.hold_for_load([b"below"]))
            except Exception as exc:
                result.append(exc)

        t = threading.Thread(target=load)
        t.start()
        assert stop.wait_reached(), "the promotion did not read"
        if how == "remove":
            stack.remove([b"below"])
        else:
            stack.clear()
        stop.release()
        t.join(10)
    assert result and isinstance(result[0], Exception), "a removed key was loaded"
    assert stack.lookup([b"below"])[1] == b"\0"
    assert not disk.contains(b"below")
    stack.close()
