"""``hicache-bench torture``: the daemon SIGKILLed again and again under load, its crash
contract checked after every restart (docs/operations.md, "What a crash keeps").

A daemon with a state directory (pools in files on /dev/shm) and a disk tier below its pool
serves worker processes (``hicache_bench.workload``, mode ``torture``) that store fresh keys
and remove stored ones, announcing each call before they send it and each acknowledgement
after its reply. Each loop lets them run for a random while, SIGKILLs the daemon at that
instant, stops the workers (SIGSTOP: nothing moves while the books are read), starts the
daemon again on the same socket and state directory, waits for the pool to be back, and
checks against what the workers were told:

- every key whose Store was acknowledged and not removed since is served (``promised_lost``
  counts those that are not): the pool holds every key of the run, so nothing is evicted;
- every key whose RemoveKeys was acknowledged stays removed (``removed_back``);
- a key served has the bytes stored under it, loaded into rows zeroed first (``wrong``): all
  of those acknowledged in the last loop, those in flight at the kill (served or not, never
  wrong), and a sample of the older ones (``keys_verified`` counts them).

Then the workers go on (SIGCONT), reconnecting as real workers do. Prints one JSON object:
``loops``, ``kills``, ``keys_verified``, ``keys_checked`` (looked up), ``wrong``,
``promised_lost``, ``removed_back``, ``in_flight_served`` / ``in_flight_absent`` (the
contract allows both), ``stored``, ``removed``, ``seconds``. Exit status 1 with ``--check``
when anything is wrong, lost or back.

Primitives: ``Ledger`` (what the workers were told), ``run(loops, workers, ...)``,
``main(argv)``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from hicache.errors import HiCacheError
from hicache_bench.daemon import start_daemon
from hicache_bench.workload import Pages, key_of, spec
from hicache_client import HiCacheClient, ShmDeviceBuffers

POOL_PAGES = 1 << 18
"""Pages of the torture's pool (512 MiB of 2 KiB pages): more than a run stores."""
SAMPLE = 256
"""Older keys whose bytes are checked after each restart (all of the last loop's are)."""
VERIFY = 64
"""Pages per verifying load."""


class Ledger:
    """What the workers were told, from their lines (one reader thread each)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stored: set[int] = set()
        """Acknowledged Stores, not removed since."""
        self.removed: set[int] = set()
        """Acknowledged RemoveKeys."""
        self.tried: set[int] = set()
        """Stores sent and not (yet) acknowledged: in flight at some kill, or now."""
        self.removing: set[int] = set()
        """RemoveKeys sent and not (yet) acknowledged."""
        self.fresh: set[int] = set()
        """Acknowledged since the last check."""
        self.fatal: list[str] = []
        self.errors = 0
        self.lines = 0
        """Lines read so far: stable once the stopped workers' pipes are drained."""

    def quiesce(self, quiet: float = 0.2, limit: float = 10.0) -> None:
        """Wait until no line came for ``quiet`` seconds (the workers are stopped)."""
        end = time.monotonic() + limit
        seen = -1
        while time.monotonic() < end:
            with self.lock:
                now = self.lines
            if now == seen:
                return
            seen = now
            time.sleep(quiet)

    def read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self.lock:
                self.lines += 1
                if "try" in msg:
                    self.tried.update(msg["try"])
                elif "stored" in msg:
                    got = set(msg["stored"])
                    self.stored |= got
                    self.fresh |= got
                    self.tried -= got
                elif "removing" in msg:
                    self.removing.update(msg["removing"])
                    self.stored.difference_update(msg["removing"])
                elif "removed" in msg:
                    self.removed.update(msg["removed"])
                    self.removing.difference_update(msg["removed"])
                elif "error" in msg:
                    self.errors += 1
                elif "fatal" in msg:
                    self.fatal.append(msg["fatal"])


class _Verifier:
    """A session of its own that looks keys up and loads them into rows zeroed first."""

    def __init__(self, target: str, pool: str) -> None:
        self.client = HiCacheClient(target, reconnect_seconds=30)
        self.pool = pool
        s = self.client.get_pool(pool).spec
        self.bufs = ShmDeviceBuffers.create(s, VERIFY * s.page_size, sealed=True)
        self.pages = Pages(self.bufs, s.page_size)
        self.session = self.client.open_session(pool, "torture-verifier", self.bufs.descriptors,
                                                 fds=self.bufs.fds)
        self.max_keys = self.client.get_info().max_keys_per_call or 65536

    def served(self, numbers: list[int]) -> set[int]:
        """Which of ``numbers`` the pool serves (host memory or the disk below)."""
        out: set[int] = set()
        for at in range(0, len(numbers), self.max_keys):
            part = numbers[at:at + self.max_keys]
            tiers = self.client.lookup(self.pool, [key_of(n) for n in part]).tiers
            out.update(n for n, t in zip(part, bytes(tiers), strict=True) if t)
        return out

    def wrong(self, numbers: list[int]) -> tuple[int, int]:
        """(keys whose bytes differ from what was stored under them, keys loaded): each
        loaded alone-or-with-others into rows zeroed first; a key gone meanwhile is not
        counted."""
        bad = loaded = 0
        for at in range(0, len(numbers), VERIFY):
            part = numbers[at:at + VERIFY]
            held = self.session.lookup([key_of(n) for n in part], 30_000)
            for n in part:  # one key per load: a prefix miss elsewhere costs nothing
                self.pages.zero(range(0, 1))
                try:
                    self.session.load_keys([key_of(n)], self.pages.indices(range(0, 1)))
                except HiCacheError:
                    continue  # not there (counted by the lookups), or not servable
                loaded += 1
                bad += self.pages.check(0, key_of(n)) > 0
            if held.held:
                self.session.release_holds()
        return bad, loaded

    def close(self) -> None:
        try:
            self.session.close()
        except HiCacheError:
            pass
        self.client.close()
        self.bufs.close()


def _wait_pool(target: str, pool: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    with HiCacheClient(target, reconnect_seconds=timeout) as c:
        while True:
            try:
                if c.get_pool(pool).state == "READY":
                    return
            except HiCacheError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"pool {pool} did not come back within {timeout:.0f} s")
            time.sleep(0.05)


def run(loops: int, workers: int = 4, min_run: float = 0.3, max_run: float = 1.5,
        pause: float = 0.01, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    work = tempfile.mkdtemp(prefix="hicache-torture-")
    shm = tempfile.mkdtemp(prefix="hicache-torture-", dir="/dev/shm")
    state = os.path.join(shm, "state")
    flags = ("--disk-path", os.path.join(work, "disk"), "--disk-capacity", "256MiB",
             "--lease-seconds", "2")
    proc, target = start_daemon(work, shm, "1GiB", "", *flags, state_dir=state)
    pool = spec("torture", POOL_PAGES)
    ledger = Ledger()
    procs: list[subprocess.Popen[str]] = []
    out: dict[str, Any] = {"loops": 0, "kills": 0, "keys_verified": 0, "keys_checked": 0,
                           "wrong": 0, "promised_lost": 0, "removed_back": 0,
                           "in_flight_served": 0, "in_flight_absent": 0}
    t0 = time.monotonic()
    try:
        with HiCacheClient(target) as c:
            c.create_pool(pool)
        for w in range(workers):
            p = subprocess.Popen(
                [sys.executable, "-m", "hicache_bench.workload", target, pool.name,
                 str(w + 1), "torture", "--pause", str(pause),
                 *(["--grpc"] if w % 2 else [])],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            procs.append(p)
            threading.Thread(target=ledger.read, args=(p,), daemon=True).start()
        for _ in range(loops):
            time.sleep(rng.uniform(min_run, max_run))
            proc.send_signal(signal.SIGKILL)  # at whatever instant the load is at
            proc.wait(30)
            out["kills"] += 1
            for p in procs:
                p.send_signal(signal.SIGSTOP)
            ledger.quiesce()  # the lines they wrote before they stopped are read
            proc, _ = start_daemon(work, shm, "1GiB", "", *flags, state_dir=state)
            _wait_pool(target, pool.name)
            _check(target, pool.name, ledger, rng, out)
            out["loops"] += 1
            for p in procs:
                p.send_signal(signal.SIGCONT)
            if ledger.fatal:
                raise RuntimeError("; ".join(ledger.fatal))
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait(30)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    with ledger.lock:
        out.update(stored=len(ledger.stored), removed=len(ledger.removed),
                   worker_errors=ledger.errors, seconds=round(time.monotonic() - t0, 1))
    return out


def _check(target: str, pool: str, ledger: Ledger, rng: random.Random,
           out: dict[str, Any]) -> None:
    with ledger.lock:
        stored, removed = sorted(ledger.stored), sorted(ledger.removed)
        in_flight = sorted(ledger.tried | ledger.removing)
        fresh, ledger.fresh = sorted(ledger.fresh & ledger.stored), set()
    v = _Verifier(target, pool)
    try:
        served = v.served(stored)
        out["promised_lost"] += len(stored) - len(served)
        out["removed_back"] += len(v.served(removed))
        out["keys_checked"] += len(stored) + len(removed) + len(in_flight)
        flying = v.served(in_flight)
        out["in_flight_served"] += len(flying)
        out["in_flight_absent"] += len(in_flight) - len(flying)
        with ledger.lock:  # judged once: a call in flight at this kill never answers
            ledger.tried.difference_update(in_flight)
            ledger.removing.difference_update(in_flight)
        older = [n for n in stored if n not in set(fresh)]
        sample = fresh + rng.sample(older, min(SAMPLE, len(older))) + sorted(flying)
        bad, loaded = v.wrong(sample)
        out["wrong"] += bad
        out["keys_verified"] += loaded
    finally:
        v.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hicache-bench torture",
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--loops", type=int, default=20, help="kills and restarts (20)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="of the kill instants")
    ap.add_argument("--json", action="store_true", help="the report as one JSON object")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when a byte was wrong, a promise lost or a removal back")
    args = ap.parse_args(argv)
    if args.loops < 1 or args.workers < 1:
        ap.error("--loops >= 1, --workers >= 1")
    r = run(args.loops, args.workers, seed=args.seed)
    if args.json:
        print(json.dumps(r))
    else:
        print(f"{r['loops']} loops, {r['kills']} kills in {r['seconds']} s: "
              f"{r['stored']} keys stored, {r['removed']} removed; after each restart "
              f"{r['keys_checked']} looked up, {r['keys_verified']} loaded and checked")
        print(f"wrong {r['wrong']}, promised but lost {r['promised_lost']}, removed but "
              f"back {r['removed_back']}; in flight at a kill: {r['in_flight_served']} "
              f"served, {r['in_flight_absent']} absent")
    bad = r["wrong"] or r["promised_lost"] or r["removed_back"]
    return 1 if args.check and bad else 0
