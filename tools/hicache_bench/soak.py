"""``hicache-bench soak``: a real daemon under a node's mix for a while; does anything grow?

A daemon is started on a state directory of its own (its pools in files, as by default), a
pool created, and worker processes (``hicache_bench.workload``, mode ``soak``; half over the
fast path, half over gRPC) open and close sessions, store, look up with holds, load into rows
zeroed first (every byte checked), remove keys; now and then one ends without closing its
session (a crash: the daemon reaps it) and is started again. Every ``--pool-every`` seconds
another pool is created, used and deleted. After a warm-up (a tenth of the run, at least 10
s) the daemon's RSS, open fds, threads and every table it keeps
(``hicache_table_entries``) are sampled, and again at the end.

Prints one JSON object: ``sessions_opened``, ``calls``, ``errors``, ``wrong_bytes``,
``rss_mb_start`` / ``rss_mb_end``, ``fds_start`` / ``fds_end``, ``threads_start`` /
``threads_end``, ``tables`` ({name: [start, end]}), ``crashes``, ``pools_cycled``,
``seconds``, ``reasons`` (errors by reason), and ``flat`` with why not: RSS within 10 %
(+16 MiB), fds and threads within 4, every table within 2x of its start (+8) but the rings
that fill to a size of their own (the event log kept for replay: within it). Exit status 1
with ``--check`` when it is not flat, or any error or wrong byte.

Primitives: ``run(duration, workers, pool_every, work)``, ``flat(report)``, ``main(argv)``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

import numpy as np

from hicache_bench.daemon import start_daemon
from hicache_bench.workload import CRASH_EXIT, PAGE_SIZE, SPEC, spec
from hicache_client import HiCacheClient, ShmDeviceBuffers

RINGS = {"event_keys": "event_keys_max"}
"""Tables that fill to a size of their own by design (WatchEvents' replay), and that size."""
WARMUP_SHARE = 0.1
WARMUP_MIN_S = 10.0
SETTLE_S = 4.0
"""Wait after the last worker ends: two leases (2 s each) so crashed sessions are reaped."""


def _proc(pid: int) -> tuple[float, int, int]:
    """(RSS in MiB, open fds, threads) of a process."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss / 1024, len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def _tables(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^hicache_table_entries\{table="([a-z_]+)"\} (\S+)$', text, re.M)}


def _spawn(target: str, worker: int, seconds: float, grpc: bool) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "hicache_bench.workload", target, SPEC.name, str(worker),
           "soak", "--seconds", str(seconds), *(["--grpc"] if grpc else [])]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _cycle_pool(client: HiCacheClient, n: int) -> int:
    """A pool created, a session's Store on it, the pool deleted: one call each."""
    s = spec(f"soak-extra-{n % 4}", 256)
    client.create_pool(s)
    with ShmDeviceBuffers.create(s, 4 * PAGE_SIZE, sealed=True) as bufs:
        with client.open_session(s.name, "soak-extra", bufs.descriptors,
                                 fds=bufs.fds) as session:
            session.store([b"extra-%d-%d" % (n, i) for i in range(4)],
                          np.arange(4 * PAGE_SIZE, dtype=np.int64))
    client.delete_pool(s.name)
    return 1


class _Worker:
    """A worker slot: its process now, and the counts of those that ended."""

    def __init__(self, target: str, index: int, until: float) -> None:
        self.target, self.index, self.until = target, index, until
        self.totals: dict[str, int] = {}
        self.reasons: dict[str, int] = {}
        self.crashes = 0
        self.generation = 0
        self._box: dict[str, Any] = {}
        """The running process's last line (``last``): each process has a box of its own,
        so a reader that outlives its join writes into one nobody reads."""
        self._reader: threading.Thread | None = None
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[str]:
        left = max(self.until - time.monotonic(), 0.5)
        self.generation += 1
        proc = _spawn(self.target, self.index * 1000 + self.generation, left,
                      grpc=self.index % 2 == 1)
        self._box = {}
        self._reader = threading.Thread(target=self._read, args=(proc, self._box),
                                        daemon=True)
        self._reader.start()
        return proc

    @staticmethod
    def _read(proc: subprocess.Popen[str], box: dict[str, Any]) -> None:
        """Its lines as they come (a pipe never fills), the last one kept."""
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                box["last"] = json.loads(line)
            except ValueError:
                continue

    def poll(self) -> None:
        """Fold an ended process's last counts in; start another while there is time."""
        code = self.proc.poll()
        if code is None:
            return
        self._fold()
        if code == CRASH_EXIT:
            self.crashes += 1
        elif code != 0:
            self.reasons[f"worker_exit_{code}"] = self.reasons.get(f"worker_exit_{code}",
                                                                     0) + 1
        if time.monotonic() < self.until - 1:
            self.proc = self._start()

    def _fold(self) -> None:
        """Add the ended process's last line once: a second call adds nothing."""
        if self._reader is not None:
            self._reader.join(10)
            self._reader = None
        last = self._box.pop("last", {})
        for k, v in last.items():
            if isinstance(v, int) and not isinstance(v, bool):
                self.totals[k] = self.totals.get(k, 0) + v
        for k, v in last.get("reasons", {}).items():
            self.reasons[k] = self.reasons.get(k, 0) + v

    def finish(self) -> None:
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._fold()


def run(duration: float, workers: int = 4, pool_every: float = 10.0,
        work: str | None = None) -> dict[str, Any]:
    own = work is None
    work = work or tempfile.mkdtemp(prefix="hicache-soak-")
    shm = tempfile.mkdtemp(prefix="hicache-soak-", dir="/dev/shm")
    proc, target = start_daemon(work, shm, "1GiB", "127.0.0.1:0", "--lease-seconds", "2",
                                state_dir=os.path.join(shm, "state"))
    t0 = time.monotonic()
    until = t0 + duration
    warm = t0 + max(duration * WARMUP_SHARE, min(WARMUP_MIN_S, duration / 2))
    report: dict[str, Any] = {}
    slots: list[_Worker] = []
    try:
        client = HiCacheClient(target)
        client.create_pool(SPEC)
        port = client.get_info().metrics_port
        slots = [_Worker(target, i, until) for i in range(workers)]
        start: tuple[float, int, int] | None = None
        tables0: dict[str, float] = {}
        cycled = extra_calls = 0
        next_pool = t0 + pool_every
        while time.monotonic() < until:
            time.sleep(0.2)
            for w in slots:
                w.poll()
            if time.monotonic() >= next_pool:
                cycled += _cycle_pool(client, cycled)
                extra_calls += 5
                next_pool += pool_every
            if start is None and time.monotonic() >= warm:
                start, tables0 = _proc(proc.pid), _tables(port)
        for w in slots:
            w.finish()
        time.sleep(SETTLE_S)  # crashed workers' sessions reaped (2 s lease), books settled
        end, tables1 = _proc(proc.pid), _tables(port)
        start = start or end
        totals: dict[str, int] = {}
        reasons: dict[str, int] = {}
        for w in slots:
            for k, v in w.totals.items():
                totals[k] = totals.get(k, 0) + v
            for k, v in w.reasons.items():
                reasons[k] = reasons.get(k, 0) + v
        report = {
            "seconds": round(time.monotonic() - t0, 1),
            "sessions_opened": totals.get("sessions", 0) + cycled,
            "calls": totals.get("calls", 0) + extra_calls,
            "errors": totals.get("errors", 0)
            + sum(v for k, v in reasons.items() if k.startswith("worker_exit_")),
            "wrong_bytes": totals.get("wrong_bytes", 0),
            "loaded_pages": totals.get("loaded_pages", 0),
            "crashes": sum(w.crashes for w in slots), "pools_cycled": cycled,
            "rss_mb_start": round(start[0], 1), "rss_mb_end": round(end[0], 1),
            "fds_start": start[1], "fds_end": end[1],
            "threads_start": start[2], "threads_end": end[2],
            "tables": {k: [tables0.get(k, 0), tables1.get(k, 0)]
                       for k in sorted(set(tables0) | set(tables1))},
            "reasons": reasons,
        }
        client.close()
    finally:
        for w in slots:
            if w.proc.poll() is None:
                w.proc.kill()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(shm, ignore_errors=True)
        if own:
            shutil.rmtree(work, ignore_errors=True)
    report["flat"], report["why_not_flat"] = flat(report)
    return report


def flat(r: dict[str, Any]) -> tuple[bool, list[str]]:
    """Whether nothing grew after the warm-up beyond noise (see the module's docstring)."""
    why = []
    if r["rss_mb_end"] > r["rss_mb_start"] * 1.1 + 16:
        why.append(f"RSS {r['rss_mb_start']} -> {r['rss_mb_end']} MiB")
    for what in ("fds", "threads"):
        if r[f"{what}_end"] > r[f"{what}_start"] + 4:
            why.append(f"{what} {r[f'{what}_start']} -> {r[f'{what}_end']}")
    tables = r["tables"]
    for name, (a, b) in tables.items():
        if name in RINGS:  # fills to its size, by design: flat when within it
            size = tables.get(RINGS[name], [0, 0])[1]
            if b > size:
                why.append(f"ring {name} {b:.0f} past its size {size:.0f}")
        elif name not in RINGS.values() and b > 2 * a + 8:
            why.append(f"table {name} {a:.0f} -> {b:.0f}")
    return not why, why


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hicache-bench soak",
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--duration", type=float, default=300.0, help="seconds (300)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--pool-every", type=float, default=10.0,
                    help="seconds between pools created and deleted")
    ap.add_argument("--json", action="store_true", help="the report as one JSON object")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 unless flat, without errors and without wrong bytes")
    args = ap.parse_args(argv)
    if args.duration < 5 or args.workers < 1:
        ap.error("--duration >= 5, --workers >= 1")
    r = run(args.duration, args.workers, args.pool_every)
    if args.json:
        print(json.dumps(r))
    else:
        print(f"{r['seconds']} s: {r['sessions_opened']} sessions, {r['calls']} calls, "
              f"{r['errors']} errors, {r['wrong_bytes']} wrong bytes, {r['crashes']} crashes, "
              f"{r['pools_cycled']} pools created and deleted")
        print(f"RSS {r['rss_mb_start']} -> {r['rss_mb_end']} MiB, fds {r['fds_start']} -> "
              f"{r['fds_end']}, threads {r['threads_start']} -> {r['threads_end']}")
        for name, (a, b) in r["tables"].items():
            print(f"  {name:<24} {a:>8.0f} -> {b:.0f}")
        print("flat" if r["flat"] else f"NOT flat: {'; '.join(r['why_not_flat'])}")
    bad = not r["flat"] or r["errors"] or r["wrong_bytes"]
    return 1 if args.check and bad else 0
