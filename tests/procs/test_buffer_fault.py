"""A worker that truncates its own handed-over buffer cannot crash the daemon.

Before the SIGBUS guard the next copy killed the daemon (exit -7) and every worker's cache with
it. Now the copy fails with ``BUFFER_FAULT``, the daemon ends that session only, stays SERVING,
and other sessions' bytes stay exact. The kernel is also tested alone: a copy into a truncated
mapping, on one thread and split over helper threads, raises instead of killing the process.
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache.errors import BufferFault, HiCacheError
from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec, Role
from hicache_client import HiCacheClient, ShmDeviceBuffers
from hicached.copy import native
from tests.daemon_proc import DaemonProc, Daemons

pytestmark = pytest.mark.skipif(native.KERNEL is None, reason="native kernel not built")

SPEC = PoolSpec("fault-guard", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 4, 2, 64), 16,
                Layout.LAYER_FIRST, size_tokens=4096)
N = 16 * 16  # tokens per batch


@pytest.mark.parametrize("threads", [1, 4])
def test_kernel_copy_into_a_truncated_mapping_raises(tmp_path: Path, threads: int) -> None:
    kernel = native.KERNEL
    assert kernel is not None
    path = tmp_path / "victim"
    size = 4 << 20
    with open(path, "wb") as f:
        f.truncate(size)
    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, size)
    dst = np.frombuffer(m, dtype=np.uint8)
    src = np.ones(size, dtype=np.uint8)
    pages = np.arange(size // 4096, dtype=np.int64)
    base = np.array([dst.ctypes.data], dtype=np.int64), np.array([src.ctypes.data],
                                                                   dtype=np.int64)
    args = (4096, 1, 4096, 4096, 4096, 4096, threads, 0, 0, False)
    assert kernel.copy_pages(base[0], base[1], pages, pages, *args) == size
    os.truncate(fd, 0)  # the worker shrinks its file under the daemon's mapping
    with pytest.raises(kernel.BufferFault):
        kernel.copy_pages(base[0], base[1], pages, pages, *args)
    os.truncate(fd, size)  # the guard is re-armed for the next copy, which succeeds
    assert kernel.copy_pages(base[0], base[1], pages, pages, *args) == size
    del dst
    m.close()
    os.close(fd)


@pytest.fixture
def daemon(daemons: Daemons) -> DaemonProc:
    return daemons.start("--lease-seconds", "30")


def random_fill(bufs: ShmDeviceBuffers) -> None:
    for t in bufs.all_tensors():
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8))


def test_a_truncated_buffer_fails_its_session_only(daemon: DaemonProc) -> None:
    with HiCacheClient(daemon.target) as c, \
            ShmDeviceBuffers.create(SPEC, 2 * N, daemon.shm_dir, prefix="victim") as victim, \
            ShmDeviceBuffers.create(SPEC, 2 * N, daemon.shm_dir, prefix="bystander") as other:
        c.create_pool(SPEC)
        random_fill(victim)
        random_fill(other)
        vs = c.open_session(SPEC.name, "victim", victim.descriptors, heartbeat=False)
        os_ = c.open_session(SPEC.name, "bystander", other.descriptors, heartbeat=False)
        host_v, host_o = c.alloc(SPEC.name, N), c.alloc(SPEC.name, N)
        vs.backup(host_v, torch.arange(N))
        os_.backup(host_o, torch.arange(N))
        for p in victim.paths:
            os.truncate(p, 0)
        for op in (lambda: vs.backup(host_v, torch.arange(N)),):
            with pytest.raises(BufferFault) as exc:
                op()
            assert exc.value.metadata["worker_id"] == "victim"
        with pytest.raises(HiCacheError) as gone:  # the daemon ended that session
            vs.load(host_v, torch.arange(N, 2 * N))
        assert gone.value.reason == "SESSION_NOT_FOUND"
        assert daemon.proc.poll() is None and c.health("hicache.v1.HostCache")
        # the other worker's pages load exactly into zeroed rows
        rows = [t.view(torch.uint8) for t in other.all_tensors()]
        want = [r[:N].clone() for r in rows]
        for r in rows:
            r[N:2 * N] = 0
        os_.load(host_o, torch.arange(N, 2 * N))
        assert all(torch.equal(r[N:2 * N], w) for r, w in zip(rows, want, strict=True))
        assert "buffer memory vanished" in daemon.log()


def test_truncation_racing_loads_and_stores_never_kills_the_daemon(daemon: DaemonProc) -> None:
    outcomes: list[str] = []
    with HiCacheClient(daemon.target) as c, \
            ShmDeviceBuffers.create(SPEC, 2 * N, daemon.shm_dir, prefix="racer") as bufs:
        c.create_pool(SPEC)
        random_fill(bufs)
        s = c.open_session(SPEC.name, "racer", bufs.descriptors, heartbeat=False)
        host = c.alloc(SPEC.name, N)
        s.backup(host, torch.arange(N))
        stop = threading.Event()

        def traffic() -> None:
            i = 0
            while not stop.is_set():
                try:
                    if i % 2:
                        s.load(host, torch.arange(N, 2 * N))
                    else:
                        s.store([f"k{i}-{j}".encode() for j in range(N // 16)],
                                torch.arange(N))
                    outcomes.append("ok")
                except HiCacheError as exc:
                    outcomes.append(exc.reason)
                    return
                i += 1

        t = threading.Thread(target=traffic)
        t.start()
        while outcomes.count("ok") < 5:
            pass
        for p in bufs.paths:
            os.truncate(p, 4096)  # shrink, not remove: the head stays, the rest is gone
        t.join(30)
        stop.set()
        assert outcomes[-1] in ("BUFFER_FAULT", "SESSION_NOT_FOUND"), outcomes[-3:]
        assert daemon.proc.poll() is None and c.health("hicache.v1.HostCache")
        # keys whose store faulted never became visible; the pool is intact for a new session
        with ShmDeviceBuffers.create(SPEC, N, daemon.shm_dir, prefix="after") as fresh:
            random_fill(fresh)
            s2 = c.open_session(SPEC.name, "after", fresh.descriptors, heartbeat=False)
            assert s2.store([b"fresh"], torch.arange(16)).stored == 1
            k0 = fresh.layers("kv", Role.K)[0].view(torch.uint8)
            want = k0[:16].clone()
            k0[16:32] = 0
            s2.load_keys([b"fresh"], torch.arange(16, 32))
            assert torch.equal(k0[16:32], want)
