"""What a healthy daemon's Lookup needs under load: the measurement behind ``lookup_timeout_s``.

An engine's scheduler thread waits for a request's first Lookup (SGLang's linker, vLLM's
spec) up to ``lookup_timeout_s``; that is also the longest it waits once when the daemon hangs
(then the link is late and lookups are skipped until it answers). The deadline must cover a
healthy daemon's slow tail under load, with margin, and no more.

A real daemon process; a *prober* process times Lookups the way the engines make them (a
client built as ``hicache_client.link`` builds it: the fast path, the default poll window;
128 keys, a 2,048-token prompt at page 16, half of them stored, held for the prober's session
with ``hold_ms``), one every 2 ms, in two phases:

- ``idle``: the prober alone;
- ``loaded``: ``--workers`` processes each storing and loading 64-page batches back to back
  on the same pool, and one CPU burner per CPU (an inference host wants every CPU: the poll
  window shuts itself off, as in production).

Reported per phase: p50 / p99 / p99.9 / max in ms, and the deadline this suggests: ten times
the loaded p99.9, rounded up to 50 ms (the margin covers a machine busier than this one and
the slowest single Lookup seen, 3-6x the p99.9 here).

Run: ``python benchmarks/bench_lookup_deadline.py [--seconds S] [--workers N] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import signal
import statistics
import tempfile
import time
from typing import Any

from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicache_bench.daemon import start_daemon

GEOMETRY = KVGeometry(PoolKind.MHA, DType.BFLOAT16, layer_num=8, head_num=2, head_dim=64)
PS = 16
SPEC = PoolSpec("lookupdeadline", GEOMETRY, PS, size_tokens=PS * 4096)  # 64 KiB pages
KEYS = 128
BATCH = 64


def _worker(target: str, index: int, stop: Any) -> None:
    import torch

    from hicache_client import HiCacheClient, ShmDeviceBuffers

    with HiCacheClient(target) as c, ShmDeviceBuffers.create(
            SPEC, BATCH * PS, prefix=f"lookupdeadline-w{index}") as bufs:
        s = c.open_session(SPEC.name, f"load-{index}", bufs.descriptors)
        rows = torch.arange(BATCH * PS)
        n = 0
        while not stop.is_set():
            keys = [b"w%d-%d-%d" % (index, n, i) for i in range(BATCH)]
            s.store(keys, rows)
            s.load_keys(keys, rows)
            n += 1
        s.close()


def _burn(stop: Any) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(10_000):
            x += 1


def _probe(target: str, seconds: float, out: Any) -> None:
    import torch

    from hicache.polling import DEFAULT_MAX_US
    from hicache_client import HiCacheClient, ShmDeviceBuffers

    c = HiCacheClient(target, timeout=5, reconnect_seconds=0, spin_us=DEFAULT_MAX_US)
    with ShmDeviceBuffers.create(SPEC, KEYS * PS, prefix="lookupdeadline-p") as bufs:
        s = c.open_session(SPEC.name, "prober", bufs.descriptors)
        keys = [b"prompt-%03d" % i for i in range(KEYS)]
        s.store(keys[:KEYS // 2], torch.arange(KEYS // 2 * PS))
        times: list[float] = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            c.lookup(SPEC.name, keys, session_id=s.session_id, hold_ms=5000)
            times.append(time.perf_counter() - t0)
            time.sleep(0.002)
        s.release_holds()
        s.close()
    c.close()
    out.put(times)


def _phase(target: str, seconds: float, workers: int, burners: int) -> list[float]:
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    load = [ctx.Process(target=_worker, args=(target, i, stop)) for i in range(workers)]
    load += [ctx.Process(target=_burn, args=(stop,)) for _ in range(burners)]
    for p in load:
        p.start()
    if load:
        time.sleep(2.0)  # the load is running before the first probe
    out = ctx.Queue()
    prober = ctx.Process(target=_probe, args=(target, seconds, out))
    prober.start()
    times: list[float] = out.get(timeout=seconds + 120)
    prober.join()
    stop.set()
    for p in load:
        p.join(30)
    return times


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)

    def pct(q: float) -> float:
        return 1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"n": len(ordered), "p50_ms": 1e3 * statistics.median(ordered),
            "p99_ms": pct(0.99), "p999_ms": pct(0.999), "max_ms": 1e3 * ordered[-1]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hicache_client import HiCacheClient

    work = tempfile.mkdtemp(prefix="hicache-bench-lookup-")
    proc, target = start_daemon(work, "/dev/shm", "1GiB")
    try:
        with HiCacheClient(target) as c:
            c.create_pool(SPEC)
        res: dict[str, Any] = {"cpus": os.cpu_count(), "workers": args.workers}
        res["idle"] = _summary(_phase(target, args.seconds, 0, 0))
        res["loaded"] = _summary(_phase(target, args.seconds, args.workers,
                                        os.cpu_count() or 1))
        res["suggested_timeout_s"] = math.ceil(10 * res["loaded"]["p999_ms"] / 50) * 50 / 1e3
        return res
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20.0, help="each phase's probing time")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    r = run(args)
    print(f"Lookup of {KEYS} keys with a hold, fast path, {r['cpus']} CPUs, one every 2 ms:")
    for phase in ("idle", "loaded"):
        x = r[phase]
        print(f"  {phase:6}  n {x['n']:5d}  p50 {x['p50_ms']:7.2f}  p99 {x['p99_ms']:7.2f}  "
              f"p99.9 {x['p999_ms']:7.2f}  max {x['max_ms']:7.2f} ms")
    print(f"  loaded: {args.workers} workers storing + loading {BATCH} pages back to back, "
          f"{r['cpus']} CPU burners")
    print(f"  suggested lookup_timeout_s (10 x loaded p99.9, up to 50 ms): "
          f"{r['suggested_timeout_s']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
