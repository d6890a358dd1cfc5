"""Holds benchmark: what a hit that is a promise costs, and what it saves.

A real daemon process; this process is the worker (one session, shm buffers), over the fast
path. Measured side by side in one run, alternating blocks of ``BLOCK`` calls, medians:

1. Lookup of 1 key and of 128 keys, without a hold (``Lookup(pool, keys)``) and with one
   (``session_id``, ``hold_ms``: the steady state of a scheduler that looks the same prefix
   up again each round, which refreshes its holds). Targets: +10 us p50 or less for 1 key,
   +5 % or less for 128.
2. Hits that survive: a worker looks up 8 stored keys, another session then stores enough
   fresh keys to cycle the pool, then the first loads its hit; the loaded pages (exact, in
   zeroed rows) with holds vs without, over ``--rounds`` rounds.

Run: ``python benchmarks/bench_holds.py [--quick] [--json FILE]``.
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

import torch

from hicache.errors import KeyNotFound
from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicache_bench.daemon import start_daemon
from hicache_client import HiCacheClient, ShmDeviceBuffers

GEOMETRY = KVGeometry(PoolKind.MHA, DType.BFLOAT16, layer_num=4, head_num=2, head_dim=64)
PS = 16
POOL_PAGES = 512
SPEC = PoolSpec("holdbench", GEOMETRY, PS, size_tokens=PS * POOL_PAGES)
BLOCK = 200


def lookups(c: HiCacheClient, session_id: str, keys: list[bytes], rounds: int
            ) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"plain": [], "held": []}
    for _ in range(rounds):
        for mode in ("plain", "held"):
            kw: dict[str, Any] = ({"session_id": session_id, "hold_ms": 10_000}
                                  if mode == "held" else {})
            for _ in range(BLOCK):
                t0 = time.perf_counter()
                c.lookup(SPEC.name, keys, **kw)
                out[mode].append(time.perf_counter() - t0)
    return out


def survivors(c: HiCacheClient, holder: Any, storer: Any, rows: list[torch.Tensor],
              hold: bool, rounds: int) -> tuple[int, int]:
    """(pages loaded, pages looked up and found) over ``rounds`` rounds."""
    loaded = found = 0
    for r in range(rounds):
        keys = [b"hit-%d-%d-%d" % (hold, r, i) for i in range(8)]
        storer.store(keys, torch.arange(8 * PS))
        hit = holder.lookup(keys, hold_ms=10_000 if hold else 0).hit_prefix
        found += hit
        for j in range(POOL_PAGES // 8):  # another worker cycles the whole pool
            storer.store([b"fill-%d-%d-%d-%d" % (hold, r, j, i) for i in range(8)],
                         torch.arange(8 * PS))
        for t in rows:
            t[8 * PS:].zero_()
        try:
            holder.load_keys(keys[:hit], torch.arange(8 * PS, (8 + hit) * PS))
        except KeyNotFound:
            continue
        ok = all(torch.equal(t[8 * PS + i * PS:8 * PS + (i + 1) * PS], t[i * PS:(i + 1) * PS])
                 for t in rows for i in range(hit))
        loaded += hit if ok else 0
    return loaded, found


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix="hicache-bench-holds-")
    proc, target = start_daemon(work, "/dev/shm", "1GiB")
    try:
        c = HiCacheClient(target)
        c.create_pool(SPEC)
        with ShmDeviceBuffers.create(SPEC, 16 * PS, prefix="holdbench") as bufs:
            rows = [t.view(torch.uint8) for t in bufs.all_tensors()]
            for t in rows:
                t.random_()
            holder = c.open_session(SPEC.name, "holder", bufs.descriptors)
            storer = c.open_session(SPEC.name, "storer", bufs.descriptors)
            assert c.data_path == "fast"
            keys = [b"k-%03d" % i for i in range(128)]
            for i in range(0, 128, 8):
                storer.store(keys[i:i + 8], torch.arange(8 * PS))
            reps = 3 if args.quick else 15
            res: dict[str, Any] = {}
            for n in (1, 128):  # a session may hold a quarter of 512 pages: all 128
                timings = lookups(c, holder.session_id, keys[:n], reps)
                p50 = {m: statistics.median(v) for m, v in timings.items()}
                res[f"lookup_{n}"] = {"plain_us": 1e6 * p50["plain"],
                                      "held_us": 1e6 * p50["held"],
                                      "extra_us": 1e6 * (p50["held"] - p50["plain"]),
                                      "ratio": p50["held"] / p50["plain"]}
            holder.release_holds()
            rounds = 10 if args.quick else args.rounds
            for hold in (True, False):
                loaded, found = survivors(c, holder, storer, rows, hold, rounds)
                res[f"survivors_{'held' if hold else 'plain'}"] = {
                    "found_pages": found, "loaded_pages": loaded}
            holder.close()
            storer.close()
        c.close()
        return res
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    r = run(args)
    print(f"Lookup over the fast path, medians of alternating blocks of {BLOCK}:")
    for n in (1, 128):
        x = r[f"lookup_{n}"]
        print(f"  {n:3d} key(s): no hold {x['plain_us']:7.1f} us  hold {x['held_us']:7.1f} us"
              f"  (+{x['extra_us']:.1f} us, x{x['ratio']:.3f})")
    for mode in ("held", "plain"):
        x = r[f"survivors_{mode}"]
        print(f"  hits that survive another worker cycling the pool, {mode:5}: "
              f"{x['loaded_pages']} of {x['found_pages']} pages loaded exact")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
