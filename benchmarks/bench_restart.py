"""Restart survival: how long a killed daemon takes to serve its cache again, by pool size.

For each pool size, in one run, with a real daemon process on a state directory in /dev/shm:

1. cold: ``CreatePool`` of a new pool until READY (its memory mapped and faulted in), which is
   what a daemon without restart survival pays before it can cache anything (and then the
   prefills to fill it again);
2. the pool gets keys (a few pages stored through a sealed-memfd session);
3. the daemon is SIGKILLed and started again on the same socket and state directory; timed from
   the new process's spawn to the first LoadKeys of a stored key that lands exact in zeroed
   rows (``restart_to_first_hit_s``);
4. beside it, the same daemon started with no pool at all (``empty_start_s``: exec to
   SERVING: Python, imports, sockets), so the part the pool adds is
   ``restart_to_first_hit_s - empty_start_s``.

The floor beside them: ``python3 -c "import grpc"`` (an interpreter and the one library no
gRPC server can go without). With ``--before TREE`` every figure is measured for the daemon of
that source tree too (another checkout: its ``daemon`` and ``clients/python`` put first on the
daemon's path), in the same run, sizes alternating between the two.

Target: restart -> first exact hit under 1 s at every size.

Run: ``python benchmarks/bench_restart.py [--sizes-gib 1,4,16] [--before TREE] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hicache_client import HiCacheClient, ShmDeviceBuffers
from hicached import DType, KVGeometry, Layout, PoolKind, PoolSpec

GEOMETRY = KVGeometry(PoolKind.MHA, DType.BFLOAT16, layer_num=32, head_num=8, head_dim=128)
PAGE = 64  # 8 MiB pages
KEYS = 8


TREE: Path | None = None
"""The source tree whose daemon runs (None: the installed one)."""


def daemon_env() -> dict[str, str] | None:
    if TREE is None:
        return None
    path = [str(TREE / "daemon"), str(TREE / "clients" / "python")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


def floor_seconds(runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import grpc"], check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def spawn(work: Path, state: Path, budget_gib: int) -> tuple[subprocess.Popen[bytes], str]:
    sock = work / "bench.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicached", "serve", "--listen", f"unix:{sock}",
         "--shm-dir", "/dev/shm", "--state-dir", str(state), "--metrics-listen", "",
         "--memory-budget", f"{budget_gib}GiB", "--reserve", "0", "--log-level", "WARNING"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=daemon_env())
    return proc, f"unix:{sock}"


def serving(target: str) -> HiCacheClient:
    c = HiCacheClient(target, reconnect_seconds=60)
    c.ping()
    return c


def first_hit(target: str, spec: PoolSpec, bufs: ShmDeviceBuffers, key: bytes,
              want: list[torch.Tensor]) -> None:
    """Open a session and load ``key`` into zeroed rows; retry until the pool is there."""
    c = serving(target)
    rows = [t.view(torch.uint8) for t in bufs.all_tensors()]
    while True:
        try:
            s = c.open_session(spec.name, "bench", bufs.descriptors, fds=bufs.fds,
                               heartbeat=False)
            break
        except Exception:  # POOL_NOT_READY while it re-attaches
            time.sleep(0.005)
    for r in rows:
        r[:PAGE].zero_()
    s.load_keys([key], torch.arange(PAGE))
    assert all(torch.equal(r[:PAGE], w) for r, w in zip(rows, want, strict=True)), "wrong bytes"
    s.close()
    c.close()


def one_size(gib: int, root: Path) -> dict[str, Any]:
    spec = PoolSpec(f"restart-{gib}g", GEOMETRY, PAGE, Layout.PAGE_FIRST, size_bytes=gib << 30)
    work = Path(tempfile.mkdtemp(dir=root))
    state = Path(tempfile.mkdtemp(prefix="hicache-bench-state-", dir="/dev/shm"))
    bufs = ShmDeviceBuffers.create(spec, KEYS * PAGE, sealed=True)
    try:
        t0 = time.perf_counter()
        proc, target = spawn(work, state, gib + 1)
        c = serving(target)
        empty_start = time.perf_counter() - t0
        t0 = time.perf_counter()
        c.create_pool(spec)  # waits for READY: mapped and faulted in
        cold = time.perf_counter() - t0
        rows = [t.view(torch.uint8) for t in bufs.all_tensors()]
        for r in rows:
            r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8))
        want = [r[:PAGE].clone() for r in rows]
        s = c.open_session(spec.name, "bench", bufs.descriptors, fds=bufs.fds, heartbeat=False)
        keys = [b"bench-%d" % i for i in range(KEYS)]
        assert s.store(keys, torch.arange(KEYS * PAGE)).stored == KEYS
        c.close()
        restarts, starts = [], []
        for _ in range(3):
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            t0 = time.perf_counter()
            proc, target = spawn(work, state, gib + 1)
            first_hit(target, spec, bufs, keys[0], want)
            restarts.append(time.perf_counter() - t0)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        empty = Path(tempfile.mkdtemp(prefix="hicache-bench-empty-", dir="/dev/shm"))
        for _ in range(3):  # the same daemon with nothing to re-attach
            t0 = time.perf_counter()
            p2, t2 = spawn(work, empty, 1)
            serving(t2).close()
            starts.append(time.perf_counter() - t0)
            p2.send_signal(signal.SIGKILL)
            p2.wait()
        shutil.rmtree(empty, ignore_errors=True)
        hit_s, start_s = statistics.median(restarts), statistics.median(starts)
        return {"pool_gib": gib, "cold_create_s": cold, "restart_to_first_hit_s": hit_s,
                "empty_start_s": start_s, "reattach_part_s": hit_s - start_s,
                "first_empty_start_s": empty_start, "cold_over_restart": cold / hit_s}
    finally:
        bufs.close()
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    global TREE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-gib", default="1,4,16")
    ap.add_argument("--before", type=Path, help="another source tree, measured beside")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    trees: list[tuple[str, Path | None]] = [("this tree", None)]
    if args.before is not None:
        trees.insert(0, (f"before ({args.before})", args.before.resolve()))
    root = Path(tempfile.mkdtemp(prefix="hicache-bench-restart-"))
    rows = []
    try:
        for g in args.sizes_gib.split(","):
            for label, tree in trees:
                TREE = tree
                rows.append({"daemon": label, **one_size(int(g), root)})
        floor = floor_seconds()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"floor: python3 -c 'import grpc' {floor:.3f}s (median of 5)")
    print(f"{'daemon':<12} {'pool':>6} {'cold create+prefault':>21} {'restart->first hit':>19} "
          f"{'exec->SERVING':>14} {'re-attach part':>15}")
    for r in rows:
        print(f"{r['daemon'][:12]:<12} {r['pool_gib']:>4}Gi {r['cold_create_s']:>20.3f}s "
              f"{r['restart_to_first_hit_s']:>18.3f}s {r['empty_start_s']:>13.3f}s "
              f"{r['reattach_part_s']:>14.3f}s")
    if args.json:
        Path(args.json).write_text(json.dumps({"floor_s": floor, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
