"""How far a policy that predicts reuse could go on a trace: oracles beside LRU, the daemon's
policy and the offline optimum.

Each oracle is told in advance what an online policy could at best estimate from the uses it
has seen (``hicache_bench.trace_policies``): every block's reuse rate over its life and when it is
used for the last time (``rate_oracle``, what ``hicache-bench trace`` prints), the same rates
without the last use (``rate_no_last_use``), and how many requests will use each block in all
(``count_oracle``). Each keeps the blocks of highest rank and stores none that ranks no higher
than every held one. Where even an oracle misses a hit rate, no online policy that estimates
the same thing reaches it. The same stream, the same replay as ``hicache-bench trace``,
in-process; the printed figures are shares of prompt blocks hit, side by side. Where a goal
is given (``--goal-share``, default a third), the row ``goal`` is LRU plus that share of the
gap from LRU to the optimum.

Usage: ``python benchmarks/bench_trace_bounds.py [TRACE] [--capacity 1%,2%,5%] [--json]``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hicache_bench.trace import capacities, read_trace
from hicache_bench.trace_policies import (
    Belady,
    CountOracle,
    Lru,
    Policy,
    RateOracle,
    Reuse,
    lifetime_rates,
    next_uses,
    replay,
    use_counts,
)

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / \
    "mooncake_synthetic_trace.jsonl"
ROWS = ("lru", "reuse", "count_oracle", "rate_no_last_use", "rate_oracle", "belady", "goal")


def bounds(requests: list[list[int]], spec: str,
           goal_share: float) -> list[tuple[str, int, dict[str, float]]]:
    """Per capacity (label, blocks, each row's hit rate as a fraction, the goal's too)."""
    distinct = len({b for r in requests for b in r})
    uses = next_uses(requests)
    rates = lifetime_rates(requests)
    counts = use_counts(requests)
    out: list[tuple[str, int, dict[str, float]]] = []
    for label, blocks in capacities(spec, distinct):
        policies: dict[str, Policy] = {
            "lru": Lru(blocks), "reuse": Reuse(blocks),
            "count_oracle": CountOracle(blocks, counts),
            "rate_no_last_use": RateOracle(blocks, rates, last_use=False),
            "rate_oracle": RateOracle(blocks, rates), "belady": Belady(blocks)}
        rate = {name: replay(p, requests, uses).rate for name, p in policies.items()}
        rate["goal"] = rate["lru"] + goal_share * (rate["belady"] - rate["lru"])
        out.append((label, blocks, rate))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", default=str(TRACE))
    ap.add_argument("--capacity", default="1%,2%,5%",
                    help="shares of the distinct blocks (N%%) or numbers of blocks")
    ap.add_argument("--goal-share", type=float, default=1 / 3,
                    help="the share of the gap from LRU to the optimum the goal asks for")
    ap.add_argument("--requests", type=int, default=0, help="only the first N (0: all)")
    ap.add_argument("--json", action="store_true", help="one JSON object per capacity")
    args = ap.parse_args()
    requests = read_trace(args.trace, args.requests)
    rows = bounds(requests, args.capacity, args.goal_share)
    if args.json:
        for label, blocks, rate in rows:
            print(json.dumps({"capacity": label, "blocks": blocks, **rate}))
        return
    print(f"{len(requests)} requests; prefix hit rate (hit blocks / prompt blocks), %:")
    print(f"  {'':18}" + "".join(f"{label:>9}" for label, _, _ in rows))
    for name in ROWS:
        print(f"  {name:18}" + "".join(f"{100 * rate[name]:9.1f}" for _, _, rate in rows))


if __name__ == "__main__":
    main()
