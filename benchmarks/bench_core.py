"""Core engine benchmark: the copy engine vs a plain contiguous copy of the same bytes.

Everything is measured side by side in one run and reported as medians over repetitions that
alternate the engine and the baseline, so machine noise hits both alike.

1. Backup / load throughput of random (uncoalescible) page batches for layer_first,
   page_first and page_first_direct at page_size 64, 16 and 1, as a ratio to a contiguous copy
   of the same bytes between two prefaulted buffers by the engine's own streaming kernel, on the
   same threads (targets: >= 0.85 at page_size 64, >= 0.6 at 1 and 16). Beside it, for the same
   contiguous bytes, ``np.copyto`` (one thread) and torch's ``copy_`` (torch's threads, set to
   the copy threads for that call): other ways to copy, named as what they are. torch stays on
   one thread otherwise: its OpenMP workers spin after each op and would steal the cores from
   whichever side runs next. "ids ratio": the same copies named by page ids (what the fast
   path sends, validated natively) instead of token indices, against the same baseline.
2. Control-plane cost (validation + plan) of a 65,536-index batch vs its copy time (< 2 %).
3. Prefault rate of a 4 GiB pool vs a naive single-threaded first touch (>= 4x).
4. Pool memory: the same backup / load into a pool in a tmpfs file (a state directory, the
   default) and in anonymous memory (``state_dir = ""``), alternated; the ratio says what restart
   survival costs the copies on this host's ``shmem_enabled`` setting.

Run: ``python benchmarks/bench_core.py [--quick] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hicache.indices import PageIds
from hicached import DType, HostPool, KVGeometry, Layout, PoolKind, PoolSpec, WorkerBuffers
from hicached.copy.cpu import execute
from hicached.copy.engine import TransferEngine
from hicached.copy.native import native_available
from hicached.copy.plan import CopyPlan
from hicached.core.memory import HostMemory
from hicached.core.pool import MemoryOptions
from hicached.core.validation import validate_transfer

GEOMETRY = KVGeometry(PoolKind.MHA, DType.BFLOAT16, layer_num=32, head_num=8, head_dim=128)
OPTIONS = MemoryOptions(reserve_bytes=0)


def naive_first_touch(nbytes: int) -> float:
    """Seconds for a single-threaded first touch of a fresh private mapping without huge pages.

    The reference point the prefault rows compare against.
    """
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            mm.madvise(mmap.MADV_NOHUGEPAGE)
        arr = np.frombuffer(mm, dtype=np.uint8)
        t0 = time.perf_counter()
        ctypes.memset(int(arr.ctypes.data), 0, nbytes)
        elapsed = time.perf_counter() - t0
        del arr
        return elapsed
    finally:
        mm.close()


def median_time(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired(fn_a: Callable[[], object], fn_b: Callable[[], object], reps: int
           ) -> tuple[float, float]:
    """Median seconds of a and b, measured alternately."""
    fn_a()
    fn_b()
    ta, tb = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn_a()
        t1 = time.perf_counter()
        fn_b()
        t2 = time.perf_counter()
        ta.append(t1 - t0)
        tb.append(t2 - t1)
    return statistics.median(ta), statistics.median(tb)


def contiguous_copy(dst: torch.Tensor, src: torch.Tensor, threads: int) -> Callable[[], object]:
    """The engine's streaming kernel copying src into dst, one contiguous share per thread (it
    coalesces consecutive pages, so each thread runs one streaming copy)."""
    chunk = 1 << 16
    assert src.numel() % chunk == 0
    plan = CopyPlan(np.array([dst.data_ptr()], np.int64), np.array([src.data_ptr()], np.int64),
                    np.arange(src.numel() // chunk, dtype=np.int64),
                    np.arange(src.numel() // chunk, dtype=np.int64), chunk, 1, chunk, chunk,
                    chunk, chunk)
    return lambda: execute(plan, threads)


def torch_copy(dst: torch.Tensor, src: torch.Tensor, threads: int) -> None:
    """torch's ``copy_`` on ``threads`` intra-op threads (back to one after, see main)."""
    torch.set_num_threads(threads)
    try:
        dst.copy_(src)
    finally:
        torch.set_num_threads(1)


def page_idx(pages: np.ndarray, ps: int) -> torch.Tensor:
    return torch.from_numpy((pages[:, None] * ps + np.arange(ps)).reshape(-1))


def throughput_rows(page_size: int, batch_pages: int, reps: int, engine: TransferEngine,
                    layouts: list[Layout]) -> list[dict[str, Any]]:
    rows = []
    for layout in layouts:
        rows += _layout_rows(layout, page_size, batch_pages, reps, engine)
    return rows


def _layout_rows(layout: Layout, page_size: int, batch_pages: int, reps: int,
                 engine: TransferEngine) -> list[dict[str, Any]]:
    pool_pages = batch_pages * 4
    dev_tokens = batch_pages * 4 * page_size
    spec = PoolSpec("bench", GEOMETRY, page_size, layout, size_tokens=pool_pages * page_size)
    pool = HostPool(spec, OPTIONS)
    dev = WorkerBuffers.allocate(spec, dev_tokens)
    for t in dev.all_tensors():
        t.view(torch.uint8).fill_(7)
    host = pool.alloc(pool_pages * page_size)
    rng = np.random.default_rng(page_size)
    hp = rng.permutation(pool_pages)[:batch_pages]
    dp = rng.permutation(dev_tokens // page_size)[:batch_pages]
    h_idx = host.reshape(-1, page_size)[torch.from_numpy(hp)].reshape(-1)
    d_idx = page_idx(dp, page_size)
    nbytes = batch_pages * spec.page_bytes
    src = torch.full((nbytes,), 3, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    base = contiguous_copy(dst, src, engine.threads)
    rows = []
    dn, sn = dst.numpy(), src.numpy()  # the same contiguous bytes, other copiers
    t_np, t_torch = paired(lambda: np.copyto(dn, sn),
                           lambda: torch_copy(dst, src, engine.threads), reps)
    hp_ids = (h_idx[::page_size] // page_size).numpy()
    dp_ids = np.ascontiguousarray(dp, dtype=np.int64)
    for op, fn in (("backup", engine.backup), ("load", engine.load)):
        def run(fn: Callable[..., object] = fn) -> object:
            return fn(pool, dev, h_idx, d_idx)

        def run_ids(fn: Callable[..., object] = fn) -> object:
            return fn(pool, dev, PageIds(hp_ids), PageIds(dp_ids))

        t_eng, t_base = paired(run, base, reps)
        t_ids, t_base_ids = paired(run_ids, base, reps)
        rows.append({
            "layout": layout.value, "page_size": page_size, "batch_pages": batch_pages,
            "batch_tokens": batch_pages * page_size, "op": op, "bytes": nbytes,
            "engine_gbps": nbytes / t_eng / 1e9, "baseline_gbps": nbytes / t_base / 1e9,
            "numpy_copyto_gbps": nbytes / t_np / 1e9, "torch_copy_gbps": nbytes / t_torch / 1e9,
            "ratio": t_base / t_eng, "page_ids_ratio": t_base_ids / t_ids,
        })
    pool.close()
    return rows


def control_plane(engine: TransferEngine, reps: int) -> dict[str, Any]:
    """A 65,536-index batch on an 8-layer geometry (2 GiB per side)."""
    geometry = KVGeometry(PoolKind.MHA, DType.BFLOAT16, layer_num=8, head_num=8, head_dim=128)
    ps, n = 64, 65536
    spec = PoolSpec("cp", geometry, ps, Layout.LAYER_FIRST, size_tokens=n)
    pool = HostPool(spec, OPTIONS)
    dev = WorkerBuffers.allocate(spec, n)
    host = pool.alloc(n)
    rng = np.random.default_rng(1)
    h_idx = host.reshape(-1, ps)[torch.from_numpy(rng.permutation(n // ps))].reshape(-1)
    d_idx = page_idx(rng.permutation(n // ps), ps)
    t_validate = median_time(lambda: validate_transfer(
        host_indices=h_idx, device_indices=d_idx, page_size=ps, host_tokens=n,
        device_tokens=n + ps, layer_num=8, layer_begin=0, layer_end=0, writes_host=True,
        raw_state=pool.allocator.raw_state), reps * 3)
    results = [engine.backup(pool, dev, h_idx, d_idx) for _ in range(reps)]
    copy = statistics.median(r.copy_seconds for r in results)
    control = statistics.median(r.validate_seconds for r in results)
    pool.close()
    return {"indices": n, "validate_seconds": t_validate, "validate_and_plan_seconds": control,
            "copy_seconds": copy, "validate_fraction": t_validate / copy,
            "control_fraction": control / copy}


def prefault(reps: int, nbytes: int) -> dict[str, Any]:
    """Each measurement starts right after releasing an equal region, so neither method pays
    the hypervisor's first touch of guest memory and both see the same free-page state."""
    def warm() -> None:
        HostMemory(nbytes).close()

    ours, naive = [], []
    for _ in range(reps):
        warm()
        naive.append(naive_first_touch(nbytes))
        warm()
        m = HostMemory(nbytes)
        ours.append(m.prefault_seconds)
        m.close()
    t_ours, t_naive = statistics.median(ours), statistics.median(naive)
    return {"bytes": nbytes, "ours_gbps": nbytes / t_ours / 1e9,
            "naive_gbps": nbytes / t_naive / 1e9, "ratio": t_naive / t_ours}


def backing(engine: TransferEngine, reps: int) -> dict[str, Any]:
    """Backup / load of 64 pages (page 64, layer_first) into a pool in anonymous memory (what
    ``state_dir = ""`` gives: transparent huge pages) and into the same pool in a tmpfs file
    (a state directory on /dev/shm: the default), alternated; GB/s and the tmpfs / anonymous
    ratio."""
    pages, ps = 64, 64
    spec = PoolSpec("bench", GEOMETRY, ps, Layout.LAYER_FIRST, size_tokens=ps * pages)
    state = tempfile.mkdtemp(prefix="hicache-bench-state-", dir="/dev/shm")
    pools = {"anonymous": HostPool(spec, OPTIONS),
             "tmpfs": HostPool(spec, MemoryOptions(reserve_bytes=0, state_dir=state))}
    dev = WorkerBuffers.allocate(spec, pages * ps)
    idx = torch.arange(pages * ps)
    times: dict[str, list[float]] = {}
    try:
        for p in pools.values():
            p.alloc(pages * ps)
        for _ in range(reps):
            for name, pool in pools.items():
                for op, fn in (("backup", engine.backup), ("load", engine.load)):
                    t0 = time.perf_counter()
                    fn(pool, dev, idx, idx)
                    times.setdefault(f"{name}_{op}", []).append(time.perf_counter() - t0)
    finally:
        for p in pools.values():
            p.close()
        shutil.rmtree(state, ignore_errors=True)
    nbytes = pages * spec.page_bytes
    out: dict[str, Any] = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
        out["shmem_enabled"] = f.read().split("[")[1].split("]")[0]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, smaller pool")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--threads", type=int, default=0, help="copy threads (0 = all CPUs)")
    args = ap.parse_args(argv)
    reps = 3 if args.quick else 9
    torch.set_num_threads(1)
    engine = TransferEngine(threads=args.threads)
    print(f"native kernel: {native_available()}, copy threads: {engine.threads}, "
          f"geometry: 32 layers x 8 heads x 128 bf16")
    layouts = list(Layout)
    rows: list[dict[str, Any]] = []
    for ps in (64, 16, 1):
        rows += throughput_rows(ps, 64, reps, engine, layouts)
    for ps in (16, 1):
        rows += throughput_rows(ps, 4096 // ps, reps, engine, layouts)
    print(f"\n{'layout':<18}{'page':>5}{'pages':>7}{'MiB':>7}  {'op':<7}"
          f"{'engine GB/s':>12}{'stream GB/s':>12}{'ratio':>7}{'np.copyto':>10}"
          f"{'torch copy_':>12}{'ids ratio':>10}")
    for r in rows:
        print(f"{r['layout']:<18}{r['page_size']:>5}{r['batch_pages']:>7}"
              f"{r['bytes'] / 2**20:>7.0f}  {r['op']:<7}{r['engine_gbps']:>12.2f}"
              f"{r['baseline_gbps']:>12.2f}{r['ratio']:>7.2f}{r['numpy_copyto_gbps']:>10.2f}"
              f"{r['torch_copy_gbps']:>12.2f}{r['page_ids_ratio']:>10.2f}")
    print("stream = the engine's own streaming kernel on a contiguous copy of the same bytes "
          "(the ratio's baseline); np.copyto = numpy, one thread; torch copy_ = torch on the "
          "copy threads")
    cp = control_plane(engine, reps)
    print(f"\ncontrol plane, {cp['indices']} indices: validate {cp['validate_seconds'] * 1e3:.2f} "
          f"ms, validate+plan {cp['validate_and_plan_seconds'] * 1e3:.2f} ms, copy "
          f"{cp['copy_seconds'] * 1e3:.1f} ms -> {cp['validate_fraction'] * 100:.2f} % "
          f"({cp['control_fraction'] * 100:.2f} % with planning)")
    pf = prefault(3 if args.quick else 5, (1 << 30) if args.quick else (4 << 30))
    print(f"prefault {pf['bytes'] >> 20} MiB: ours {pf['ours_gbps']:.2f} GB/s, naive single-thread "
          f"first touch {pf['naive_gbps']:.2f} GB/s -> {pf['ratio']:.1f}x")
    bk = backing(engine, reps)
    print(f"pool memory (64 x 8 MiB pages, layer_first; shmem THP: {bk['shmem_enabled']}): "
          f"backup anonymous {bk['anonymous_backup']:.2f} / tmpfs {bk['tmpfs_backup']:.2f} GB/s "
          f"({bk['tmpfs_backup'] / bk['anonymous_backup']:.2f}), load anonymous "
          f"{bk['anonymous_load']:.2f} / tmpfs {bk['tmpfs_load']:.2f} GB/s "
          f"({bk['tmpfs_load'] / bk['anonymous_load']:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"throughput": rows, "control_plane": cp, "prefault": pf,
                       "backing": bk}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
