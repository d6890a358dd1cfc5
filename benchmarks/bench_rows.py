"""page_size 1 against what the memory allows: the engine's ratio beside a plain C loop's.

A page_size 1 batch is rows of one token (2 KiB here: 8 heads x 128 bf16) in random places on
both sides, one per layer and component. ``bench_core`` compares the engine's copy of such a
batch with a contiguous streaming copy of the same bytes; this benchmark also measures, in the
same run, a plain C loop (``benchmarks/csrc/rows.c``, compiled here with ``cc``; no engine, no
Python) copying the same number of 2 KiB rows between random places of two prefaulted regions:

- ``seq``: one contiguous copy of the same bytes (as the engine's baseline);
- ``random``: the rows one by one (memcpy, or non-temporal stores at >= 32 MiB as the engine);
- ``prefetch``: the same with the next row's source prefetched (what the engine's kernel does).

``random / seq`` is the most a page_size 1 copy can reach on this machine, one thread; the
engine's ratio (``bench_core``'s ``ids ratio``: page ids, as the fast path sends them) is printed
beside it for the same batch sizes: 64-page batches (4,096 rows, 8 MiB) and 4,096-token batches
(262,144 rows, 512 MiB). Medians.

Run: ``python benchmarks/bench_rows.py [--reps 7]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import bench_core as bc
from hicached import Layout, TransferEngine
from hicached.copy.cpu import STREAMING_BYTES

HERE = Path(__file__).resolve().parent
ROW = 2048
"""Bytes of one token's row at one layer (bench_core's geometry: 8 heads x 128 bf16)."""
BATCHES = ((64, 64 * 32 * 2), (4096, 4096 * 32 * 2))
"""(tokens, rows): page_size 1 batches as bench_core runs them (32 layers, K and V)."""


def ceiling(rows: int, reps: int) -> tuple[float, float, float]:
    """GB/s of (seq, random, prefetch) for ``rows`` rows of ``ROW`` bytes, from rows.c."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("no C compiler (cc) on this machine: rows.c cannot be built")
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "rows")
        subprocess.run([cc, "-O3", "-o", exe, str(HERE / "csrc" / "rows.c")], check=True)
        nt = int(rows * ROW >= STREAMING_BYTES)
        out = subprocess.run([exe, str(rows), str(ROW), str(nt), str(reps)], check=True,
                             capture_output=True, text=True).stdout.split()
    seq, rnd, pre = (float(x) for x in out)
    return seq, rnd, pre


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions (median)")
    args = ap.parse_args()
    engine = TransferEngine(threads=1)
    print("one copy thread; 2 KiB rows; GB/s and ratios to a contiguous copy of the same bytes")
    print(f"{'batch':>12} {'rows':>7} | {'C seq':>6} {'C random':>9} {'ratio':>6} "
          f"{'C prefetch':>11} {'ratio':>6} | {'engine (layer_first) ids ratio':>31}")
    for tokens, rows in BATCHES:
        seq, rnd, pre = ceiling(rows, args.reps)
        got = bc.throughput_rows(1, tokens, args.reps, engine, [Layout.LAYER_FIRST])
        eng = " ".join(f"{r['op']} {r['page_ids_ratio']:.2f}" for r in got)
        print(f"{tokens:>6} tokens {rows:>7} | {seq:>6.1f} {rnd:>9.1f} {rnd / seq:>6.2f} "
              f"{pre:>11.1f} {pre / seq:>6.2f} | {eng:>31}")
    print("(C: benchmarks/csrc/rows.c, rows between random places of two regions four times "
          "the batch; non-temporal stores at >= 32 MiB, as the engine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
