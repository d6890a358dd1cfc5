"""Pools sharing an elastic budget on a GPU host, under load: a real daemon process on the
fake driver in strict mode (a copy whose host side is not page-locked memory fails, when it
is enqueued and when it runs: copies are deferred until the daemon synchronizes), worker
processes filling two pools through CUDA IPC while the budget moves memory between them.

Every round of every worker loads back exact what it stored; the pools' shares and locked
memory moved (memory was taken from one and given back to the system) while they did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache_client import HiCacheClient
from hicached.service.pool_table import _tables
from tests import prom
from tests.daemon_proc import REPO, DaemonProc, start_daemon
from tests.fakecuda import UUID_A, UUID_B, library

GEOMETRY = KVGeometry(PoolKind.MHA, DType.BFLOAT16, 4, 2, 64)
"""A page's bytes of one layer and role: 16 x 2 x 64 x 2 = 4 KiB, a unit each."""
SPECS = [PoolSpec(f"el-{n}", GEOMETRY, 16, Layout.LAYER_FIRST, size_tokens=16 * 256)
         for n in "ab"]
PB = SPECS[0].page_bytes  # 32 KiB
CONFIG = f"""
[budget]
elastic = true
interval_seconds = 0.05
grow_step_bytes = {4 * PB}
step_fraction = 0.2
pin_unit_bytes = 4096

[[budget.pools]]
pools = "el-*"
floor_bytes = {16 * PB}
"""


def spawn(daemon: DaemonProc, pool: str, worker: str, seed: int, rounds: int
          ) -> subprocess.Popen[str]:
    env = dict(os.environ, HICACHED_CUDA_DRIVER=library(), FAKECUDA_DEVICES=UUID_A)
    cmd = [sys.executable, "-m", "tests.cuda_worker_proc", daemon.target, pool, worker,
           str(seed), str(rounds), str(16 * 64), "--fake", "--keyed", "--keep"]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def metric(client: HiCacheClient, name: str) -> float:
    port = client.get_info().metrics_port
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return prom.value(body, name)


def test_workers_round_trip_exactly_while_the_budget_moves_locked_memory(
        tmp_path: Path) -> None:
    config = tmp_path / "elastic.toml"
    config.write_text(CONFIG)
    env = {"HICACHED_CUDA_DRIVER": library(), "FAKECUDA_DEVICES": f"{UUID_A},{UUID_B}",
           "FAKECUDA_DEFER": "1", "FAKECUDA_STRICT_PINNED": "1"}
    # the pools' tables and 320 pages: both pools cannot be full at once
    d = start_daemon(tmp_path, "--config", str(config), "--memory-budget",
                     str(2 * _tables(SPECS[0]) + 320 * PB), env=env)
    try:
        with HiCacheClient(d.target) as c:
            for s in SPECS:
                info = c.create_pool(s)
                assert 0 < info.pinned_bytes < info.capacity_bytes
            # a fills first, then b's workers join while a's keep storing
            first = [spawn(d, "el-a", f"a{i}", i + 1, 120) for i in range(2)]
            second = [spawn(d, "el-b", f"b{i}", i + 11, 120) for i in range(2)]
            results = []
            for w in first + second:
                out, err = w.communicate(timeout=300)
                assert w.returncode == 0, err
                results.append(json.loads(out.strip().splitlines()[-1]))
            for r in results:
                assert r["mismatches"] == 0 and r["verified_buffers"] == 120 * r["buffers"]
            assert metric(c, "hicache_budget_released_bytes_total") > 0, \
                "a pool's share shrank and its unlocked memory went back"
            assert metric(c, "hicache_budget_grown_bytes_total") > 0
            for s in SPECS:
                info = c.get_pool(s.name)
                assert info.share_bytes <= info.pinned_bytes <= info.capacity_bytes, info
                assert info.used_bytes <= info.share_bytes
    finally:
        assert d.stop() == 0, d.log()
    assert "CUDA_ERROR" not in d.log() and "GPU copy failed" not in d.log(), d.log()
