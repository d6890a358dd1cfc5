"""8 concurrent worker processes back up and load distinct and overlapping page sets with the
kv-canary on; every loaded page is verified; nothing acknowledged is lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hicache.specs import CanarySpec, DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache_client import HiCacheClient
from tests.daemon_proc import REPO, start_daemon
from tests.reliability.figures import record

WORKERS = 8
PAGES = 16
SECONDS = float(os.environ.get("HICACHE_SOAK_SECONDS", "6"))
"""Traffic time per worker; raise it for a longer soak (the CI run keeps it short)."""


def test_integrity_under_load(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path, "--lease-seconds", "10")
    spec = PoolSpec("integrity", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 4, 2, 64), 4,
                    Layout.PAGE_FIRST, size_tokens=WORKERS * PAGES * 4 * 2,
                    canary=CanarySpec(16))
    sync = tmp_path / "sync"
    sync.mkdir()
    try:
        with HiCacheClient(daemon.target) as c:
            c.create_pool(spec)
            procs = [subprocess.Popen(
                [sys.executable, "-m", "tests.reliability.integrity_worker", daemon.target,
                 spec.name, str(w), str(WORKERS), str(PAGES), str(SECONDS), daemon.shm_dir,
                 str(sync)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True) for w in range(WORKERS)]
            results = []
            for p in procs:
                out, err = p.communicate(timeout=300)
                assert p.returncode == 0, err + out
                results.append(json.loads(out.strip().splitlines()[-1]))
            pool = c.get_pool(spec.name)
            assert pool.used_pages == 0
        total = {k: sum(r[k] for r in results) for k in results[0] if k != "worker"}
        assert total["mismatches"] == 0 and total["lost_acknowledged"] == 0
        assert total["errors"] == 0
        # every worker read every worker's pages in the overlap phase
        assert total["pages_verified"] >= WORKERS * WORKERS * PAGES
        record("integrity", workers=WORKERS, requests=total["backups"] + total["loads"],
               pages_verified=total["pages_verified"], bytes_verified=total["bytes_verified"],
               mismatches=total["mismatches"], lost_acknowledged=total["lost_acknowledged"])
    finally:
        assert daemon.stop() == 0, daemon.log()
    log = daemon.log()
    assert "CANARY_MISMATCH" not in log
