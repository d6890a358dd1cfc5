"""Pools whose files lie on a disk filesystem cannot be page-locked: refused with the cause.

Linux pins shared file pages long-term (what ``cuMemHostRegister`` does) only on memory
filesystems; on a GPU host a daemon whose ``state_dir`` is on ext4 would fail every pool with
``CUDA_ERROR_INVALID_VALUE`` and a message about the locked-memory limit. The fake driver
refuses the same mappings the kernel does, so here: the message names the filesystem, a
daemon with a GPU refuses such a ``state_dir`` at start, and tmpfs, memfd and anonymous memory
still pin.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.cuda_driver import CudaDriver
from hicache.errors import PinFailed
from hicache.specs import DType, PoolKind
from hicache_client import HiCacheClient
from hicached.core.memory import Backing, HostMemory
from hicached.core.system import filesystem_of, lock_refusal
from hicached.cuda.pinner import DriverPinner
from tests.daemon_proc import REPO, start_daemon
from tests.helpers import geometry_for, spec

NBYTES = 4 << 20


def disk_dir() -> Path | None:
    """A directory on a disk filesystem (the checkout's, or the temp directory's)."""
    for d in (REPO, Path(tempfile.gettempdir())):
        if lock_refusal(str(d)) is not None and os.access(d, os.W_OK):
            return d
    return None


@pytest.fixture
def on_disk() -> Iterator[Path]:
    base = disk_dir()
    if base is None:
        pytest.skip("no writable directory on a disk filesystem here")
    with tempfile.TemporaryDirectory(prefix=".hicache-pin-", dir=base) as d:
        yield Path(d)


@pytest.fixture
def on_tmpfs() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="hicache-pin-", dir="/dev/shm") as d:
        yield Path(d)


def test_filesystem_types_are_read() -> None:
    assert filesystem_of("/dev/shm") == "tmpfs"
    assert lock_refusal("/dev/shm") is None
    assert filesystem_of("/dev/shm/not/yet/made") == "tmpfs"  # its nearest existing parent
    assert lock_refusal("/proc") is not None


def test_disk_filesystem_is_named_as_the_refusal(on_disk: Path) -> None:
    fs = filesystem_of(str(on_disk))
    refusal = lock_refusal(str(on_disk))
    assert refusal is not None and fs in refusal and "tmpfs" in refusal


def test_pool_file_on_disk_fails_to_pin_naming_the_filesystem(driver: CudaDriver,
                                                               on_disk: Path) -> None:
    path = on_disk / "pool"
    with pytest.raises(PinFailed) as exc:
        HostMemory(NBYTES, backing=Backing.FILE, path=str(path), pinner=DriverPinner(driver))
    msg = str(exc.value)
    assert filesystem_of(str(on_disk)) in msg and "state_dir" in msg
    assert "LimitMEMLOCK" not in msg  # not blamed on the locked-memory limit
    assert exc.value.metadata["filesystem"] and exc.value.metadata["pinned_before_failure"] == "0"
    assert not path.exists()  # the half-made file is gone


@pytest.mark.parametrize("backing", [Backing.FILE, Backing.MEMFD, Backing.ANONYMOUS],
                         ids=lambda b: b.value)
def test_memory_backings_pin(driver: CudaDriver, on_tmpfs: Path, backing: Backing) -> None:
    path = str(on_tmpfs / "pool") if backing is Backing.FILE else None
    m = HostMemory(NBYTES, backing=backing, path=path, pinner=DriverPinner(driver))
    try:
        assert m.pinned_bytes == NBYTES
    finally:
        m.close()


def test_daemon_with_a_gpu_refuses_a_state_dir_on_disk(fake_lib: str, on_disk: Path,
                                                        tmp_path: Path) -> None:
    env = dict(os.environ, HICACHED_CUDA_DRIVER=fake_lib, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "hicached", "serve", "--listen",
           f"unix:{tmp_path / 'd.sock'}", "--state-dir", str(on_disk / "state"),
           "--metrics-listen", "", "--reserve", "0", "--memory-budget", "1GiB"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    log = out.stdout + out.stderr
    assert f"state_dir {on_disk / 'state'} is on {filesystem_of(str(on_disk))}" in log
    assert "tmpfs" in log and len(log) < 4000
    assert not (tmp_path / "d.sock").exists()


def test_daemon_with_a_gpu_pins_pools_on_its_tmpfs_state_dir(fake_lib: str,
                                                              tmp_path: Path) -> None:
    d = start_daemon(tmp_path, env={"HICACHED_CUDA_DRIVER": fake_lib})
    try:
        with HiCacheClient(d.target) as c:
            pool = c.create_pool(spec(geometry_for(PoolKind.MHA, DType.BFLOAT16),
                                      page_size=16, size_tokens=16 * 8, name="pinned"))
            assert pool.pinned_bytes == pool.capacity_bytes > 0
    finally:
        assert d.stop() == 0, d.log()
