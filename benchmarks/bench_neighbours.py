"""A neighbour's long Lookups and another worker's 1-page calls, side by side.

One daemon (in this process, so that the baseline can be built into it) with one pool; a
*neighbour* process loops Lookups of 65,536 keys (``max_keys_per_call``; half of them stored)
over the fast path while a *prober* process times 1-page Lookups and 1-page Stores on the same
pool, one every 2 ms. Both start on a barrier. Three runs in one go:

- ``idle``: the prober alone;
- ``chunked``: the neighbour's Lookups check ``LOOKUP_CHUNK`` keys per turn of the pool's lock
  (the daemon as shipped);
- ``one turn``: the same Lookups under one turn of the lock for the whole batch (the daemon
  before chunking, rebuilt by setting ``LOOKUP_CHUNK`` to the batch size).

Reported: the prober's p50 / p99 / max per call kind, and the neighbour's Lookups per second.
The promise: another worker's 1-page call waits < 5 ms behind a 65,536-key Lookup.

Run: ``python benchmarks/bench_neighbours.py [--seconds S] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers
from hicached.cache import pool_cache
from hicached.server.app import create_server
from hicached.server.config import ServerConfig

SPEC = PoolSpec("neighbours", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 1, 8), 1,
                Layout.LAYER_FIRST, size_tokens=40_000)
BATCH = 65_536


def neighbour(target: str, seconds: float, barrier: Any, out: Any) -> None:
    keys = [b"n%031d" % i for i in range(BATCH)]
    n = 0
    with HiCacheClient(target) as c:
        c.lookup(SPEC.name, keys[:1])
        barrier.wait()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            c.lookup(SPEC.name, keys)
            n += 1
    out.put(("neighbour", n / seconds))


def prober(target: str, shm: str, seconds: float, barrier: Any, out: Any) -> None:
    lookups: list[float] = []
    stores: list[float] = []
    with HiCacheClient(target) as c, ShmDeviceBuffers.create(SPEC, 64, shm) as bufs:
        s = c.open_session(SPEC.name, f"p{os.getpid()}", bufs.descriptors)
        c.lookup(SPEC.name, [b"warm"])
        barrier.wait()
        end, i = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            t0 = time.perf_counter()
            c.lookup(SPEC.name, [b"n%031d" % (i % BATCH)])
            lookups.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            s.store([b"p%d-%d" % (os.getpid(), i)], torch.arange(1))
            stores.append(time.perf_counter() - t0)
            i += 1
            time.sleep(0.002)
        s.close()
    out.put(("prober", lookups, stores))


def _summary(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"p50_ms": round(statistics.median(xs) * 1e3, 3),
            "p99_ms": round(xs[int(len(xs) * 0.99)] * 1e3, 3),
            "max_ms": round(xs[-1] * 1e3, 3), "calls": len(xs)}


def run(target: str, shm: str, seconds: float, with_neighbour: bool) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    barrier = ctx.Barrier(2 if with_neighbour else 1)
    procs = [ctx.Process(target=prober, args=(target, shm, seconds, barrier, out))]
    if with_neighbour:
        procs.append(ctx.Process(target=neighbour, args=(target, seconds, barrier, out)))
    for p in procs:
        p.start()
    got = [out.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join()
    result: dict[str, Any] = {}
    for item in got:
        if item[0] == "prober":
            result["lookup"], result["store"] = _summary(item[1]), _summary(item[2])
        else:
            result["neighbour_lookups_per_s"] = round(item[1], 1)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shm = os.path.join(tmp, "shm")
        os.mkdir(shm)
        config = ServerConfig(listen=(f"unix:{tmp}/s.sock",), shm_dir=shm, state_dir="",
                              metrics_listen="", memory_budget_bytes=1 << 30, reserve_bytes=0,
                              pools=(SPEC,))
        server, bound = create_server(config)
        try:
            with HiCacheClient(bound[0]) as c, ShmDeviceBuffers.create(SPEC, 1024, shm) as b:
                s = c.open_session(SPEC.name, "fill", b.descriptors)
                for at in range(0, BATCH // 2, 1024):  # half of the neighbour's keys stored
                    s.store([b"n%031d" % i for i in range(at, at + 1024)], torch.arange(1024))
                s.close()
            chunk = pool_cache.LOOKUP_CHUNK
            results = {"idle": run(bound[0], shm, args.seconds, False),
                       "chunked": run(bound[0], shm, args.seconds, True)}
            pool_cache.LOOKUP_CHUNK = BATCH
            try:
                results["one turn"] = run(bound[0], shm, args.seconds, True)
            finally:
                pool_cache.LOOKUP_CHUNK = chunk
        finally:
            server.drain_and_stop(1.0)
    print(f"{'run':10} {'call':7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'calls':>6}  "
          "neighbour Lookups/s")
    for name, r in results.items():
        for call in ("lookup", "store"):
            x = r[call]
            print(f"{name:10} {call:7} {x['p50_ms']:8.3f} {x['p99_ms']:8.3f} {x['max_ms']:8.3f} "
                  f"{x['calls']:6d}  {r.get('neighbour_lookups_per_s', '-')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
