"""GPU benchmark: backup (D2H) and load (H2D) through the daemon vs a pinned copy_ in one process.

Starts a real daemon process per way GPU copies may go (``--ways``: ``dma``, ``batch``,
``kernel``; each daemon started with ``--cuda-copy-paths`` that way alone, its pools pinned),
makes this process the GPU worker (torch CUDA tensors exported over CUDA IPC) and measures side
by side in one run, alternating, medians:

1. Backup and Load of 64-page batches (32 layers x 8 KV heads x 128 bf16; page sizes 1, 16 and
   64: 8, 128 and 512 MiB; random pages) through the daemon, per host layout and way, in GB/s
   measured at the worker (RPC included), and as a ratio to a plain ``copy_`` of the same
   number of bytes between one pinned host tensor and one device tensor in this process
   (targets: >= 0.9 at page size 64, >= 0.85 at 16, >= 0.7 at 1 in a page-first layout), and
   to the nominal PCIe figure (55 GB/s per direction on H100/H200-class hosts); the daemon's
   CPU time per batch (its process's, read from /proc around each call: target <= 0.5 ms);
   for the kernel, the device time it ran per batch (SM time taken from the engine's own
   kernels, from the daemon's measured rate); a backup and a load at once, as a ratio to one
   direction's bytes per second (target >= 1.5); which way the batches took (the daemon's
   ``hicache_cuda_copy_batches_total``).
2. A load with per-layer events: time until the RPC returns (enqueued), until layer 0 may be
   used, and until the last layer has landed; and the enqueue rate: the batch's driver calls
   (its copy segments) per second of enqueueing, which tells whether thousands of small async
   copies starve the copy engines (then: a gather kernel or batched memcpy).

3. With ``--elastic``: the same batches on a pool under ``[budget] elastic``, whose floor is its
   whole size: locked in 2 MiB units (``core.pin_units``, one registration each, so copies are
   cut where one ends) rather than one registration, measured alternating with the fixed
   pool's rows, as a ratio to them; and what a growth step's registration costs (64 MiB
   locked as 32 units of 2 MiB vs as one registration, and unlocked again).

Run on a host with a GPU: ``python benchmarks/bench_cuda.py [--short] [--elastic]
[--ways dma,batch,kernel] [--json FILE]`` (``--short``: one layout, 5 repetitions, for
scripts/gpu_check.sh).
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
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hicache.specs import Role
from hicache_bench.daemon import start_daemon
from hicache_client import HiCacheClient
from hicache_client.cuda import CudaDeviceBuffers, LayerEvents, ReadyEvent
from hicached import DType, HostPool, KVGeometry, Layout, PoolKind, PoolSpec, TransferEngine
from hicached.core.pool import MemoryOptions
from hicached.core.worker_buffers import Device, RawBuffer, WorkerBuffers
from hicached.cuda.launch import build_table
from hicached.cuda.segments import plan_segments, split_at

PCIE_GBPS = 55.0
GEOMETRY = KVGeometry(PoolKind.MHA, DType.BFLOAT16, 32, 8, 128)
PAGE_SIZES = (1, 16, 64)
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
    """Builds the driver-call segments of every plan (the dma and batch ways) and the page
    kernel's launch table (the kernel way), and copies nothing."""

    def __init__(self) -> None:
        self.calls = 0
        self.seconds = 0.0
        self.table_seconds = 0.0
        self.table_bytes = 0

    def run(self, loading: bool, plans: Any, layers: range, layer_num: int, wait: bool,
            done: Any, registrations: Any) -> None:
        t0 = time.perf_counter()
        self.calls += sum(split_at(plan_segments(p), registrations, not loading).count
                          for p in plans)
        t1 = time.perf_counter()
        table = build_table(plans)
        t2 = time.perf_counter()
        self.seconds += t1 - t0
        self.table_seconds += t2 - t1
        self.table_bytes = table.nbytes
        done()


def plan_only(reps: int, page_size: int, layouts: Sequence[Layout],
              patterns: Sequence[str] = ("random", "consecutive")) -> list[dict[str, Any]]:
    """The daemon's control plane for 64-page backups (no GPU): driver calls and their cost."""
    rows_out = []
    for layout in layouts:
        spec = PoolSpec(f"plan-{layout.value}", GEOMETRY, page_size, layout,
                        size_tokens=BATCH_PAGES * page_size)
        pool = HostPool(spec, MemoryOptions(hugepages=False, reserve_bytes=0))
        device_pages = 4 * BATCH_PAGES
        rows = device_pages * page_size + page_size
        layer_bytes = rows * GEOMETRY.head_num * GEOMETRY.head_dim * 2
        where = Device("cuda", 0)
        bufs = {"kv": {role: [RawBuffer((1 << 40) + (2 * i + r) * layer_bytes,
                                        (rows, GEOMETRY.head_num, GEOMETRY.head_dim),
                                        DType.BFLOAT16, (), where)
                              for i in range(GEOMETRY.layer_num)]
                       for r, role in enumerate((Role.K, Role.V))}}
        device = WorkerBuffers(bufs, "cuda")  # addresses only: nothing is dereferenced
        host = pool.alloc(BATCH_PAGES * page_size)
        engine = TransferEngine(1)
        rng = np.random.default_rng(0)
        for pattern in patterns:
            runner = _CountingRunner()
            totals = []
            for _ in range(reps):
                pages = (rng.permutation(device_pages)[:BATCH_PAGES] if pattern == "random"
                         else np.arange(BATCH_PAGES))
                dev = (pages[:, None] * page_size + np.arange(page_size)).reshape(-1)
                t0 = time.perf_counter()
                engine.backup(pool, device, host, dev, runner=runner)
                totals.append(time.perf_counter() - t0)
            rows_out.append({"layout": layout.value, "pages": pattern, "page_size": page_size,
                             "driver_calls": runner.calls // reps,
                             "segments_ms": 1e3 * runner.seconds / reps,
                             "launch_table_ms": 1e3 * runner.table_seconds / reps,
                             "launch_table_bytes": runner.table_bytes,
                             "control_plane_ms": 1e3 * statistics.median(totals)})
        device.plan_cache.clear()  # its plans hold views of the pool's memory
        pool.close()
    return rows_out


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scraped(client: HiCacheClient, name: str) -> dict[tuple[str, ...], float]:
    """One metric family of the daemon's /metrics: label values -> value."""
    import re
    import urllib.request

    port = client.get_info().metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for m in re.finditer(rf"^{name}{{([^}}]*)}} (\S+)$", text, re.M):
        out[tuple(v for v in re.findall(r'="([^"]*)"', m.group(1)))] = float(m.group(2))
    return out


def measure(client: HiCacheClient, layout: Layout, page_size: int, reps: int,
            driver_calls: int, way: str = "dma", pid: int = 0) -> list[dict[str, Any]]:
    """One layout, page size and way: backup / load GB/s beside a pinned ``copy_`` of the
    same bytes and the daemon's CPU per batch, a backup and a load at once, then a load with
    layer events (enqueue time, layer 0, all layers, enqueue rate)."""
    from concurrent.futures import ThreadPoolExecutor

    device_pages = 4 * BATCH_PAGES
    spec = PoolSpec(f"bench-cuda-{layout.value}-p{page_size}", GEOMETRY, page_size, layout,
                    size_tokens=2 * BATCH_PAGES * page_size)
    pool = client.create_pool(spec)
    bufs = device_buffers(spec, device_pages * page_size)
    for ts in bufs["kv"].values():
        for t in ts:
            t.view(torch.uint8).random_()
    events = LayerEvents(GEOMETRY.layer_num)
    ready = ReadyEvent()
    session = client.open_session(
        spec.name, "bench", CudaDeviceBuffers.from_tensors(bufs).descriptors,
        layer_events=events.handles, ready_event=ready.handle)
    nbytes = BATCH_PAGES * spec.page_bytes
    host = client.alloc(spec.name, BATCH_PAGES * page_size)
    # the layer-event loads read other host pages: such a load returns at enqueue, and the
    # daemon holds its pages until its completion thread sees the copy done, so the next
    # backup into the same pages could be refused (PAGE_BUSY) if it came first
    host_events = client.alloc(spec.name, BATCH_PAGES * page_size)
    host_both = client.alloc(spec.name, BATCH_PAGES * page_size)
    rng = np.random.default_rng(0)
    base_d2h, base_h2d, d2h, h2d, both = [], [], [], [], []
    cpu_d2h, cpu_h2d = [], []
    enq, first, last = [], [], []
    pool_exec = ThreadPoolExecutor(2)
    batches_before = scraped(client, "hicache_cuda_copy_batches_total")
    try:
        torch.cuda.synchronize()
        ready.record()
        session.backup(host_events, torch.arange(BATCH_PAGES * page_size))
        for _ in range(reps):
            pages = rng.permutation(device_pages)[:BATCH_PAGES]
            dev = torch.from_numpy((pages[:, None] * page_size
                                    + np.arange(page_size)).reshape(-1))
            torch.cuda.synchronize()
            ready.record()
            c0, t0 = cpu_seconds(pid) if pid else 0.0, time.perf_counter()
            session.backup(host, dev)
            d2h.append(gbps(nbytes, time.perf_counter() - t0))
            cpu_d2h.append(cpu_seconds(pid) - c0 if pid else 0.0)
            ready.record()
            c0, t0 = cpu_seconds(pid) if pid else 0.0, time.perf_counter()
            session.load(host, dev)
            h2d.append(gbps(nbytes, time.perf_counter() - t0))
            cpu_h2d.append(cpu_seconds(pid) - c0 if pid else 0.0)
            # a backup into other host pages and a load at once: both copy engines (or SMs)
            other = torch.from_numpy((rng.permutation(device_pages)[:BATCH_PAGES, None]
                                      * page_size + np.arange(page_size)).reshape(-1))
            ready.record()
            t0 = time.perf_counter()
            jobs = [pool_exec.submit(session.backup, host_both, other),
                    pool_exec.submit(session.load, host, dev)]
            for j in jobs:
                j.result()
            both.append(gbps(2 * nbytes, time.perf_counter() - t0))
            bd, bh = pinned_copy(nbytes, 1)
            base_d2h += bd
            base_h2d += bh
            ready.record()
            t0 = time.perf_counter()
            session.load(host_events, dev, layer_events=True)
            enq.append(time.perf_counter() - t0)
            events.events[0].synchronize()
            first.append(time.perf_counter() - t0)
            events.events[-1].synchronize()
            last.append(time.perf_counter() - t0)
        batches = {k: v - batches_before.get(k, 0.0)
                   for k, v in scraped(client, "hicache_cuda_copy_batches_total").items()}
        rates = scraped(client, "hicache_cuda_copy_rate_bytes_per_second")
    finally:
        pool_exec.shutdown()
        session.close()
        client.free(spec.name, host)
        client.free(spec.name, host_events)
        client.free(spec.name, host_both)
        client.delete_pool(spec.name)
    took = ",".join(sorted({f"{p}" for (_op, p), n in batches.items() if n > 0}))
    fragment = page_size * GEOMETRY.head_num * GEOMETRY.head_dim * 2
    cls = str(fragment.bit_length() - 1)
    rows: list[dict[str, Any]] = []
    for op, got, base, cpu, name in (("backup (D2H)", d2h, base_d2h, cpu_d2h, "backup"),
                                     ("load (H2D)", h2d, base_h2d, cpu_h2d, "load")):
        g, b = statistics.median(got), statistics.median(base)
        rate = rates.get((name, "kernel", cls), 0.0)
        rows.append({"layout": layout.value, "page_size": page_size, "op": op, "way": way,
                     "took": took, "daemon_gbps": g, "pinned_copy_gbps": b, "ratio": g / b,
                     "vs_pcie": g / PCIE_GBPS,
                     "daemon_cpu_ms": 1e3 * statistics.median(cpu),
                     "sm_ms": 1e3 * nbytes / rate if rate else 0.0,
                     "pool_pinned": pool.pinned_bytes == pool.capacity_bytes})
    one_way = max(statistics.median(d2h), statistics.median(h2d))
    rows.append({"layout": layout.value, "page_size": page_size, "op": "both at once",
                 "way": way, "took": took, "daemon_gbps": statistics.median(both),
                 "vs_one_direction": statistics.median(both) / one_way})
    enqueue = statistics.median(enq)
    rows.append({"layout": layout.value, "page_size": page_size, "op": "load, layer events",
                 "way": way, "enqueue_ms": 1e3 * enqueue,
                 "layer0_ms": 1e3 * statistics.median(first),
                 "all_layers_ms": 1e3 * statistics.median(last), "driver_calls": driver_calls,
                 "calls_per_s": driver_calls / enqueue})
    return rows


ELASTIC_TOML = """
[budget]
elastic = true
pin_unit_bytes = "2MiB"

[[budget.pools]]
pools = "bench-cuda-*"
floor_bytes = "2GiB"
"""
"""Every bench pool's share its whole size (1 GiB at most), locked in 2 MiB units."""


def run(args: argparse.Namespace) -> dict[str, Any]:
    daemons = []
    for way in args.ways:  # one daemon per way, each forced to it
        work = tempfile.mkdtemp(prefix=f"hicache-bench-cuda-{way}-")
        daemons.append((way, *start_daemon(work, "/dev/shm", "24GiB", "127.0.0.1:0",
                                           "--cuda-copy-paths", way)))
    if args.elastic:
        config = os.path.join(work, "elastic.toml")
        with open(config, "w") as f:
            f.write(ELASTIC_TOML)
        eldir = tempfile.mkdtemp(prefix="hicache-bench-cuda-el-")
        daemons.append(("elastic", *start_daemon(eldir, "/dev/shm", "24GiB", "127.0.0.1:0",
                                                 "--config", config)))
    clients = {name: HiCacheClient(target, timeout=600) for name, _, target in daemons}
    pids = {name: proc.pid for name, proc, _ in daemons}
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "rows": []}
    try:
        if args.elastic:
            results["registration"] = registration_cost()
            print_registration(results["registration"])
        for layout in args.layouts:
            for page_size in args.page_sizes:
                calls = plan_only(1, page_size, [layout], ["random"])[0]["driver_calls"]
                group: dict[str, list[dict[str, Any]]] = {}
                for name, client in clients.items():
                    way = "dma" if name == "elastic" else name
                    group[name] = measure(client, layout, page_size, args.reps, calls, way,
                                          pids[name])
                    for row in group[name]:
                        row["pool"] = "elastic" if name == "elastic" else "fixed"
                    results["rows"] += group[name]
                for way in args.ways:
                    print_row_group(group[way])
                if args.elastic:
                    print_elastic(group["elastic"], group["dma"])
    finally:
        for c in clients.values():
            c.close()
        for _, proc, _ in daemons:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    return results


def registration_cost(step: int = 64 << 20, unit: int = 2 << 20, reps: int = 5
                      ) -> dict[str, float]:
    """What locking a growth step costs: ``step`` bytes of a prefaulted region registered as
    units of ``unit`` and as one, then unregistered; medians of ``reps``, alternating."""
    from hicache.cuda_driver import load_driver
    from hicached.core.memory import HostMemory
    from hicached.cuda.pinner import DriverPinner

    driver = load_driver()
    assert driver is not None
    pinner = DriverPinner(driver)
    mem = HostMemory(step, hugepages=False, prefault_threads=1)
    out: dict[str, list[float]] = {"units_lock_ms": [], "units_unlock_ms": [],
                                   "one_lock_ms": [], "one_unlock_ms": []}
    try:
        for _ in range(reps):
            for name, size in (("units", unit), ("one", step)):
                t0 = time.perf_counter()
                for off in range(0, step, size):
                    mem.pin_range(pinner, off, size)
                t1 = time.perf_counter()
                for off in range(0, step, size):
                    mem.unpin_range(off)
                t2 = time.perf_counter()
                out[f"{name}_lock_ms"].append(1e3 * (t1 - t0))
                out[f"{name}_unlock_ms"].append(1e3 * (t2 - t1))
    finally:
        mem.close()
    return {"step_bytes": step, "unit_bytes": unit,
            **{k: statistics.median(v) for k, v in out.items()}}


def print_registration(r: dict[str, float]) -> None:
    step, unit = int(r["step_bytes"]), int(r["unit_bytes"])
    print(f"growth step of {step >> 20} MiB: locked as {step // unit}"
          f" units of {unit >> 20} MiB {r['units_lock_ms']:.2f} ms (unlocked "
          f"{r['units_unlock_ms']:.2f} ms), as one registration {r['one_lock_ms']:.2f} ms "
          f"(unlocked {r['one_unlock_ms']:.2f} ms)", flush=True)


def print_elastic(rows: list[dict[str, Any]], fixed: list[dict[str, Any]]) -> None:
    for row, base in zip(rows, fixed, strict=True):
        where = f"{row['layout']:>18} p{row['page_size']:<3}"
        if "daemon_gbps" in row:
            print(f"{where} {row['op']:<13} elastic {row['daemon_gbps']:6.1f} GB/s  "
                  f"fixed {base['daemon_gbps']:6.1f} GB/s  ratio "
                  f"{row['daemon_gbps'] / base['daemon_gbps']:.2f}  (2 MiB units, all locked:"
                  f" {row['pool_pinned']})", flush=True)


def print_row_group(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        where = f"{row['layout']:>18} p{row['page_size']:<3} {row['way']:<6}"
        if "vs_one_direction" in row:
            print(f"{where} {row['op']:<13} daemon {row['daemon_gbps']:6.1f} GB/s"
                  f"  {row['vs_one_direction']:.2f}x one direction  (took {row['took']})")
        elif "daemon_gbps" in row:
            print(f"{where} {row['op']:<13} daemon {row['daemon_gbps']:6.1f} GB/s"
                  f"  pinned copy_ {row['pinned_copy_gbps']:6.1f} GB/s"
                  f"  ratio {row['ratio']:.2f}  of PCIe {row['vs_pcie']:.2f}"
                  f"  daemon CPU {row['daemon_cpu_ms']:.2f} ms/batch"
                  + (f"  SM {row['sm_ms']:.2f} ms/batch" if row["sm_ms"] else ""))
        else:
            print(f"{where} {row['op']:<13} enqueued {row['enqueue_ms']:.2f} ms "
                  f"({row['driver_calls']} calls, {row['calls_per_s'] / 1e3:.0f}k calls/s),"
                  f" layer 0 ready {row['layer0_ms']:.2f} ms, all {row['all_layers_ms']:.2f} ms",
                  flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--short", action="store_true",
                   help="layer_first only, 5 repetitions (the GPU check's short mode)")
    p.add_argument("--quick", action="store_true", help="3 repetitions")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--page-sizes", default=",".join(map(str, PAGE_SIZES)))
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument("--elastic", action="store_true",
                   help="also on a pool locked in 2 MiB units (elastic), and the registration cost")
    p.add_argument("--ways", default="dma,batch,kernel",
                   help="the ways to measure, a daemon each (cuda_copy_paths)")
    p.add_argument("--plan-only", action="store_true",
                   help="control plane only (no GPU needed): driver calls and their cost")
    args = p.parse_args(argv)
    args.page_sizes = [int(x) for x in args.page_sizes.split(",")]
    args.ways = [w for w in args.ways.split(",") if w]
    if args.elastic and "dma" not in args.ways:
        p.error("--elastic compares with the dma way: keep it in --ways")
    args.layouts = [Layout.LAYER_FIRST] if args.short else list(Layout)
    args.reps = 3 if args.quick else 5 if args.short else args.reps
    if args.plan_only:
        rows = [r for ps in args.page_sizes for r in plan_only(args.reps, ps, args.layouts)]
        print(f"{BATCH_PAGES}-page backups, {GEOMETRY.layer_num} layers x K/V; validation + "
              "plans + segments, medians")
        for row in rows:
            print(f"{row['layout']:>18} p{row['page_size']:<3} {row['pages']:<12} "
                  f"{row['driver_calls']:6d} driver calls  segments {row['segments_ms']:.2f} ms"
                  f"  launch table {row['launch_table_ms']:.3f} ms "
                  f"({row['launch_table_bytes']} B)"
                  f"  control plane {row['control_plane_ms']:.2f} ms")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=2)
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    print(f"GPU: {torch.cuda.get_device_name()}; {BATCH_PAGES}-page batches of "
          f"{GEOMETRY.layer_num} layers x 8 x 128 bf16, page sizes {args.page_sizes}; medians "
          f"of {args.reps}; PCIe nominal {PCIE_GBPS} GB/s", flush=True)
    r = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
