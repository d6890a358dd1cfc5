"""SGLang serving with the hicached linker vs its stock hierarchical cache: TTFT, throughput.

Needs a GPU host with a full SGLang install and a local model (``--model-path``); run by
scripts/gpu_check.sh when ``HICACHE_GPU_MODEL`` is set. For each configuration it starts one
``sglang.launch_server`` (the same model, page size and device-token budget), then:

1. warm: ``--prefixes`` long prompts (``--prefix-tokens`` each, distinct), one request each;
   together they exceed the device KV budget, so the first ones leave the GPU;
2. hit: the same prefixes again with new suffixes, ``--concurrency`` at a time: every prefix
   must come back from the host tier (SGLang's own HiCache pool, or hicached).

Reports per phase the median and p90 time to first token (streamed ``/generate``, one output
token) and the phase's requests per second. Configurations: ``stock``
(``--enable-hierarchical-cache``) and ``hicached`` (``--enable-unified-cache-external-linker``
with ``hicache_sglang.linker`` against a daemon this script starts).

Run: ``python benchmarks/bench_sglang_server.py --model-path DIR [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hicache_bench.daemon import start_daemon


def wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sglang exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(2)
    raise TimeoutError("sglang did not become healthy")


def ttft(port: int, ids: list[int]) -> float:
    body = json.dumps({"input_ids": ids, "stream": True,
                       "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        for line in resp:
            if line.startswith(b"data:"):
                return time.perf_counter() - t0
    raise RuntimeError("no streamed output")


def phase(port: int, prompts: list[list[int]], concurrency: int) -> dict[str, float]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        times = sorted(pool.map(lambda p: ttft(port, p), prompts))
    wall = time.perf_counter() - t0
    return {"ttft_p50_ms": statistics.median(times) * 1e3,
            "ttft_p90_ms": times[int(0.9 * (len(times) - 1))] * 1e3,
            "requests_per_s": len(prompts) / wall}


def run_config(name: str, args: argparse.Namespace, flags: list[str]) -> dict[str, Any]:
    port = args.port
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model_path,
           "--port", str(port), "--page-size", str(args.page_size), "--max-total-tokens",
           str(args.device_tokens), *flags]
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        wait_healthy(port, proc)
        rng = random.Random(0)
        prefixes = [[rng.randrange(100, 30000) for _ in range(args.prefix_tokens)]
                    for _ in range(args.prefixes)]
        warm = phase(port, [[*p, 1, 2, 3] for p in prefixes], 1)
        hit = phase(port, [[*p, 4, 5, 6] for p in prefixes], args.concurrency)
        return {"config": name, "warm": warm, "hit": hit}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--port", type=int, default=30011)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--prefixes", type=int, default=32)
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--device-tokens", type=int, default=65536)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    results = [run_config("stock", args, ["--enable-hierarchical-cache"])]
    with tempfile.TemporaryDirectory(prefix="hicache-srv-") as work, \
            tempfile.TemporaryDirectory(prefix="hicache-srv-", dir="/dev/shm") as shm:
        daemon, target = start_daemon(work, shm, "64GiB")
        try:
            extra = {"target": target, "shm_dir": shm,
                     "pool_size_tokens": 2 * args.prefixes * args.prefix_tokens}
            config = {"linker": "HicachedLinker", "linker_module_path": "hicache_sglang.linker",
                      "linker_extra_config": extra}
            results.append(run_config("hicached", args, [
                "--enable-unified-cache-external-linker",
                "--unified-cache-external-linker-backend", "dynamic",
                "--unified-cache-external-linker-config", json.dumps(config)]))
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
    print(f"{'config':<10}{'phase':<6}{'TTFT p50 ms':>13}{'p90 ms':>9}{'req/s':>8}")
    for r in results:
        for ph in ("warm", "hit"):
            m = r[ph]
            print(f"{r['config']:<10}{ph:<6}{m['ttft_p50_ms']:>13.1f}{m['ttft_p90_ms']:>9.1f}"
                  f"{m['requests_per_s']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
