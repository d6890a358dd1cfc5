"""One elastic budget under load: a real daemon (``[budget] elastic`` from its TOML file) and
worker processes storing into two pools whose shares move every few milliseconds.

Each worker stores fresh keys and loads its most recent ones back into zeroed rows, byte for
byte, while the budget's thread moves memory between the pools (evicting, copying pages below
a shrinking pool's new size, giving memory back); the daemon's Store windows are widened
(``HICACHE_SEAM_DELAYS``) so rounds land inside them. The shares stay within the budget and
above the floors, the daemon drains clean (the factory checks its exit), and no worker reads
a wrong byte.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicache_client import HiCacheClient
from hicached.service.pool_table import _tables
from tests.daemon_proc import REPO, Daemons
from tests.prom import value

SPECS = [PoolSpec(name, KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 2, 64), 16,
                  size_tokens=16 * 128) for name in ("left", "right")]
PB = SPECS[0].page_bytes
FLOOR = 8


def test_workers_read_exact_bytes_while_the_budget_moves_memory(daemons: Daemons,
                                                                 tmp_path: Path) -> None:
    budget = 2 * _tables(SPECS[0]) + 96 * PB  # 96 pages for two pools of 128
    cfg = tmp_path / "budget.toml"
    cfg.write_text(f"""
[budget]
elastic = true
interval_seconds = 0.02
grow_step_bytes = {4 * PB}
step_fraction = 0.1

[[budget.pools]]
pools = "*"
floor_bytes = {FLOOR * PB}
""")
    # the daemon's default lease (the factory's 1 s, for tests of expiry, can run out for a
    # worker whose heartbeat thread waits for a CPU while the suite's other half runs)
    d = daemons.start("--config", str(cfg), "--memory-budget", str(budget),
                      "--lease-seconds", "5",
                      env={"HICACHE_SEAM_DELAYS": "store.taken=300,store.copied=300"})
    with HiCacheClient(d.target) as c:
        for s in SPECS:
            c.create_pool(s)
        procs = [subprocess.Popen(
            [sys.executable, "-m", "tests.cache_worker_proc", d.target, s.name, d.shm_dir,
             "churn", str(10 * i + j), "6"], cwd=REPO, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
            for i, s in enumerate(SPECS) for j in range(2)]
        shares: list[tuple[float, float]] = []
        while any(p.poll() is None for p in procs):
            text = d.metrics()
            shares.append((value(text, "hicache_pool_share_bytes", pool="left"),
                           value(text, "hicache_pool_share_bytes", pool="right")))
            time.sleep(0.1)
        results: list[dict[str, Any]] = []
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
        text = d.metrics()
    assert all(r["mismatches"] == 0 for r in results), results
    assert sum(r["verified"] for r in results) > 100, results
    for left, right in shares:  # within the budget, above the floors
        assert left + right <= 96 * PB and min(left, right) >= FLOOR * PB
    assert len({s for s in shares}) > 3, "the shares never moved"
    assert value(text, "hicache_budget_rounds_total") > 10
    assert value(text, "hicache_budget_shrunk_bytes_total") > 0
