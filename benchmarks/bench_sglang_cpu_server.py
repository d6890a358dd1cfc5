"""Time to first token through a real SGLang server on CPU: a miss, a hit from the daemon
through the linker, and a hit in SGLang's own device cache, side by side in one run.

One ``hicached serve`` (the daemon's defaults but for the budget) and one ``python -m
sglang.launch_server`` on CPU with the README's linker config (only ``target``), the tests'
random-weight Llama and stand-ins (tests/sglang_server_harness.py). Per round, a fresh prompt
of ``--tokens`` tokens (one output token, streamed):

- ``miss``: its first request: SGLang computes every token;
- ``device``: again, from SGLang's radix cache;
- ``linker``: again after ``/flush_cache`` dropped SGLang's cache: every full page comes from
  the daemon (Lookup, then LoadKeys into the request's slots); checked to be all of them.

``device`` and ``linker`` alternate which goes first from round to round. Reported: the
median and spread of each, the ratios linker/device and linker/miss, the tokens that came
from the daemon, and the daemon's Lookups per request (its ``hicache_rpc_requests_total``).
The target: a linker hit within 1.15x of a device hit.

Run: ``python benchmarks/bench_sglang_cpu_server.py [--rounds N] [--tokens T] [--json FILE]``
(needs what scripts/setup.sh --test installs).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' harness

from tests.daemon_proc import start_daemon
from tests.sglang_server_harness import PAGE_SIZE, SGLangServer, metric, model_dir


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="hicache-bench-sglang-cpu-"))
    daemon = start_daemon(work, "--lease-seconds", "5")
    model = model_dir(work)
    times: dict[str, list[float]] = {"miss": [], "device": [], "linker": []}
    host: list[int] = []
    try:
        with SGLangServer(model, daemon.target, work / "server") as server:
            server.generate(_prompt(args.tokens, 0), max_new_tokens=1)  # the first prefill
            lookups0 = metric(daemon.metrics(), "hicache_rpc_requests_total", method="Lookup")
            requests = 0
            full = (args.tokens - 1) // PAGE_SIZE * PAGE_SIZE
            for r in range(args.rounds):
                ids = _prompt(args.tokens, 1000 + r)
                ref = server.generate(ids, max_new_tokens=1)
                times["miss"].append(ref.ttft_s)
                time.sleep(0.5)  # the write-through lands (asynchronous)
                order = ("device", "linker") if r % 2 == 0 else ("linker", "device")
                for kind in order:
                    if kind == "linker":
                        server.flush()
                    got = server.generate(ids, max_new_tokens=1)
                    if got.output_ids != ref.output_ids or got.logprobs != ref.logprobs:
                        raise AssertionError(f"round {r}: a {kind} hit changed the output")
                    if kind == "linker":
                        if got.host_hits != full:
                            raise AssertionError(f"round {r}: {got.host_hits} of {full} "
                                                 "tokens from the daemon")
                        host.append(got.host_hits)
                    times[kind].append(got.ttft_s)
                requests += 3
            lookups = metric(daemon.metrics(), "hicache_rpc_requests_total",
                             method="Lookup") - lookups0
    finally:
        daemon.stop(signal.SIGTERM)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"tokens": args.tokens, "rounds": args.rounds,
            **{f"{k}_ms": 1e3 * v for k, v in med.items()},
            **{f"{k}_spread_ms": [1e3 * min(v), 1e3 * max(v)] for k, v in times.items()},
            "linker_over_device": med["linker"] / med["device"],
            "linker_over_miss": med["linker"] / med["miss"],
            "host_tokens": statistics.median(host), "lookups_per_request": lookups / requests}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    r = run(args)
    print(f"SGLang 0.5.23 server on CPU, {r['tokens']}-token prompts, one output token, "
          f"median of {r['rounds']} rounds (min..max):")
    for kind in ("miss", "device", "linker"):
        lo, hi = r[f"{kind}_spread_ms"]
        print(f"  {kind:6} TTFT {r[f'{kind}_ms']:8.1f} ms  ({lo:.1f}..{hi:.1f})")
    print(f"  linker / device {r['linker_over_device']:.3f}   linker / miss "
          f"{r['linker_over_miss']:.3f}   tokens from the daemon {r['host_tokens']:.0f}   "
          f"daemon Lookups per request {r['lookups_per_request']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
