"""GPU benchmark: backup (D2H) and load (H2D) through the daemon vs a pinned copy_ in one process.

Starts a real daemon process (its pools pinned), makes this process the GPU worker (torch CUDA
tensors exported over CUDA IPC) and measures side by side in one run, alternating, medians:

1. Backup and Load of 64-page batches (32 layers x 8 KV heads x 128 bf16, page_size 64: 512 MiB,
   random pages) through the daemon, per host layout, in GB/s measured at the worker (RPC
   included), and as a ratio to a plain ``copy_`` of the same number of bytes between one pinned
   host tensor and one device tensor in this process (target >= 0.9), and to the nominal PCIe
   figure (55 GB/s per direction on H100/H200-class hosts).
2. A load with per-layer events: time until the RPC returns (enqueued), until layer 0 may be
   used, and until the last layer has landed.

Run on a host with a GPU: ``python benchmarks/bench_cuda.py [--quick] [--json FILE]``.
``--plan-only`` runs anywhere: the daemon's control plane for the same batches (validation,
copy plans, driver-call segments) with a runner that copies nothing, reporting how many driver
calls each layout needs and what building them costs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

from hicache.specs import Role
from hicache_client import HiCacheClient
from hicache_client.cuda import CudaDeviceBuffers, LayerEvents, ReadyEvent
from hicached import DType, HostPool, KVGeometry, Layout, PoolKind, PoolSpec, TransferEngine
from hicached.bench import start_daemon
from hicached.core.pool import MemoryOptions
from hicached.core.worker_buffers import RawBuffer, WorkerBuffers
from hicached.cuda.segments import plan_segments

PCIE_GBPS = 55.0
GEOMETRY = KVGeometry(PoolKind.MHA, DType.BFLOAT16, 32, 8, 128)
PAGE_SIZE = 64
BATCH_PAGES = 64


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def pinned_copy(nbytes: int, reps: int) -> tuple[list[float], list[float]]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    d2h, h2d = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        d2h.append(gbps(nbytes, time.perf_counter() - t0))
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        h2d.append(gbps(nbytes, time.perf_counter() - t0))
    return d2h, h2d


def device_buffers(spec: PoolSpec, tokens: int) -> dict[str, dict[Role, list[torch.Tensor]]]:
    """SGLang's MHA device pool: per layer a (tokens + page_size, heads, dim) tensor."""
    rows = tokens + spec.page_size
    return {"kv": {role: [torch.empty((rows, GEOMETRY.head_num, GEOMETRY.head_dim),
                                      dtype=torch.bfloat16, device="cuda")
                          for _ in range(GEOMETRY.layer_num)] for role in (Role.K, Role.V)}}


class _CountingRunner:
    """Builds the driver-call segments of every plan and copies nothing."""

    def __init__(self) -> None:
        self.calls = 0
        self.seconds = 0.0

    def run(self, loading: bool, plans: Any, layers: range, layer_num: int, wait: bool,
            done: Any) -> None:
        t0 = time.perf_counter()
        self.calls += sum(plan_segments(p).count for p in plans)
        self.seconds += time.perf_counter() - t0
        done()


def plan_only(reps: int) -> list[dict[str, Any]]:
    rows_out = []
    for layout in Layout:
        spec = PoolSpec(f"plan-{layout.value}", GEOMETRY, PAGE_SIZE, layout,
                        size_tokens=BATCH_PAGES * PAGE_SIZE)
        pool = HostPool(spec, MemoryOptions(hugepages=False, reserve_bytes=0))
        device_pages = 4 * BATCH_PAGES
        rows = device_pages * PAGE_SIZE + PAGE_SIZE
        layer_bytes = rows * GEOMETRY.head_num * GEOMETRY.head_dim * 2
        where = torch.device("cuda", 0)
        bufs = {"kv": {role: [RawBuffer((1 << 40) + (2 * i + r) * layer_bytes,
                                        (rows, GEOMETRY.head_num, GEOMETRY.head_dim),
                                        torch.bfloat16, (), where)
                              for i in range(GEOMETRY.layer_num)]
                       for r, role in enumerate((Role.K, Role.V))}}
        device = WorkerBuffers(bufs, "cuda")  # addresses only: nothing is dereferenced
        host = pool.alloc(BATCH_PAGES * PAGE_SIZE)
        engine = TransferEngine(1)
        rng = np.random.default_rng(0)
        for pattern in ("random", "consecutive"):
            runner = _CountingRunner()
            totals = []
            for _ in range(reps):
                pages = (rng.permutation(device_pages)[:BATCH_PAGES] if pattern == "random"
                         else np.arange(BATCH_PAGES))
                dev = (pages[:, None] * PAGE_SIZE + np.arange(PAGE_SIZE)).reshape(-1)
                t0 = time.perf_counter()
                engine.backup(pool, device, host, dev, runner=runner)
                totals.append(time.perf_counter() - t0)
            rows_out.append({"layout": layout.value, "pages": pattern,
                             "driver_calls": runner.calls // reps,
                             "segments_ms": 1e3 * runner.seconds / reps,
                             "control_plane_ms": 1e3 * statistics.median(totals)})
        pool.close()
    return rows_out


def run(args: argparse.Namespace) -> dict[str, Any]:
    reps = 3 if args.quick else args.reps
    work = tempfile.mkdtemp(prefix="hicache-bench-cuda-")
    proc, target = start_daemon(work, "/dev/shm", "24GiB")
    client = HiCacheClient(target, timeout=600)
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "rows": []}
    try:
        device_pages = 4 * BATCH_PAGES
        tokens = device_pages * PAGE_SIZE
        layouts = [Layout.LAYER_FIRST] if args.quick else list(Layout)
        for layout in layouts:
            spec = PoolSpec(f"bench-cuda-{layout.value}", GEOMETRY, PAGE_SIZE, layout,
                            size_tokens=2 * BATCH_PAGES * PAGE_SIZE)
            pool = client.create_pool(spec)
            bufs = device_buffers(spec, tokens)
            for ts in bufs["kv"].values():
                for t in ts:
                    t.view(torch.uint8).random_()
            events = LayerEvents(GEOMETRY.layer_num)
            ready = ReadyEvent()
            session = client.open_session(
                spec.name, "bench", CudaDeviceBuffers.from_tensors(bufs).descriptors,
                layer_events=events.handles, ready_event=ready.handle)
            nbytes = BATCH_PAGES * spec.page_bytes
            host = client.alloc(spec.name, BATCH_PAGES * PAGE_SIZE)
            rng = np.random.default_rng(0)
            base_d2h, base_h2d, d2h, h2d = [], [], [], []
            enq, first, last = [], [], []
            for _ in range(reps):
                pages = rng.permutation(device_pages)[:BATCH_PAGES]
                dev = torch.from_numpy((pages[:, None] * PAGE_SIZE
                                        + np.arange(PAGE_SIZE)).reshape(-1))
                torch.cuda.synchronize()
                ready.record()
                t0 = time.perf_counter()
                session.backup(host, dev)
                d2h.append(gbps(nbytes, time.perf_counter() - t0))
                ready.record()
                t0 = time.perf_counter()
                session.load(host, dev)
                h2d.append(gbps(nbytes, time.perf_counter() - t0))
                bd, bh = pinned_copy(nbytes, 1)
                base_d2h += bd
                base_h2d += bh
                ready.record()
                t0 = time.perf_counter()
                session.load(host, dev, layer_events=True)
                enq.append(time.perf_counter() - t0)
                events.events[0].synchronize()
                first.append(time.perf_counter() - t0)
                events.events[-1].synchronize()
                last.append(time.perf_counter() - t0)
            session.close()
            client.free(spec.name, host)
            client.delete_pool(spec.name)
            for op, got, base in (("backup (D2H)", d2h, base_d2h), ("load (H2D)", h2d, base_h2d)):
                g, b = statistics.median(got), statistics.median(base)
                results["rows"].append({
                    "layout": layout.value, "op": op, "daemon_gbps": g, "pinned_copy_gbps": b,
                    "ratio": g / b, "vs_pcie": g / PCIE_GBPS,
                    "pool_pinned": pool.pinned_bytes == pool.capacity_bytes})
            results["rows"].append({
                "layout": layout.value, "op": "load, layer events",
                "enqueue_ms": 1e3 * statistics.median(enq),
                "layer0_ms": 1e3 * statistics.median(first),
                "all_layers_ms": 1e3 * statistics.median(last)})
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one layout, 3 repetitions")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument("--plan-only", action="store_true",
                   help="control plane only (no GPU needed): driver calls and their cost")
    args = p.parse_args(argv)
    if args.plan_only:
        rows = plan_only(3 if args.quick else args.reps)
        print(f"{BATCH_PAGES}-page backups, {GEOMETRY.layer_num} layers x K/V, page_size "
              f"{PAGE_SIZE}; validation + plans + segments, medians")
        for row in rows:
            print(f"{row['layout']:>18} {row['pages']:<12} {row['driver_calls']:6d} driver "
                  f"calls  segments {row['segments_ms']:.2f} ms  control plane "
                  f"{row['control_plane_ms']:.2f} ms")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=2)
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    r = run(args)
    print(f"GPU: {r['gpu']}; {BATCH_PAGES}-page batches of {GEOMETRY.layer_num} layers x 8 x "
          f"128 bf16, page_size {PAGE_SIZE}; medians; PCIe nominal {PCIE_GBPS} GB/s")
    for row in r["rows"]:
        if "daemon_gbps" in row:
            print(f"{row['layout']:>18} {row['op']:<13} daemon {row['daemon_gbps']:6.1f} GB/s"
                  f"  pinned copy_ {row['pinned_copy_gbps']:6.1f} GB/s"
                  f"  ratio {row['ratio']:.2f}  of PCIe {row['vs_pcie']:.2f}")
        else:
            print(f"{row['layout']:>18} {row['op']:<13} enqueued {row['enqueue_ms']:.2f} ms,"
                  f" layer 0 ready {row['layer0_ms']:.2f} ms, all {row['all_layers_ms']:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
