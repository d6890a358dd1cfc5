"""The KV event stream under real concurrent workers with a publisher made slow: three worker
processes store and remove keys of one shared key space at once, against a queue of 4 and a
publishing thread that sleeps 5 ms a turn (``HICACHE_SEAM_DELAYS``), so events are dropped
and snapshots published while stores and removals race them. Afterwards a subscriber that
followed the stream (with SGLang's own decoder, replaying what it missed) holds exactly what
Lookup says the pool holds.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from hicache import DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache_client import HiCacheClient
from tests.daemon_proc import REPO, DaemonProc, start_daemon
from tests.kv_event_follower import Follower
from tests.kv_event_workers import sglang_hash
from tests.reliability.churn_worker import KEY_SPACE, key
from tests.reliability.figures import record

SPEC = PoolSpec("churn", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 1, 8), 4,
                Layout.PAGE_FIRST, size_tokens=4 * 64)  # 64 pages for 96 keys: eviction too
WORKERS, OPS = 3, 300


def scrape(d: DaemonProc, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", d.metrics(), re.M)
    assert m, name
    return float(m.group(1))


def test_a_subscriber_ends_equal_to_the_pool_through_drops_and_races(tmp_path: Path) -> None:
    (tmp_path / "kv.toml").write_text("[kv_events]\nmax_queue_size = 4\nbuffer_steps = 64\n")
    d = start_daemon(tmp_path, "--config", str(tmp_path / "kv.toml"),
                     f"--kv-events-endpoint=ipc://{tmp_path}/kv.sock",
                     f"--kv-events-replay-endpoint=ipc://{tmp_path}/r.sock",
                     env={"HICACHE_SEAM_DELAYS": "kv_events.turn=5000"})
    f = Follower(f"ipc://{tmp_path}/kv.sock", f"ipc://{tmp_path}/r.sock")
    start = tmp_path / "go"
    try:
        with HiCacheClient(d.target) as c:
            c.create_pool(SPEC)
            time.sleep(0.2)
            f.sync()
            procs = [subprocess.Popen(
                [sys.executable, "-m", "tests.reliability.churn_worker", d.target, SPEC.name,
                 str(i), str(start), str(OPS), str(i)], cwd=REPO, stdout=subprocess.PIPE)
                for i in range(WORKERS)]
            time.sleep(2.0)  # every worker has its session
            start.touch()
            while any(p.poll() is None for p in procs):
                f.poll(0.05)
            stats = [json.loads(p.communicate()[0]) for p in procs]
            assert all(p.returncode == 0 for p in procs)
            deadline = time.monotonic() + 30
            while scrape(d, "hicache_kv_events_queued") > 0:
                assert time.monotonic() < deadline
                f.poll(0.05)
            f.poll(1.0)
            f.sync()
            keys = [key(i) for i in range(KEY_SPACE)]
            tiers = c.lookup(SPEC.name, keys).tiers
        held = {sglang_hash(k) for k, t in zip(keys, tiers, strict=True) if t == 1}
        assert f.held(SPEC.name, "CPU_PINNED") == held
        dropped = scrape(d, "hicache_kv_events_dropped_total")
        resyncs = scrape(d, "hicache_kv_events_resyncs_total")
        assert dropped > 0 and resyncs > 0  # the race this test is for did happen
        record("kv_event_churn", workers=WORKERS, stores=sum(s["stores"] for s in stats),
               removes=sum(s["removes"] for s in stats), dropped=int(dropped),
               resyncs=int(resyncs), gaps=f.gaps, held=len(held))
    finally:
        f.close()
        d.stop()
