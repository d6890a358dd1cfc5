"""One writer per page, under stress with real processes: two buggy raw clients back up pages
while freeing them from another thread, two keyed workers store and load keys in a pool small
enough that every freed page is reused at once. No keyed page may ever hold a raw client's
bytes (the deterministic version: tests/daemon/test_page_races.py). The daemon sleeps 2 ms at
the seam between a raw copy's checks and its hold (``HICACHE_SEAM_DELAYS``), so that the
others' frees and stores land in that window often, not once in a long while."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache_client import HiCacheClient
from tests.daemon_proc import REPO, start_daemon
from tests.reliability.figures import record

SECONDS = float(os.environ.get("HICACHE_SOAK_SECONDS", "4"))


def test_no_keyed_page_ever_holds_a_raw_writers_bytes(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path, "--lease-seconds", "10",
                          env={"HICACHE_SEAM_DELAYS": "raw.checked=2000"})
    spec = PoolSpec("one-writer", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 2, 64), 4,
                    Layout.LAYER_FIRST, size_tokens=4 * 40)
    sync = tmp_path / "sync"
    sync.mkdir()
    roles = ["raw", "raw", "keyed", "keyed"]
    try:
        with HiCacheClient(daemon.target) as c:
            c.create_pool(spec)
            procs = [subprocess.Popen(
                [sys.executable, "-m", "tests.reliability.page_writer_worker", daemon.target,
                 spec.name, role, str(i), str(SECONDS), daemon.shm_dir, str(sync),
                 str(len(roles))], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True) for i, role in enumerate(roles)]
            results = []
            for p in procs:
                out, err = p.communicate(timeout=120)
                assert p.returncode == 0, err + out
                results.append(json.loads(out.strip().splitlines()[-1]))
        total: dict[str, int] = {}
        for r in results:
            for k, v in r.items():
                total[k] = total.get(k, 0) + v
        assert total["loaded"] > 50 and total["raw_backups"] > 50, total
        assert total["mismatches"] == 0, f"keyed pages held a raw writer's bytes: {total}"
        record("one_writer", raw_backups=total["raw_backups"],
               raw_refused=total.get("raw_page_not_allocated", 0), keyed_loads=total["loaded"],
               mismatches=total["mismatches"])
    finally:
        assert daemon.stop() == 0, daemon.log()
