"""``hicache-bench`` (its default run): Backup / Load traffic through a daemon, beside in-process.

Starts a daemon (or connects to ``--target``), creates a pool from a preset or flags, spawns N
worker processes with shm device buffers and, for each batch size, has every worker set up,
wait on a barrier, then send backup/load requests (``--read-ratio`` of them loads) for
``--seconds``; throughput is divided by the measured time from the first request to the last
reply, not by ``--seconds``. Reported side by side
in one run: aggregate throughput through the daemon (GB/s, pages/s), the same bytes copied by the
in-process engine in this process (baseline), their ratio, client latency percentiles, and the
control-plane overhead (client latency minus the daemon's own validation + copy time).

Output: a table (or ``--json``), a progress bar on stderr, and ``--plot FILE.png`` (needs
matplotlib) of throughput against batch size. Its baseline runs the daemon's engine in-process
(``hicached.copy.engine``); it starts its daemon with ``hicache_bench.daemon``, as benchmarks/
do.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache_bench.daemon import start_daemon
from hicache_client.client import HiCacheClient
from hicache_client.shm import ShmDeviceBuffers
from hicached.copy.engine import TransferEngine
from hicached.core.pool import HostPool, MemoryOptions
from hicached.core.worker_buffers import WorkerBuffers

PRESETS: dict[str, KVGeometry] = {
    "llama3-8b": KVGeometry(PoolKind.MHA, DType.BFLOAT16, 32, 8, 128),
    "llama3-70b-tp8": KVGeometry(PoolKind.MHA, DType.BFLOAT16, 80, 1, 128),
    "qwen2-7b": KVGeometry(PoolKind.MHA, DType.BFLOAT16, 28, 4, 128),
    "deepseek-v3": KVGeometry(PoolKind.MLA, DType.BFLOAT16, 61, kv_lora_rank=512,
                              qk_rope_head_dim=64),
}


@dataclass
class WorkerResult:
    worker: int
    batch_pages: int
    requests: int
    bytes: int
    pages: int
    latencies: list[float]
    server_seconds: list[float]
    start: float
    """time.monotonic() when the worker's first timed request went out (after the barrier)."""
    end: float
    """time.monotonic() when its last one came back."""
    data_path: str = ""
    """``fast`` or ``grpc``: the path its calls took (``HiCacheClient.data_path``)."""


def _worker(target: str, spec: PoolSpec, shm_dir: str, worker: int, batch_pages: int,
            seconds: float, read_ratio: float, queue: Any, barrier: Any,
            fast_path: bool = True) -> None:
    ps = spec.page_size
    client = HiCacheClient(target, fast_path=fast_path)
    rng = np.random.default_rng(worker * 7919 + batch_pages)
    tokens = batch_pages * ps * 2
    with ShmDeviceBuffers.create(spec, tokens, shm_dir, prefix=f"bench{worker}") as bufs:
        for t in bufs.all_tensors():
            t.view(torch.uint8).fill_(worker + 1)
        session = client.open_session(spec.name, f"bench-{worker}", bufs.descriptors)
        host = client.alloc(spec.name, batch_pages * ps)
        dev_pages = torch.from_numpy(rng.permutation(tokens // ps)[:batch_pages])
        dev = (dev_pages[:, None] * ps + torch.arange(ps)).reshape(-1)
        session.backup(host, dev)
        path = client.data_path
        lat: list[float] = []
        srv: list[float] = []
        moved = pages = 0
        barrier.wait()  # every worker set up: they start together
        start = time.monotonic()
        deadline = start + seconds
        while time.monotonic() < deadline:
            op = session.load if rng.random() < read_ratio else session.backup
            t0 = time.perf_counter()
            stats = op(host, dev)
            lat.append(time.perf_counter() - t0)
            srv.append(stats.duration_seconds)
            moved += stats.bytes_moved
            pages += stats.pages
        end = time.monotonic()
        client.free(spec.name, host)
        session.close()
    client.close()
    queue.put(asdict(WorkerResult(worker, batch_pages, len(lat), moved, pages, lat, srv,
                                  start, end, path)))


def _baseline(spec: PoolSpec, batch_pages: int, seconds: float) -> float:
    """GB/s of the in-process engine moving the same batches (same geometry, random pages)."""
    pool = HostPool(spec, MemoryOptions(reserve_bytes=0))
    try:  # the engine (and the views of the pool it plans with) is gone before the close
        return _baseline_on(pool, spec, batch_pages, seconds)
    finally:
        pool.close()


def _baseline_on(pool: HostPool, spec: PoolSpec, batch_pages: int, seconds: float) -> float:
    ps = spec.page_size
    dev = WorkerBuffers.allocate(spec, batch_pages * ps * 2)
    host = pool.alloc(batch_pages * ps)
    rng = np.random.default_rng(batch_pages)
    dp = torch.from_numpy(rng.permutation(2 * batch_pages)[:batch_pages])
    d = (dp[:, None] * ps + torch.arange(ps)).reshape(-1)
    engine = TransferEngine()
    engine.backup(pool, dev, host, d)
    times: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline or len(times) < 3:
        times.append(engine.backup(pool, dev, host, d).seconds)
        times.append(engine.load(pool, dev, host, d).seconds)
    return batch_pages * spec.page_bytes / statistics.median(times) / 1e9


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<24}")
    sys.stderr.flush()


def run(args: argparse.Namespace) -> dict[str, Any]:
    geometry = PRESETS[args.preset]
    batches = [int(b) for b in args.batch_pages.split(",")]
    spec = PoolSpec(f"bench-{args.preset}", geometry, args.page_size, Layout(args.layout),
                    size_tokens=max(batches) * args.page_size * args.workers + args.page_size)
    made: list[str] = []  # every directory made here goes, on any exit (Ctrl-C included)
    proc = None
    client = None
    procs: list[Any] = []
    rows = []
    try:
        work = tempfile.mkdtemp(prefix="hicache-bench-")
        made.append(work)
        shm_dir = args.shm_dir
        if not shm_dir:
            shm_dir = tempfile.mkdtemp(prefix="hicache-bench-", dir="/dev/shm")
            made.append(shm_dir)
        target = args.target
        if target is None:
            proc, target = start_daemon(work, shm_dir, args.memory_budget)
        client = HiCacheClient(target)
        client.create_pool(spec)
        ctx = mp.get_context("spawn")
        for i, bp in enumerate(batches):
            _progress(i, len(batches), f"batch {bp} pages")
            queue, barrier = ctx.Queue(), ctx.Barrier(args.workers)
            procs = [ctx.Process(target=_worker, args=(target, spec, shm_dir, w, bp,
                                                       args.seconds, args.read_ratio, queue,
                                                       barrier, not args.grpc))
                     for w in range(args.workers)]
            for p in procs:
                p.start()
            results = [queue.get(timeout=args.seconds * 10 + 120) for _ in procs]
            for p in procs:
                p.join()
            base = _baseline(spec, bp, min(args.seconds, 2.0))
            lat = np.array([x for r in results for x in r["latencies"]])
            srv = np.array([x for r in results for x in r["server_seconds"]])
            total_bytes = sum(r["bytes"] for r in results)
            # measured: from the first worker's first request to the last one's last reply
            elapsed = max(r["end"] for r in results) - min(r["start"] for r in results)
            rows.append({
                "batch_pages": bp, "batch_bytes": bp * spec.page_bytes, "workers": args.workers,
                "requests": int(lat.size), "elapsed_s": elapsed,
                "gbps": total_bytes / elapsed / 1e9,
                "pages_per_s": sum(r["pages"] for r in results) / elapsed,
                "baseline_gbps": base, "ratio": total_bytes / elapsed / 1e9 / base,
                "p50_ms": float(np.percentile(lat, 50)) * 1e3,
                "p90_ms": float(np.percentile(lat, 90)) * 1e3,
                "p99_ms": float(np.percentile(lat, 99)) * 1e3,
                "control_plane_ms": float(np.median(lat - srv)) * 1e3,
                "data_path": ",".join(sorted({r["data_path"] for r in results})),
            })
        _progress(len(batches), len(batches), "done")
        sys.stderr.write("\n")
        client.delete_pool(spec.name)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(10)
        if client is not None:
            client.close()
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        for d in made:
            shutil.rmtree(d, ignore_errors=True)
    return {"preset": args.preset, "layout": args.layout, "page_size": args.page_size,
            "page_bytes": spec.page_bytes, "read_ratio": args.read_ratio, "rows": rows}


def _print(report: dict[str, Any]) -> None:
    paths = ",".join(sorted({r["data_path"] for r in report["rows"]}))
    print(f"{report['preset']} {report['layout']} page_size {report['page_size']} "
          f"({report['page_bytes'] / 2**20:.2f} MiB/page), read ratio {report['read_ratio']}, "
          f"data calls over {paths}")
    print(f"{'pages':>6}{'workers':>8}{'reqs':>7}{'GB/s':>8}{'pages/s':>10}{'in-proc':>9}"
          f"{'ratio':>7}{'p50 ms':>8}{'p99 ms':>8}{'ctl ms':>8}")
    for r in report["rows"]:
        print(f"{r['batch_pages']:>6}{r['workers']:>8}{r['requests']:>7}{r['gbps']:>8.2f}"
              f"{r['pages_per_s']:>10.0f}{r['baseline_gbps']:>9.2f}{r['ratio']:>7.2f}"
              f"{r['p50_ms']:>8.2f}{r['p99_ms']:>8.2f}{r['control_plane_ms']:>8.2f}")


def _plot(report: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from None
    xs = [r["batch_pages"] for r in report["rows"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [r["gbps"] for r in report["rows"]], marker="o", label="through hicached")
    ax.plot(xs, [r["baseline_gbps"] for r in report["rows"]], marker="s", linestyle="--",
            label="in-process copy")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (pages)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"{report['preset']} {report['layout']} page_size {report['page_size']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="hicache-bench",
                                 description=__doc__.splitlines()[0] if __doc__ else None,
                                 epilog="'hicache-bench compare BASE' compares data-call "
                                        "latency with a base revision ('hicache-bench compare "
                                        "--help'); 'hicache-bench trace TRACE.jsonl' replays a "
                                        "request trace for its hit rate ('hicache-bench trace "
                                        "--help')")
    ap.add_argument("--target", help="connect to this daemon instead of starting one")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    ap.add_argument("--layout", choices=[x.value for x in Layout], default="page_first")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-pages", default="1,4,16,64", help="comma-separated batch sizes")
    ap.add_argument("--seconds", type=float, default=3.0, help="traffic per batch size")
    ap.add_argument("--read-ratio", type=float, default=0.5, help="fraction of loads")
    ap.add_argument("--grpc", action="store_true",
                    help="data calls over gRPC even where the daemon offers its fast path")
    ap.add_argument("--shm-dir", help="worker buffer directory (the daemon's --shm-dir)")
    ap.add_argument("--memory-budget", default="16GiB", help="for a daemon started here")
    ap.add_argument("--json", help="write the report to this file ('-' for stdout)")
    ap.add_argument("--plot", help="write a PNG of throughput vs batch size")
    args = ap.parse_args(argv)
    if not 0 <= args.read_ratio <= 1 or args.workers < 1 or args.seconds <= 0:
        ap.error("need 0 <= --read-ratio <= 1, --workers >= 1, --seconds > 0")
    report = run(args)
    if args.json == "-":
        print(json.dumps(report, indent=2))
    else:
        _print(report)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
    if args.plot:
        _plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
