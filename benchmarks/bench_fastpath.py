"""Fast path benchmark: 1-page Store / LoadKeys / Lookup latency, fast path vs gRPC vs a raw
Unix-socket ping-pong of the same sizes, with 1 and 8 worker processes.

A real daemon process; worker processes (spawned, started on a barrier) map shm device
buffers, open a session and, round after round, time calls of each op over each path in turn
(side by side, in alternating blocks of ``BLOCK`` calls): ``fast`` (``HiCacheClient`` over
``<socket>.fast``), ``grpc`` (the same client with ``fast_path=False``) and ``raw`` (a Python
echo server in its own process answering a request of the fast path's request size with a
reply of its reply size: the floor any Python-to-Python request over a Unix socket pays).
Every Store names a fresh key (it copies its page); every LoadKeys loads a stored one; every
Lookup asks a stored key. Two settings run one after the other: no polling (daemon
``fast_path_spin_us`` and client ``spin_us`` 0), and the adaptive poll windows (both at
``--spin-us``, the default's 200 us: a CPU traded for the wake-up of a sleeping one, while
calls come back to back). Prints p50 / p99 per op and path, the worker's CPU per fast call,
grpc / fast and fast / raw ratios of the medians, and per setting the daemon's CPU and what
its polls caught and cost (its ``hicache_fast_path_poll*`` counters).

Run: ``python benchmarks/bench_fastpath.py [--quick] [--spin-us 200] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

import numpy as np
import torch

from hicache import fast_wire as w
from hicache.polling import DEFAULT_MAX_US
from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers
from hicache_client import fast_path as fp

GEOMETRY = KVGeometry(PoolKind.MHA, DType.BFLOAT16, layer_num=8, head_num=2, head_dim=64)
SPEC = PoolSpec("fastbench", GEOMETRY, 16, size_tokens=16 * 8192)
OPS = ("store", "load_keys", "lookup")
PATHS = ("fast", "grpc", "raw")
_ECHO = struct.Struct("<II")
BLOCK = 200
"""Calls per path in a row, paths taking turns (rounds are blocks of this many). A worker's
data calls all take one path; a block this long shows each path's steady state. Shorter
blocks measure the neighbours too: on a VM the host's own halt polling adapts to how long
the vCPUs slept lately, so a fast-path block right after a gRPC block (whose threads keep
the vCPUs busy) wakes cheaper than a fast path alone, and one after a polling block dearer."""


def _echo_server(path: str, ready: Any) -> None:
    """Reads (request length, reply length) + the rest of the request; answers the reply."""
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(64)
    ready.set()

    def serve(c: socket.socket) -> None:
        with c:
            while True:
                head = c.recv(_ECHO.size, socket.MSG_WAITALL)
                if len(head) < _ECHO.size:
                    return
                n, reply = _ECHO.unpack(head)
                if n:
                    c.recv(n, socket.MSG_WAITALL)
                c.sendall(bytes(reply))

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _sizes(session_id: str) -> dict[str, tuple[int, int]]:
    """(request, reply) bytes of each op's fast-path frames, headers included."""
    key, dev = [b"k" * 32], np.zeros(1, np.int64)
    req = {"store": fp.keyed_body(session_id, key, dev),
           "load_keys": fp.keyed_body(session_id, key, dev),
           "lookup": fp.lookup_body(SPEC.name, "", key)}
    rep = {"store": w.STORE_REPLY.size + 4 + 1, "load_keys": w.TRANSFER_REPLY.size,
           "lookup": w.LOOKUP_REPLY.size + 1}
    return {op: (w.REQUEST.size + len(b"".join(req[op])), w.REPLY.size + rep[op])
            for op in OPS}


def _worker(target: str, echo: str, shm: str, me: int, rounds: int, spin_us: int,
            barrier: Any, out: Any) -> None:
    fast = HiCacheClient(target, spin_us=spin_us)
    grpc_c = HiCacheClient(target, fast_path=False)
    bufs = ShmDeviceBuffers.create(SPEC, 64 * 16, shm)
    s = fast.open_session(SPEC.name, f"bench-{me}", bufs.descriptors, heartbeat=False)
    grpc_c._page_sizes[s.session_id] = SPEC.page_size
    dev = torch.arange(16) + 16 * me
    stored = [os.urandom(32) for _ in range(rounds)]
    for k in stored:
        fast.store(s.session_id, [k], dev)
    raw = socket.socket(socket.AF_UNIX)
    raw.connect(echo)
    sizes = _sizes(s.session_id)
    assert fast.data_path == "fast" and grpc_c.data_path == "grpc"

    def ping(op: str) -> None:
        req, rep = sizes[op]
        raw.sendall(_ECHO.pack(req - _ECHO.size, rep) + bytes(req - _ECHO.size))
        raw.recv(rep, socket.MSG_WAITALL)

    pick = itertools.cycle(range(rounds))
    calls = {
        "store": lambda c: c.store(s.session_id, [os.urandom(32)], dev),
        "load_keys": lambda c: c.load_keys(s.session_id, [stored[next(pick)]], dev),
        "lookup": lambda c: c.lookup(SPEC.name, [stored[next(pick)]]),
    }
    lat: dict[str, dict[str, list[float]]] = {op: {p: [] for p in PATHS} for op in OPS}
    cpu = {op: {p: 0.0 for p in PATHS} for op in OPS}
    barrier.wait()
    t0 = time.perf_counter()
    for _ in range(rounds // BLOCK):
        for op in OPS:
            for path in PATHS:  # a block of calls per path: a worker's calls come in runs
                c0 = time.thread_time()
                for _ in range(BLOCK):
                    a = time.perf_counter()
                    if path == "raw":
                        ping(op)
                    else:
                        calls[op](fast if path == "fast" else grpc_c)
                    lat[op][path].append(time.perf_counter() - a)
                cpu[op][path] += time.thread_time() - c0
    out.put({"lat": lat, "cpu": cpu, "seconds": time.perf_counter() - t0})
    s.close()
    fast.close()
    grpc_c.close()
    bufs.close()


def _daemon(work: str, shm: str, spin_us: int) -> tuple[subprocess.Popen[bytes], str]:
    sock = os.path.join(work, f"d{spin_us}.sock")
    proc = subprocess.Popen([sys.executable, "-m", "hicached", "serve", "--listen",
                             f"unix:{sock}", "--shm-dir", shm, "--metrics-listen", "127.0.0.1:0",
                             "--memory-budget", "2GiB", "--reserve", "0", "--state-dir", "",
                             "--log-level", "WARNING", "--fast-path-spin-us", str(spin_us)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    c = HiCacheClient(f"unix:{sock}", reconnect_seconds=30)
    c.ping()
    c.create_pool(SPEC)
    c.close()
    return proc, f"unix:{sock}"


def _daemon_counters(proc: subprocess.Popen[bytes], target: str) -> dict[str, float]:
    """The daemon's CPU seconds so far and its fast-path poll counters."""
    with open(f"/proc/{proc.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    with HiCacheClient(target) as c:
        port = c.get_info().metrics_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    got = {"cpu": cpu, "caught": 0.0, "slept": 0.0, "poll_s": 0.0}
    for line in text.decode().splitlines():
        if line.startswith("hicache_fast_path_polls_total{"):
            got["caught" if 'result="caught"' in line else "slept"] = float(line.split()[-1])
        elif line.startswith("hicache_fast_path_poll_seconds_total "):
            got["poll_s"] = float(line.split()[-1])
    return got


def run(workers_list: list[int], rounds: int, spin_us: int) -> list[dict[str, Any]]:
    work = tempfile.mkdtemp(prefix="hicache-fastbench-")
    shm = tempfile.mkdtemp(prefix="hicache-fastbench-", dir="/dev/shm")
    ctx = mp.get_context("spawn")
    echo = os.path.join(work, "echo.sock")
    ready = ctx.Event()
    echo_proc = ctx.Process(target=_echo_server, args=(echo, ready), daemon=True)
    echo_proc.start()
    ready.wait(10)
    rows: list[dict[str, Any]] = []
    try:
        for spin in (0, spin_us):
            proc, target = _daemon(work, shm, spin)
            try:
                for n in workers_list:
                    per = max(rounds // n, BLOCK)
                    barrier, out = ctx.Barrier(n), ctx.Queue()
                    procs = [ctx.Process(target=_worker, args=(target, echo, shm, i, per, spin,
                                                                barrier, out))
                             for i in range(n)]
                    before = _daemon_counters(proc, target)
                    for p in procs:
                        p.start()
                    got = [out.get(timeout=600) for _ in procs]
                    for p in procs:
                        p.join(60)
                    after = _daemon_counters(proc, target)
                    fast_calls = sum(len(g["lat"][op]["fast"]) for g in got for op in OPS)
                    daemon = {k: after[k] - before[k] for k in after}
                    for op in OPS:
                        row: dict[str, Any] = {"spin_us": spin, "workers": n, "op": op}
                        for path in PATHS:
                            xs = np.array([x for g in got for x in g["lat"][op][path]]) * 1e6
                            row[f"{path}_p50_us"] = float(np.median(xs))
                            row[f"{path}_p99_us"] = float(np.percentile(xs, 99))
                            row[f"{path}_cpu_us"] = sum(g["cpu"][op][path] for g in got
                                                        ) / len(xs) * 1e6
                        row["daemon_cpu_s"] = daemon["cpu"]  # all paths, the whole run
                        row["daemon_poll_us_per_fast_call"] = daemon["poll_s"] / fast_calls * 1e6
                        polls = daemon["caught"] + daemon["slept"]
                        row["daemon_polls_caught"] = daemon["caught"] / polls if polls else 0.0
                        rows.append(row)
            finally:
                proc.terminate()
                proc.wait(30)
    finally:
        echo_proc.terminate()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--rounds", type=int, default=600,
                    help="calls per op and path in each setting, all workers together")
    ap.add_argument("--spin-us", type=int, default=DEFAULT_MAX_US,
                    help="the poll window's max in the second setting (daemon and client; "
                         "the first has none)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    rounds = BLOCK if args.quick else args.rounds
    print(f"page {SPEC.page_bytes // 1024} KiB (MHA bf16, 8 layers x 2 heads x 64, "
          f"page_size {SPEC.page_size}); {os.cpu_count()} CPUs")
    rows = run([1, 8], rounds, args.spin_us)
    print(f"{'poll':>5} {'wk':>3} {'op':>10} | {'fast p50':>9} {'p99':>7} {'cpu':>5} | "
          f"{'grpc p50':>9} {'p99':>7} | {'raw p50':>8} {'p99':>7} | {'grpc/fast':>9} "
          f"{'fast/raw':>8}")
    for r in rows:
        print(f"{r['spin_us']:>5} {r['workers']:>3} {r['op']:>10} | "
              f"{r['fast_p50_us']:>9.0f} {r['fast_p99_us']:>7.0f} {r['fast_cpu_us']:>5.0f} | "
              f"{r['grpc_p50_us']:>9.0f} {r['grpc_p99_us']:>7.0f} | "
              f"{r['raw_p50_us']:>8.0f} {r['raw_p99_us']:>7.0f} | "
              f"{r['grpc_p50_us'] / r['fast_p50_us']:>9.2f} "
              f"{r['fast_p50_us'] / r['raw_p50_us']:>8.2f}")
    print("(us; poll = the largest poll window, daemon and client, 0 = none; cpu = the "
          "worker's CPU per fast call; target: 1-page fast p50 <= 150 us on this machine)")
    for r in rows[::len(OPS)]:
        print(f"poll {r['spin_us']}, {r['workers']} worker(s): daemon CPU {r['daemon_cpu_s']:.2f}"
              f" s (all paths), polling {r['daemon_poll_us_per_fast_call']:.1f} us per fast "
              f"call, {r['daemon_polls_caught']:.0%} of its polls caught the next request")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
