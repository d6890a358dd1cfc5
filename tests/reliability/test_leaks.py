"""10,000 session open/close cycles and 100,000 alloc/free calls leave the daemon's RSS and
open file descriptors flat."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers
from tests.daemon_proc import DaemonProc, start_daemon
from tests.reliability.figures import record

SPEC = PoolSpec("leaks", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 2, 32), 4,
                Layout.LAYER_FIRST, size_tokens=4096)
SESSIONS = 10_000
ALLOCS = 100_000
THREADS = 4
RSS_TOLERANCE = 24 << 20
FD_TOLERANCE = 4


def rss(d: DaemonProc) -> int:
    for line in Path(f"/proc/{d.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def fds(d: DaemonProc) -> int:
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def test_sessions_and_allocations_do_not_leak(tmp_path: Path) -> None:
    d = start_daemon(tmp_path)
    client = HiCacheClient(d.target)
    client.create_pool(SPEC)
    try:
        with ShmDeviceBuffers.create(SPEC, 64, d.shm_dir, prefix="leak") as bufs:
            def sessions(n: int) -> None:
                for _ in range(n):
                    s = client.open_session(SPEC.name, "leak", bufs.descriptors,
                                            heartbeat=False)
                    s.close()

            def allocs(n: int) -> None:
                for _ in range(n // 2):
                    idx = client.alloc(SPEC.name, 8)
                    client.free(SPEC.name, idx)

            def run(fn: object, total: int) -> None:
                with ThreadPoolExecutor(THREADS) as ex:
                    list(ex.map(fn, [total // THREADS] * THREADS))  # type: ignore[arg-type]

            run(sessions, 400)  # warm up caches, thread pools, allocator arenas
            run(allocs, 4000)
            rss0, fd0 = rss(d), fds(d)
            run(sessions, SESSIONS)
            rss1, fd1 = rss(d), fds(d)
            run(allocs, ALLOCS)
            rss2, fd2 = rss(d), fds(d)
            # a session still works and nothing is left allocated or mapped
            with client.open_session(SPEC.name, "after", bufs.descriptors) as s:
                host = client.alloc(SPEC.name, 8)
                s.backup(host, torch.arange(8))
                client.free(SPEC.name, host)
        assert client.list_sessions() == []
        assert client.get_pool(SPEC.name).used_pages == 0
        assert d.shm_dir not in Path(f"/proc/{d.proc.pid}/maps").read_text()  # no buffer
        assert rss1 - rss0 < RSS_TOLERANCE, (rss0, rss1)
        assert rss2 - rss0 < RSS_TOLERANCE, (rss0, rss2)
        assert abs(fd1 - fd0) <= FD_TOLERANCE and abs(fd2 - fd0) <= FD_TOLERANCE, (fd0, fd1, fd2)
        record("leaks", session_cycles=SESSIONS, alloc_free_calls=ALLOCS,
               rss_growth_kib=(rss2 - rss0) / 1024, fd_before=fd0, fd_after=fd2)
    finally:
        client.close()
        assert d.stop() == 0, d.log()
