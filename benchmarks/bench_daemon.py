"""Daemon benchmark: the same copies through hicached over its Unix socket vs in-process.

Starts a real daemon process, maps shm device buffers in this process (as a CPU worker does),
and measures side by side in one run, alternating, medians:

1. Backup and Load of 64-page batches (32 layers x 8 KV heads x 128 bf16, page_size 64, random
   pages) through the daemon, as a ratio to the in-process copy engine moving the same bytes
   between the same shm buffers and a local pool (target >= 0.8).
2. p50 / p99 latency of a 1-page Backup vs an empty unary RPC (Ping) on the same channel
   (target <= 2), at page_size 64 (an 8 MiB page: the copy itself is most of it) and at
   page_size 1 (128 KiB: the control plane).
3. Scrape latency of /metrics while 64-page backups run, and the backups' slowdown from it.

Run: ``python benchmarks/bench_daemon.py [--quick] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache_bench.daemon import start_daemon
from hicache_client import HiCacheClient, ShmDeviceBuffers
from hicached import (
    DType,
    HostPool,
    KVGeometry,
    Layout,
    PoolKind,
    PoolSpec,
    TransferEngine,
    WorkerBuffers,
)
from hicached.core.pool import MemoryOptions

GEOMETRY = KVGeometry(PoolKind.MHA, DType.BFLOAT16, layer_num=32, head_num=8, head_dim=128)
PAGE = 64
BATCH = 64


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn`` takes, back to back with the previous call: no pause hides the cost of
    copy threads that spin after a job (either side's)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def throughput(client: HiCacheClient, layout: Layout, shm: Path, reps: int,
               engine: TransferEngine) -> list[dict[str, Any]]:
    spec = PoolSpec(f"bench-{layout.value}", GEOMETRY, PAGE, layout,
                    size_tokens=4 * BATCH * PAGE)
    client.create_pool(spec)
    local = HostPool(spec, MemoryOptions(reserve_bytes=0))
    rows = []
    with ShmDeviceBuffers.create(spec, 4 * BATCH * PAGE, str(shm), prefix="bench") as bufs:
        session = client.open_session(spec.name, "bench", bufs.descriptors, lease_ms=60_000)
        rng = np.random.default_rng(0)
        remote_host = client.alloc(spec.name, 4 * BATCH * PAGE).reshape(-1, PAGE)
        local_host = local.alloc(4 * BATCH * PAGE).reshape(-1, PAGE)
        pick = torch.from_numpy(rng.permutation(4 * BATCH)[:BATCH])
        dev_pages = torch.from_numpy(rng.permutation(4 * BATCH)[:BATCH])
        dev = (dev_pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
        r_host, l_host = remote_host[pick].reshape(-1), local_host[pick].reshape(-1)
        nbytes = BATCH * spec.page_bytes
        device = WorkerBuffers(bufs.tensors)  # the same shm tensors, in-process
        for op in ("backup", "load"):
            remote = session.backup if op == "backup" else session.load
            inproc = engine.backup if op == "backup" else engine.load

            def via_daemon(remote: Callable[..., object] = remote) -> object:
                return remote(r_host, dev)

            def in_process(inproc: Callable[..., object] = inproc) -> object:
                return inproc(local, device, l_host, dev)

            via_daemon()
            in_process()
            t_d, t_i = [], []
            for _ in range(reps):
                t_d.append(timed(via_daemon))
                t_i.append(timed(in_process))
            md, mi = statistics.median(t_d), statistics.median(t_i)
            rows.append({"layout": layout.value, "op": op, "bytes": nbytes,
                         "daemon_gbps": nbytes / md / 1e9, "inprocess_gbps": nbytes / mi / 1e9,
                         "ratio": mi / md})
        session.close()
    local.close()
    client.delete_pool(spec.name)
    return rows


def scrape_under_load(client: HiCacheClient, shm: Path, reps: int, interval: float
                      ) -> dict[str, Any]:
    """Scrape /metrics every ``interval`` seconds (0 = back to back) while 64-page backups run;
    compare with the same backups unscraped."""
    port = client.get_info().metrics_port
    spec = PoolSpec("bench-scrape", GEOMETRY, PAGE, Layout.LAYER_FIRST,
                    size_tokens=2 * BATCH * PAGE)
    client.create_pool(spec)
    with ShmDeviceBuffers.create(spec, 2 * BATCH * PAGE, str(shm), prefix="scrape") as bufs:
        session = client.open_session(spec.name, "scrape", bufs.descriptors, lease_ms=60_000)
        host = client.alloc(spec.name, BATCH * PAGE)
        dev = torch.arange(BATCH * PAGE)
        session.backup(host, dev)
        quiet = [timed(lambda: session.backup(host, dev)) for _ in range(reps)]
        scrapes: list[float] = []
        stop = threading.Event()

        def scraper() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
                    r.read()
                scrapes.append(time.perf_counter() - t0)
                stop.wait(interval)

        thread = threading.Thread(target=scraper)
        thread.start()
        busy = [timed(lambda: session.backup(host, dev)) for _ in range(reps)]
        stop.set()
        thread.join()
        session.close()
    client.delete_pool(spec.name)
    arr = np.array(scrapes)
    return {"scrapes": len(scrapes), "scrape_p50_ms": float(np.percentile(arr, 50)) * 1e3,
            "scrape_p99_ms": float(np.percentile(arr, 99)) * 1e3,
            "backup_quiet_ms": statistics.median(quiet) * 1e3,
            "backup_scraped_ms": statistics.median(busy) * 1e3,
            "slowdown": statistics.median(busy) / statistics.median(quiet),
            "interval_s": interval}


def latency(client: HiCacheClient, shm: Path, n: int, page: int) -> dict[str, Any]:
    spec = PoolSpec("bench-lat", GEOMETRY, page, Layout.LAYER_FIRST, size_tokens=16 * page)
    client.create_pool(spec)
    with ShmDeviceBuffers.create(spec, 16 * page, str(shm), prefix="lat") as bufs:
        session = client.open_session(spec.name, "lat", bufs.descriptors, lease_ms=60_000)
        host = client.alloc(spec.name, page)
        dev = torch.arange(page)
        t_b, t_p, t_srv = [], [], []
        for _ in range(50):
            session.backup(host, dev)
            client.ping()
        for _ in range(n):
            t0 = time.perf_counter()
            stats = session.backup(host, dev)
            t1 = time.perf_counter()
            t_srv.append(stats.duration_seconds)
            client.ping()
            t2 = time.perf_counter()
            t_b.append(t1 - t0)
            t_p.append(t2 - t1)
        session.close()
    client.delete_pool(spec.name)

    def pct(xs: list[float], q: float) -> float:
        return float(np.percentile(np.array(xs), q))

    return {"page_size": page, "page_bytes": spec.page_bytes, "backup_p50_ms": pct(t_b, 50) * 1e3,
            "backup_p99_ms": pct(t_b, 99) * 1e3, "ping_p50_ms": pct(t_p, 50) * 1e3,
            "ping_p99_ms": pct(t_p, 99) * 1e3, "p50_ratio": pct(t_b, 50) / pct(t_p, 50),
            "p99_ratio": pct(t_b, 99) / pct(t_p, 99),
            "server_side_p50_ms": pct(t_srv, 50) * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="hicached daemon vs in-process copies")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    reps, n = (3, 300) if args.quick else (9, 2000)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="hicache-bench-") as work, \
            tempfile.TemporaryDirectory(prefix="hicache-bench-", dir="/dev/shm") as shm_dir:
        proc, target = start_daemon(work, shm_dir, "8GiB", metrics_listen="127.0.0.1:0")
        try:
            client = HiCacheClient(target)
            engine = TransferEngine()
            rows = []
            for layout in (Layout.LAYER_FIRST, Layout.PAGE_FIRST):
                rows += throughput(client, layout, Path(shm_dir), reps, engine)
            lats = [latency(client, Path(shm_dir), n, page) for page in (PAGE, 1)]
            scrapes = [scrape_under_load(client, Path(shm_dir), reps * 3, interval)
                       for interval in (1.0, 0.1, 0.0)]
            client.close()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    print(f"64-page batches ({rows[0]['bytes'] >> 20} MiB), daemon over a Unix socket with shm "
          f"buffers vs the in-process engine, medians of {reps}:")
    print(f"{'layout':<13}{'op':<8}{'daemon GB/s':>12}{'in-proc GB/s':>13}{'ratio':>7}")
    for r in rows:
        print(f"{r['layout']:<13}{r['op']:<8}{r['daemon_gbps']:>12.2f}"
              f"{r['inprocess_gbps']:>13.2f}{r['ratio']:>7.2f}")
    for lat in lats:
        print(f"\n1-page Backup at page_size {lat['page_size']} ({lat['page_bytes'] >> 10} KiB) "
              f"vs empty RPC, {n} calls each: p50 {lat['backup_p50_ms']:.3f} vs "
              f"{lat['ping_p50_ms']:.3f} ms (x{lat['p50_ratio']:.2f}), p99 "
              f"{lat['backup_p99_ms']:.3f} vs {lat['ping_p99_ms']:.3f} ms "
              f"(x{lat['p99_ratio']:.2f}); validation + copy inside the daemon p50 "
              f"{lat['server_side_p50_ms']:.3f} ms")
    print()
    for sc in scrapes:
        every = f"every {sc['interval_s']:.1f} s" if sc["interval_s"] else "back to back"
        print(f"scraping /metrics {every} during 64-page backups: {sc['scrapes']} scrapes, "
              f"p50 {sc['scrape_p50_ms']:.2f} ms, p99 {sc['scrape_p99_ms']:.2f} ms; backup "
              f"median {sc['backup_scraped_ms']:.1f} ms vs {sc['backup_quiet_ms']:.1f} ms "
              f"unscraped (x{sc['slowdown']:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"throughput": rows, "latency": lats, "scrape": scrapes}, f, indent=2)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
