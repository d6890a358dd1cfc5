"""Disk tier throughput beside ``dd`` moving the same number of bytes in the same directory.

One pool's pages (8 MiB each: MHA, 32 layers, 8 heads x 128, bf16, page 64, layer_first: 64
runs of 128 KiB per page, as the pool lays them out) are written to a ``DiskTier`` and read
back into the pool in batches of 8 (``write_many`` / ``read_many``, as the spiller and a
LoadKeys promotion do; 2 I/O threads), checksums computed and checked (xxh3-64), and beside
each, in the same
run and directory, ``dd`` moves a file of as many bytes with the same block size:

- write, ``fsync = "batch"`` (the default: every page on the device before its record) vs
  ``dd oflag=dsync`` (every block synced);
- write, ``fsync = "never"`` + one fdatasync at the end vs ``dd conv=fdatasync``;
- read with O_DIRECT (the device, not the page cache) vs ``dd iflag=direct``;
- read buffered (what the page cache holds after the writes) vs ``dd`` buffered.

The ratio is tier GB/s over dd GB/s (target >= 0.8). Every timed step starts after a
``sync`` (nothing dirty left by the step before). Medians of ``--reps``.

Run: ``python benchmarks/bench_disk.py [--dir DIR] [--pages 128] [--reps 3] [--json F]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from hicached import DType, HostPool, KVGeometry, Layout, PoolKind, PoolSpec
from hicached.core.pool import MemoryOptions
from hicached.tiers.disk import DiskTier

GEOMETRY = KVGeometry(PoolKind.MHA, DType.BFLOAT16, layer_num=32, head_num=8, head_dim=128)
BATCH = 8  # pages per write_many / read_many (the tier's io_threads, 2, move them)


def dd(*args: str) -> float:
    os.sync()  # every timed step starts with nothing dirty in the page cache
    t0 = time.perf_counter()
    subprocess.run(["dd", *args, "status=none"], check=True)
    return time.perf_counter() - t0


def tier_write(pool: HostPool, d: str, pages: int, fsync: str, o_direct: bool) -> float:
    t = DiskTier(d, "bench", {"spec": "bench"}, pool.spec.page_bytes, pages, fsync=fsync,
                 o_direct=o_direct)
    t.open()
    os.sync()
    t0 = time.perf_counter()
    for p in range(0, pages, BATCH):  # as the spiller: batches, io_threads at a time
        assert all(t.write_many([(b"k%d" % q, pool.page_views(q))
                                 for q in range(p, min(p + BATCH, pages))]))
    if fsync == "never":
        os.fdatasync(t._data_fd)
    dt = time.perf_counter() - t0
    t.close()
    return dt


def tier_read(pool: HostPool, d: str, pages: int, o_direct: bool) -> float:
    t = DiskTier(d, "bench", {"spec": "bench"}, pool.spec.page_bytes, pages, o_direct=o_direct)
    assert t.open() == "reattached"
    os.sync()
    t0 = time.perf_counter()
    for p in range(0, pages, BATCH):  # as a LoadKeys promotion of a batch
        assert all(t.read_many([(b"k%d" % q, pool.page_views(q))
                                for q in range(p, min(p + BATCH, pages))])), "checksum"
    dt = time.perf_counter() - t0
    t.close()
    return dt


def run(args: argparse.Namespace) -> dict[str, Any]:
    n = args.pages
    spec = PoolSpec("bench", GEOMETRY, 64, Layout.LAYER_FIRST, size_tokens=64 * n)
    pool = HostPool(spec, MemoryOptions(reserve_bytes=0))
    rng = np.random.default_rng(0)
    raw = pool.raw_bytes()
    for off in range(0, raw.size, 1 << 26):
        raw[off:off + (1 << 26)] = rng.integers(0, 256, min(1 << 26, raw.size - off),
                                                dtype=np.uint8)
    work = Path(tempfile.mkdtemp(prefix="hicache-bench-disk-", dir=args.dir))
    page = spec.page_bytes
    total = n * page
    src = Path(tempfile.mkdtemp(prefix="hicache-bench-src-", dir="/dev/shm")) / "src.bin"
    src.write_bytes(raw[:total].tobytes())  # dd reads the same bytes from memory
    ddf = work / "dd.bin"
    bs = f"bs={page}"
    res: dict[str, list[float]] = {k: [] for k in (
        "tier_write_batch", "dd_write_dsync", "tier_write_never", "dd_write_fdatasync",
        "tier_read_direct", "dd_read_direct", "tier_read_cached", "dd_read_cached")}
    try:
        for _ in range(args.reps):
            shutil.rmtree(work / "b", ignore_errors=True)
            # each pair in both orders over the reps: this VM's disk is noisy and a write
            # right after many syncs can run slower, whoever does it
            for label, dd_label, fsync, flag in (
                    ("tier_write_never", "dd_write_fdatasync", "never", "conv=fdatasync"),
                    ("tier_write_batch", "dd_write_dsync", "batch", "oflag=dsync")):
                for which in (("tier", "dd") if _ % 2 else ("dd", "tier")):
                    if which == "tier":
                        res[label].append(tier_write(pool, str(work / label), n, fsync, False))
                    else:
                        ddf.unlink(missing_ok=True)
                        res[dd_label].append(dd(f"if={src}", f"of={ddf}", bs, f"count={n}",
                                                flag))
                shutil.rmtree(work / label, ignore_errors=True)
            ddf.unlink(missing_ok=True)
            dd(f"if={src}", f"of={ddf}", bs, f"count={n}", "conv=fdatasync")  # the read file
            tier_write(pool, str(work / "b"), n, "never", False)
            res["tier_read_direct"].append(tier_read(pool, str(work / "b"), n, True))
            res["dd_read_direct"].append(dd(f"if={ddf}", "of=/dev/null", bs, "iflag=direct"))
            res["tier_read_cached"].append(tier_read(pool, str(work / "b"), n, False))
            res["dd_read_cached"].append(dd(f"if={ddf}", "of=/dev/null", bs))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(src.parent, ignore_errors=True)
        pool.close()
    gbps = {k: total / statistics.median(v) / 1e9 for k, v in res.items()}
    return {"pages": n, "page_bytes": page, "dir": args.dir, "gb_per_s": gbps, "ratios": {
        "write_batch_vs_dd_dsync": gbps["tier_write_batch"] / gbps["dd_write_dsync"],
        "write_never_vs_dd_fdatasync": gbps["tier_write_never"] / gbps["dd_write_fdatasync"],
        "read_direct_vs_dd_direct": gbps["tier_read_direct"] / gbps["dd_read_direct"],
        "read_cached_vs_dd_cached": gbps["tier_read_cached"] / gbps["dd_read_cached"]}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/var/tmp", help="a directory on the disk to measure")
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    out = run(args)
    g = out["gb_per_s"]
    print(f"{out['pages']} pages of {out['page_bytes'] >> 20} MiB in {args.dir}, "
          f"medians of {args.reps}:")
    print(f"{'':34}{'tier GB/s':>10}{'dd GB/s':>10}{'ratio':>8}")
    for label, t, d in (("write, sync per page (batch)", "tier_write_batch", "dd_write_dsync"),
                        ("write, sync at the end (never)", "tier_write_never",
                         "dd_write_fdatasync"),
                        ("read, O_DIRECT", "tier_read_direct", "dd_read_direct"),
                        ("read, page cache", "tier_read_cached", "dd_read_cached")):
        print(f"{label:34}{g[t]:>10.2f}{g[d]:>10.2f}{g[t] / g[d]:>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
