"""One elastic budget against fixed pool sizes: hit rates of two models whose demand shifts.

The public request trace (``hash_ids``: chained 512-token block ids) is served by two models
on one node: model A serves the first 60 % of the requests, model B the last 60 % (its keys
apart from A's), so A is busy alone, then both, then B alone. The node's memory (a share of
the distinct blocks both models see) is either split in two fixed halves, or shared by one
``[budget] elastic`` budget (``service.memory_budget``: growth from the slack on demand,
rebalancing every ``--interval`` seconds of the trace's own time, its default settings
otherwise).
Each request is served as an engine does: a Lookup of its blocks (the hit is the leading run
present, touched), a Store of the rest. Both runs use the daemon's own pool caches, in
process; the printed figures are shares of prompt blocks served from cache, side by side.

Usage: ``python benchmarks/bench_budget.py [TRACE] [--requests N] [--capacity 2%,5%,10%]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicached.cache.pool_cache import PoolCache
from hicached.core.pool import HostPool, MemoryOptions
from hicached.service.budget_config import BudgetConfig
from hicached.service.memory_budget import MemoryBudget

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / \
    "mooncake_synthetic_trace.jsonl"
GEOMETRY = KVGeometry(PoolKind.MLA, DType.UINT8, 1, kv_lora_rank=16, qk_rope_head_dim=0)
OPTIONS = MemoryOptions(hugepages=False, prefault_threads=1, reserve_bytes=0)


def load(path: Path, n: int) -> list[tuple[float, list[int]]]:
    """(seconds, block ids) of the first ``n`` requests."""
    out: list[tuple[float, list[int]]] = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            out.append((r.get("timestamp", len(out) * 1000) / 1000.0, r["hash_ids"]))
            if len(out) == n:
                break
    return out


def schedule(requests: list[tuple[float, list[int]]]) -> list[tuple[float, str, list[bytes]]]:
    """(seconds, model, keys) in time order: A serves the first 60 %, B the last 60 %."""
    n = len(requests)
    out = []
    for i, (t, ids) in enumerate(requests):
        if i < 0.6 * n:
            out.append((t, "a", [b"a%d" % x for x in ids]))
        if i >= 0.4 * n:
            out.append((t, "b", [b"b%d" % x for x in ids]))
    return out


def serve(caches: dict[str, PoolCache], steps: list[tuple[float, str, list[bytes]]],
          budget: MemoryBudget | None, interval: float, clock: list[float]
          ) -> dict[str, tuple[int, int]]:
    got = {m: [0, 0] for m in caches}
    tick = interval
    for t, model, keys in steps:
        clock[0] = t
        if budget is not None and t >= tick:
            budget.rebalance()
            tick = t + interval
        cache = caches[model]
        hit, _ = cache.lookup(keys, touch=True)
        got[model][0] += hit
        got[model][1] += len(keys)
        if hit < len(keys):
            ticket = cache.begin_store(keys[hit:])
            cache.finish_store(ticket, True)
    return {m: (h, t) for m, (h, t) in got.items()}


def run(steps: list[tuple[float, str, list[bytes]]], pages: int, elastic: bool,
        interval: float) -> dict[str, tuple[int, int]]:
    clock = [0.0]
    size = pages if elastic else pages // 2
    pools = {m: HostPool(PoolSpec(m, GEOMETRY, 1, size_tokens=size), OPTIONS)
             for m in ("a", "b")}
    caches = {m: PoolCache(p, clock=lambda: clock[0]) for m, p in pools.items()}
    budget = None
    try:
        if elastic:
            page_bytes = pools["a"].spec.page_bytes
            budget = MemoryBudget(pages * page_bytes, BudgetConfig(
                elastic=True, interval_seconds=interval,
                grow_step_bytes=max(pages // 100, 1) * page_bytes), clock=lambda: clock[0])
            for c in caches.values():
                budget.join(c.sizing)
        return serve(caches, steps, budget, interval, clock)
    finally:
        for p in pools.values():
            p.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", default=str(TRACE))
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--capacity", default="2%,5%,10%",
                    help="node memory as shares of the distinct blocks both models see")
    ap.add_argument("--interval", type=float, default=1.0,
                    help="seconds of the trace between rebalancing rounds")
    args = ap.parse_args()
    steps = schedule(load(Path(args.trace), args.requests))
    distinct = len({k for _, _, keys in steps for k in keys})
    print(f"{len(steps)} requests of two models, {distinct} distinct blocks; shares of "
          f"prompt blocks served from cache")
    print(f"{'capacity':>8} {'pages':>7}  {'fixed A':>8} {'fixed B':>8} {'fixed':>7}  "
          f"{'elastic A':>9} {'elastic B':>9} {'elastic':>7}  {'gain':>5}  seconds")
    for cap in args.capacity.split(","):
        pages = max(int(float(cap.rstrip("%")) / 100 * distinct), 2)
        t0 = time.perf_counter()
        rows = [run(steps, pages, elastic, args.interval) for elastic in (False, True)]
        seconds = time.perf_counter() - t0
        cells = []
        for r in rows:
            hits, total = (sum(v[0] for v in r.values()), sum(v[1] for v in r.values()))
            cells.append([r["a"][0] / r["a"][1], r["b"][0] / r["b"][1], hits / total])
        (fa, fb, f), (ea, eb, e) = cells
        print(f"{cap:>8} {pages:>7}  {fa:8.3f} {fb:8.3f} {f:7.3f}  {ea:9.3f} {eb:9.3f} "
              f"{e:7.3f}  {e / f if f else float('nan'):5.2f}  {seconds:.1f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
