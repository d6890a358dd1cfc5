"""A failing tier never spins: the one background writer backs off, says so, recovers.

In process: a disk tier whose page writes fail (ENOSPC) is tried a bounded number of times,
``failing`` set while it fails and cleared by the first batch that works; the write-through
writer tries a refused key again until ``put_retry_seconds`` and drops it after (counted);
a ClearPool's disk I/O happens after the pool's lock is let go (stopped there, other calls on
the pool go on and the cleared keys are gone for them).

With a daemon process on a small tmpfs (root only): a disk tier on a full filesystem costs
under 5 % of a core over 10 s with no calls, writes a bounded number of log lines, shows
``hicache_tier_failing{tier="disk"} 1`` and works again by itself once space returns; a tier
whose files cannot be reserved is refused at start, the pool serving without it.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers
from hicached.cache.pool_cache import PoolCache
from hicached.tiers.cluster_writer import ClusterWriter
from hicached.tiers.disk import DiskTier
from hicached.tiers.spill import Spiller
from hicached.tiers.writer import BackOff
from tests import prom
from tests.daemon_proc import DaemonProc, start_daemon
from tests.helpers import make_pool, mha, spec

DOC = {"spec": {"name": "t"}}


@pytest.fixture
def cache() -> Iterator[PoolCache]:
    pool = make_pool(spec(mha(), page_size=4, size_tokens=4 * 32))
    c = PoolCache(pool)
    yield c
    pool.close()


def _store(cache: PoolCache, keys: list[bytes]) -> None:
    cache.finish_store(cache.begin_store(keys), True)


def _wait(cond: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_a_disk_that_fails_every_write_is_tried_a_bounded_number_of_times(
        cache: PoolCache, tmp_path: Path) -> None:
    disk = DiskTier(str(tmp_path), "t", DOC, cache.pool.spec.page_bytes, 64)
    disk.open()
    assert disk._pages is not None
    real, calls, full = disk._pages.write, [], threading.Event()
    full.set()

    def write(slot: int, buffers: Sequence[memoryview]) -> int:
        calls.append(time.monotonic())
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(slot, buffers)

    disk._pages.write = write  # type: ignore[method-assign]
    spiller = Spiller(cache.pool, cache, disk, window=64, batch=4)
    spiller.backoff = BackOff(0.05, 0.2)
    cache.on_stored = lambda keys: spiller.nudge()
    spiller.start()
    try:
        _store(cache, [b"k%d" % i for i in range(8)])
        assert _wait(lambda: spiller.failing)
        time.sleep(1.0)
        in_a_second = [t for t in calls if t > time.monotonic() - 1.0]
        # without back-off: thousands; with it, one batch (4 writes) per 0.2 s at most
        assert len(in_a_second) <= 4 * 7, len(in_a_second)
        assert spiller.failures >= 3 and "No space" in spiller.last_error
        full.clear()  # space again: the next try works, and every key goes down
        assert _wait(lambda: not spiller.failing and disk.keys == 8)
        assert spiller.backoff.delay == 0
    finally:
        spiller.close()
        disk.close()


class _Store:
    """Stands in for the cluster store behind a ``ClusterTier``: refuses every put while
    ``down``."""

    def __init__(self, tier: object) -> None:
        self.down = True
        self.tries = 0
        self.got: list[bytes] = []
        self.tier = tier

    def put_pages(self, keys: list[bytes], pages: np.ndarray, wanted: object) -> list[bool]:
        self.tries += 1
        if self.down:
            self.tier.last_error = "the cluster store took 0 page(s) (down: test)"  # type: ignore[attr-defined]
            return [False] * len(keys)
        self.got += keys
        return [True] * len(keys)


class _Tier:
    last_error = ""

    def written(self, key: bytes) -> bool:
        return False


def test_write_through_retries_a_refused_key_until_its_age_and_drops_it_after(
        cache: PoolCache) -> None:
    tier = _Tier()
    store = _Store(tier)
    tier.put_pages = store.put_pages  # type: ignore[attr-defined]
    writer = ClusterWriter(cache, tier, max_keys=100, batch=8,  # type: ignore[arg-type]
                          retry_seconds=1.0)
    writer.backoff = BackOff(0.05, 0.1)
    _store(cache, [b"a", b"b"])
    writer.start()
    try:
        writer.offer([b"a", b"b"])
        assert _wait(lambda: writer.failing and store.tries >= 3)
        store.down = False  # back within put_retry_seconds: nothing lost
        assert _wait(lambda: sorted(store.got) == [b"a", b"b"] and not writer.failing)
        assert writer.dropped == 0
        store.down = True
        _store(cache, [b"c"])
        writer.offer([b"c"])
        assert _wait(lambda: writer.dropped == 1, 5.0)  # still refused after 1 s: dropped
        assert writer.waiting == 0 and b"c" not in store.got
        tries = store.tries
        time.sleep(0.3)
        assert store.tries == tries  # nothing left to try: the writer sleeps
    finally:
        writer.close()


def test_a_clear_erases_the_disk_after_letting_the_pools_lock_go(cache: PoolCache,
                                                                 tmp_path: Path) -> None:
    disk = DiskTier(str(tmp_path), "t", DOC, cache.pool.spec.page_bytes, 64)
    disk.open()
    keys = [b"d%d" % i for i in range(6)]
    _store(cache, keys)
    for k in keys:
        assert disk.write(k, cache.pool.page_views(int(cache.index.ready[k])))
    cache.lower = disk
    real_erase, erasing, go = disk.erase, threading.Event(), threading.Event()

    def erase(slots: Sequence[int]) -> None:
        erasing.set()
        go.wait(10)
        real_erase(slots)

    disk.erase = erase  # type: ignore[method-assign]
    t = threading.Thread(target=cache.clear)
    t.start()
    try:
        assert erasing.wait(10)
        # the clear is in its disk I/O: the pool's calls go on, and see nothing of it
        assert cache.lookup(keys) == (0, b"\0" * 6)
        _store(cache, [b"new"])
        assert cache.lookup([b"new"])[0] == 1
    finally:
        go.set()
        t.join(10)
    disk.close()
    again = DiskTier(str(tmp_path), "t", DOC, cache.pool.spec.page_bytes, 64)
    assert again.open() == "reattached" and again.keys == 0  # erased for good
    again.close()


# -- a daemon on a full filesystem ------------------------------------------------------------

PS = 16
SPEC = PoolSpec("full", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 4, 64), PS,
                size_tokens=PS * 64)  # 64 pages of 16 KiB


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(mnt: Path) -> Path:
    filler = mnt / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (4 << 10))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def _metric(d: DaemonProc, name: str, **labels: str) -> float:
    return prom.value(d.metrics(), name, **labels)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_disk_tier_on_a_full_filesystem_backs_off_and_recovers(tmp_path: Path,
                                                                 tmpfs: Path) -> None:
    cfg = tmp_path / "d.toml"
    cfg.write_text(f'[tier.disk]\npath = "{tmpfs / "disk"}"\ncapacity = "64MiB"\n'
                   'preallocate = false\nfsync = "never"\n')
    d = start_daemon(tmp_path, "--config", str(cfg), "--fast-path-spin-us", "0")
    try:
        with HiCacheClient(d.target) as c, \
                ShmDeviceBuffers.create(SPEC, 16 * PS, sealed=True) as bufs:
            c.create_pool(SPEC)
            filler = _fill(tmpfs)
            s = c.open_session(SPEC.name, "w", bufs.descriptors, fds=bufs.fds,
                               heartbeat=False)
            s.store([b"k%d" % i for i in range(16)], torch.arange(16 * PS))
            s.close()
            deadline = time.monotonic() + 10
            while _metric(d, "hicache_tier_failing", pool=SPEC.name, tier="disk") != 1:
                assert time.monotonic() < deadline, "the gauge never said the tier fails"
                time.sleep(0.2)
            lines_before = len(d.log().splitlines())
            cpu0, t0 = _cpu_seconds(d.proc.pid), time.monotonic()
            time.sleep(10)
            cpu = (_cpu_seconds(d.proc.pid) - cpu0) / (time.monotonic() - t0)
            lines = d.log().splitlines()[lines_before:]
            assert cpu < 0.05, f"{cpu:.1%} of a core while failing"
            assert len(lines) <= 6, lines
            filler.unlink()  # space again: spilled by itself within the back-off's cap
            deadline = time.monotonic() + 15
            while _metric(d, "hicache_disk_spilled_pages_total", pool=SPEC.name) < 16:
                assert time.monotonic() < deadline, "the tier never recovered"
                time.sleep(0.2)
            assert _metric(d, "hicache_tier_failing", pool=SPEC.name, tier="disk") == 0
            assert "works again" in d.log()
    finally:
        d.stop(signal.SIGKILL)


def test_a_disk_tier_that_cannot_be_reserved_is_refused_at_start(tmp_path: Path,
                                                                 tmpfs: Path) -> None:
    cfg = tmp_path / "d.toml"
    cfg.write_text(f'[tier.disk]\npath = "{tmpfs / "disk"}"\ncapacity = "64MiB"\n')
    # the pool's share of the disk: 2 of 8 MiB of budget, 16 MiB of the 4 MiB filesystem
    d = start_daemon(tmp_path, "--config", str(cfg), "--memory-budget", "8MiB")
    try:
        with HiCacheClient(d.target) as c, ShmDeviceBuffers.create(SPEC, PS, sealed=True) as bufs:
            c.create_pool(SPEC)  # the pool itself works, in host memory
            s = c.open_session(SPEC.name, "w", bufs.descriptors, fds=bufs.fds, heartbeat=False)
            assert s.store([b"x"], torch.arange(PS)).status == bytes([1])
            assert c.lookup(SPEC.name, [b"x"]).hits == 1
            s.close()
        log = d.log()
        assert re.search(r"pool full serves without its disk tier: .*need \d+ bytes, the "
                         r"filesystem has \d+ free", log), log
        assert _metric(d, "hicache_tier_failing", pool=SPEC.name, tier="disk") == 1
        assert not list((tmpfs / "disk").glob("full.*"))  # nothing half-reserved left behind
    finally:
        d.stop(signal.SIGKILL)
