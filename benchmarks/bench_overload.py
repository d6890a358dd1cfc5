"""Health under load: probe latency while 8 workers saturate the data path, side by side.

A daemon process (``--grpc-threads 16``, default ``max_data_rpcs`` = 12, a health-only
listener) and 8 worker processes, each looping 64-page Backups of its own pages through its own
session (started on a barrier, for ``--seconds``). Meanwhile this process probes health every
20 ms on the API socket and on the health-only listener and also times a Heartbeat (a control
call). Reported: p50 / p99 of each, idle (before the workers start) and loaded, plus the
workers' backups per second and OVERLOADED refusals.

Run: ``python benchmarks/bench_overload.py [--seconds S] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hicache.errors import HiCacheError
from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers

SPEC = PoolSpec("overload", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 16, 8, 128), 16,
                Layout.LAYER_FIRST, size_tokens=64 * 16 * 12)
BATCH = 64 * 16
WORKERS = 8


def worker(target: str, shm: str, seconds: float, barrier: Any, out: Any) -> None:
    ok = refused = 0
    with HiCacheClient(target, reconnect_seconds=0) as c, \
            ShmDeviceBuffers.create(SPEC, BATCH, shm) as bufs:
        s = c.open_session(SPEC.name, f"w{os.getpid()}", bufs.descriptors)
        host = c.alloc(SPEC.name, BATCH)
        barrier.wait()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                s.backup(host, torch.arange(BATCH))
                ok += 1
            except HiCacheError as exc:
                if exc.reason != "OVERLOADED":
                    raise
                refused += 1
        s.close()
    out.put((ok, refused))


def probe(stub: Any, service: str = "") -> float:
    t0 = time.perf_counter()
    r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    assert r.status == health_pb2.HealthCheckResponse.SERVING
    return (time.perf_counter() - t0) * 1e3


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def sample(api: Any, health: Any, ctl: HiCacheClient, session_id: str, seconds: float
           ) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"api_health": [], "health_listener": [], "heartbeat": []}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        out["api_health"].append(probe(api, "hicache.v1.HostCache"))
        out["health_listener"].append(probe(health, "hicache.v1.HostCache"))
        t0 = time.perf_counter()
        ctl.heartbeat(session_id)
        out["heartbeat"].append((time.perf_counter() - t0) * 1e3)
        time.sleep(0.02)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hicache-ovl-") as work, \
            tempfile.TemporaryDirectory(prefix="hicache-ovl-", dir="/dev/shm") as shm:
        api_sock, health_sock = f"{work}/api.sock", f"{work}/health.sock"
        daemon = subprocess.Popen(
            [sys.executable, "-m", "hicached", "serve", "--listen", f"unix:{api_sock}",
             "--health-listen", f"unix:{health_sock}", "--shm-dir", shm, "--metrics-listen",
             "", "--memory-budget", "4GiB", "--reserve", "0", "--state-dir", "",
             "--log-level", "WARNING"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            target = f"unix:{api_sock}"
            with HiCacheClient(target, reconnect_seconds=30) as ctl, \
                    grpc.insecure_channel(target) as a, \
                    grpc.insecure_channel(f"unix:{health_sock}") as h, \
                    ShmDeviceBuffers.create(SPEC, 16, shm) as mine:
                ctl.create_pool(SPEC)
                me = ctl.open_session(SPEC.name, "prober", mine.descriptors, heartbeat=False,
                                      lease_ms=60_000)
                api, health = health_pb2_grpc.HealthStub(a), health_pb2_grpc.HealthStub(h)
                idle = sample(api, health, ctl, me.session_id, 2.0)
                ctx = mp.get_context("spawn")
                barrier, out = ctx.Barrier(WORKERS + 1), ctx.Queue()
                procs = [ctx.Process(target=worker, args=(target, shm, args.seconds, barrier,
                                                          out)) for _ in range(WORKERS)]
                for p in procs:
                    p.start()
                barrier.wait()
                t0 = time.monotonic()
                loaded = sample(api, health, ctl, me.session_id, args.seconds * 0.9)
                results = [out.get(timeout=120) for _ in procs]
                elapsed = time.monotonic() - t0
                for p in procs:
                    p.join(30)
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(30)
    ok, refused = sum(r[0] for r in results), sum(r[1] for r in results)
    report = {"workers": WORKERS, "backups_per_s": ok / elapsed, "overloaded": refused,
              "gbps": ok * SPEC.page_bytes * 64 / elapsed / 1e9}
    print(f"{WORKERS} workers x 64-page backups: {ok / elapsed:.0f}/s "
          f"({report['gbps']:.1f} GB/s), {refused} OVERLOADED refusals")
    print(f"{'probe (ms)':<18}{'idle p50':>10}{'idle p99':>10}{'load p50':>10}{'load p99':>10}")
    for name in ("api_health", "health_listener", "heartbeat"):
        row = [pct(idle[name], 0.5), pct(idle[name], 0.99), pct(loaded[name], 0.5),
               pct(loaded[name], 0.99)]
        report[name] = dict(zip(("idle_p50", "idle_p99", "load_p50", "load_p99"), row,
                                strict=True))
        report[name]["samples"] = len(loaded[name])
        print(f"{name:<18}" + "".join(f"{v:>10.2f}" for v in row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
