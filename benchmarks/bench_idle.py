"""What an idle daemon costs the node: seconds of CPU per minute, with 0 and with N idle workers.

A daemon on its defaults (one pool); N worker processes each open a session with sealed memfd
buffers and then only heartbeat (the client's own heartbeat thread), as SGLang workers
between requests do: first N whose calls go over gRPC (``fast_path=False``), then N over the
fast path (each with its connection open). The daemon's CPU time (utime + stime from /proc)
is read before and after a measured window; figures are per minute of wall time.

Usage: python benchmarks/bench_idle.py [--workers 8] [--seconds 60] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec  # noqa: E402
from hicache_client import HiCacheClient  # noqa: E402
from tests.daemon_proc import start_daemon  # noqa: E402

SPEC = PoolSpec("idle", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 32, 8, 128), 64,
                Layout.PAGE_FIRST, size_tokens=64 * 16)
WORKER = """
import sys, time
from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers
spec = PoolSpec("idle", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 32, 8, 128), 64,
                Layout.PAGE_FIRST, size_tokens=64 * 16)
c = HiCacheClient(sys.argv[1], fast_path=sys.argv[3] == "fast")
b = ShmDeviceBuffers.create(spec, 64, sealed=True)
s = c.open_session("idle", "idle-" + sys.argv[2], b.descriptors, fds=b.fds, heartbeat=True)
s.client.lookup("idle", [b"warm"])  # the data path chosen (and, when fast, connected)
print("open", c.data_path, flush=True)
time.sleep(1e9)
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def window(pid: int, seconds: float) -> float:
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - c0) / (time.monotonic() - t0) * 60


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hicache-bench-idle-"))
    d = start_daemon(work, "--lease-seconds", "5")
    workers: list[subprocess.Popen[str]] = []
    try:
        with HiCacheClient(d.target) as c:
            c.create_pool(SPEC)
        time.sleep(2)
        alone = window(d.proc.pid, args.seconds)
        busy: dict[str, float] = {}
        for path in ("grpc", "fast"):  # heartbeats over gRPC, then over the fast path
            for i in range(args.workers):
                w = subprocess.Popen([sys.executable, "-c", WORKER, d.target, str(i), path],
                                     text=True, stdout=subprocess.PIPE)
                workers.append(w)
            for w in workers:
                assert w.stdout is not None and w.stdout.readline().split() == ["open", path]
            time.sleep(2)
            busy[path] = window(d.proc.pid, args.seconds)
            for w in workers:
                w.kill()
                w.wait()
            workers.clear()
            time.sleep(6)  # their sessions reaped (lease 5 s)
    finally:
        for w in workers:
            w.kill()
            w.wait()
        d.stop(signal.SIGTERM)
        shutil.rmtree(work, ignore_errors=True)
    row = {"seconds": args.seconds, "workers": args.workers,
           "cpu_s_per_min_no_workers": round(alone, 3),
           "cpu_s_per_min_idle_workers_grpc": round(busy["grpc"], 3),
           "cpu_s_per_min_idle_workers": round(busy["fast"], 3)}
    if args.json:
        print(json.dumps(row))
        return
    print(f"idle daemon CPU over {args.seconds:g} s windows: {alone:.3f} s/min with no "
          f"workers; with {args.workers} idle workers heartbeating over gRPC "
          f"{busy['grpc']:.3f} s/min, over the fast path {busy['fast']:.3f} s/min")


if __name__ == "__main__":
    main()
