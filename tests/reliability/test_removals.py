"""A removed key stays removed, under stress with a real daemon process: 256 keys stored into
a pool of 32 pages over a disk tier (the spiller writing all the time), each batch removed by
RemoveKeys right after its Store, every fourth batch by ClearPool instead; none may be found
again, in any tier, before or after the daemon is SIGKILLed and restarted on its files. The
daemon sleeps 2 ms between writing a page to disk and committing it
(``HICACHE_SEAM_DELAYS``), so the removals land in that window (the deterministic version:
tests/daemon/test_removal_races.py)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import torch

from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers
from tests.daemon_proc import start_daemon
from tests.reliability.figures import record

PS = 4
SPEC = PoolSpec("removals", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 2, 32), PS,
                Layout.LAYER_FIRST, size_tokens=PS * 32)
BATCH, KEYS = 8, 256


def test_removed_keys_never_come_back(tmp_path: Path) -> None:
    args = ("--disk-path", str(tmp_path / "disk"), "--disk-capacity", "64MiB",
            "--lease-seconds", "30")
    env = {"HICACHE_SEAM_DELAYS": "spill.written=2000"}
    d = start_daemon(tmp_path, *args, env=env)
    removed: list[bytes] = []
    try:
        with HiCacheClient(d.target) as c, \
                ShmDeviceBuffers.create(SPEC, PS * BATCH, d.shm_dir, prefix="rm") as bufs:
            c.create_pool(SPEC)
            s = c.open_session(SPEC.name, "remover", bufs.descriptors)
            for t in bufs.all_tensors():
                t.view(torch.uint8).fill_(3)
            for b in range(KEYS // BATCH):
                keys = [b"rm-%03d-%d" % (b, i) for i in range(BATCH)]
                s.store(keys, torch.arange(BATCH * PS))
                if b % 4 == 3:
                    c.clear_pool(SPEC.name)
                else:
                    c.remove_keys(SPEC.name, keys)
                removed += keys
                time.sleep(0.003)  # the spiller has its turn between batches
            time.sleep(1.0)  # every write the spiller had begun has ended
            found = c.lookup(SPEC.name, removed).hits
            s.close()
    finally:
        d.stop(signal.SIGKILL)
    d2 = start_daemon(tmp_path, *args)
    try:
        with HiCacheClient(d2.target) as c:
            c.create_pool(SPEC)
            after_restart = c.lookup(SPEC.name, removed).hits
            disk_keys = c.get_pool(SPEC.name).disk_keys
    finally:
        assert d2.stop() == 0, d2.log()
    record("removals", removed_keys=len(removed), found_again=found,
           found_after_restart=after_restart)
    assert found == 0, f"{found} of {len(removed)} removed keys were found again"
    assert after_restart == 0 and disk_keys == 0, \
        f"{after_restart} removed keys came back after a restart ({disk_keys} on disk)"
