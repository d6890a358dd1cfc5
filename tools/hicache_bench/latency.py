"""One latency run of one source tree: a fresh daemon, each data call timed, one JSON line out.

``hicache-bench compare`` (``hicache_bench.compare``) runs this file as a script, copied out of
the tree it belongs to, under the Python path of either tree it compares, so it must work
against the older tree too: it uses only the daemon's command line and the client API both
have had since the fast path's adaptive polling (e694450): ``hicached serve`` with
``--fast-path-spin-us``, ``HiCacheClient(target, fast_path=, spin_us=)``, ``create_pool``,
``open_session``, ``store``, ``load_keys``, ``lookup`` and ``ShmDeviceBuffers``.

Primitives:

- ``PATHS``: how the calls travel: ``fast`` (the fast path with its default poll windows, daemon
  and client), ``fast-nopoll`` (the fast path, daemon ``--fast-path-spin-us 0`` and client
  ``spin_us=0``: what a busy node gets), ``grpc`` (the client with ``fast_path=False``).
- ``OPS``: ``store_1``, ``store_64``, ``load_1``, ``load_64`` (pages per call) and
  ``lookup_128`` (keys per call), each at both ``PAGES``: ``small`` (64 KiB) and ``large``
  (1 MiB), in a pool of ``POOL_PAGES``. A store names fresh keys (it copies its pages; once the
  pool is full it evicts), a load loads stored keys into other device rows, a lookup asks
  stored keys.
- ``run(path, calls, work)``: start a daemon for ``path``, time ``calls`` calls of every op
  (after a few untimed ones), stop it; returns {``"<page>/<op>"``: [seconds per call]}.
- ``main()``: ``python latency.py --path P [--calls N] [--ops A,B] [--pages small]
  [--shm-root DIR]`` prints that mapping as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers

PATHS = ("fast", "fast-nopoll", "grpc")
OPS = ("store_1", "store_64", "load_1", "load_64", "lookup_128")
PAGE_TOKENS = 16
PAGES = {
    # 8 layers x 2 heads x 64 x 16 tokens x K/V, bf16: 64 KiB
    "small": KVGeometry(PoolKind.MHA, DType.BFLOAT16, layer_num=8, head_num=2, head_dim=64),
    # 16 layers x 8 heads x 128 x 16 tokens x K/V, bf16: 1 MiB
    "large": KVGeometry(PoolKind.MHA, DType.BFLOAT16, layer_num=16, head_num=8, head_dim=128),
}
WARMUP = 3
"""Untimed calls of each op before its timed ones (first-call costs: page faults, caches)."""


POOL_PAGES = 512
"""Pages of each pool: the stores run first and fill it (then evict, least recently stored
first, as a full cache does), then the 128 keys loads and lookups use are stored."""


def _start_daemon(work: str, shm: str, spin_us: int | None, budget: int) -> tuple[
        subprocess.Popen[bytes], str]:
    """The daemon as it runs by default (its pools in files on tmpfs, as under the default
    ``state_dir``), on a socket and state directory of this run's own."""
    sock = os.path.join(work, "d.sock")
    cmd = [sys.executable, "-m", "hicached", "serve", "--listen", f"unix:{sock}",
           "--shm-dir", shm, "--metrics-listen", "127.0.0.1:0", "--memory-budget", str(budget),
           "--reserve", "0", "--state-dir", os.path.join(shm, "state"),
           "--log-level", "WARNING"]
    if spin_us is not None:
        cmd += ["--fast-path-spin-us", str(spin_us)]
    log = open(os.path.join(work, "daemon.log"), "w+b")  # noqa: SIM115 (the daemon's life)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    target = f"unix:{sock}"
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the daemon exited with status {proc.returncode} at start: "
                               f"{log.read()[-1500:].decode(errors='replace')}")
        if os.path.exists(sock):
            try:
                with HiCacheClient(target, timeout=5) as c:
                    c.ping()
                return proc, target
            except Exception:
                pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the daemon did not answer within 60 s")
        time.sleep(0.05)


def _time(fn: Callable[[int], object], calls: int) -> list[float]:
    for i in range(WARMUP):
        fn(i)
    out = []
    for i in range(WARMUP, WARMUP + calls):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def _run_page(client: HiCacheClient, page: str, ops: list[str], calls: int, shm: str
              ) -> dict[str, list[float]]:
    spec = PoolSpec(f"lat-{page}", PAGES[page], PAGE_TOKENS,
                    size_tokens=POOL_PAGES * PAGE_TOKENS)
    client.create_pool(spec)
    rows = 2 * 64 * PAGE_TOKENS  # 64 pages stores read from, 64 pages loads write to
    bufs = ShmDeviceBuffers.create(spec, rows, shm, prefix=f"lat-{page}")
    try:
        for t in bufs.all_tensors():
            t.view(torch.uint8).random_()
        session = client.open_session(spec.name, f"lat-{page}", bufs.descriptors,
                                      heartbeat=False)
        sid = session.session_id

        def device_rows(pages: int, second_half: bool) -> torch.Tensor:
            base = 64 * PAGE_TOKENS if second_half else 0
            return torch.arange(base, base + pages * PAGE_TOKENS)

        stored = [os.urandom(32) for _ in range(128)]
        fresh = iter(os.urandom(32) for _ in range(1 << 30))
        calls_of: dict[str, Callable[[int], object]] = {
            "store_1": lambda i: client.store(sid, [next(fresh)], device_rows(1, False)),
            "store_64": lambda i: client.store(sid, [next(fresh) for _ in range(64)],
                                               device_rows(64, False)),
            "load_1": lambda i: client.load_keys(sid, [stored[i % 128]], device_rows(1, True)),
            "load_64": lambda i: client.load_keys(sid, stored[(i % 2) * 64:(i % 2) * 64 + 64],
                                                  device_rows(64, True)),
            "lookup_128": lambda i: client.lookup(spec.name, stored),
        }
        out = {f"{page}/{op}": _time(calls_of[op], calls) for op in ops
               if op.startswith("store")}
        for i in range(0, 128, 64):  # the most recently stored: none is evicted
            client.store(sid, stored[i:i + 64], device_rows(64, False))
        out.update({f"{page}/{op}": _time(calls_of[op], calls) for op in ops
                    if not op.startswith("store")})
        session.close()
        return out
    finally:
        bufs.close()


def run(path: str, calls: int, work: str, ops: list[str] | None = None,
        pages: list[str] | None = None, shm_root: str = "/dev/shm") -> dict[str, list[float]]:
    """A fresh daemon for ``path``; ``calls`` timed calls of each op at each page size. Its
    state directory and the worker's buffers go in a new directory under ``shm_root``."""
    ops = list(ops or OPS)
    pages = list(pages or PAGES)
    budget = sum(POOL_PAGES * PoolSpec("x", PAGES[p], PAGE_TOKENS,
                                       size_tokens=PAGE_TOKENS).page_bytes
                 for p in pages) + (256 << 20)
    shm = tempfile.mkdtemp(prefix="hicache-lat-", dir=shm_root)
    proc, target = _start_daemon(work, shm, 0 if path == "fast-nopoll" else None, budget)
    try:
        kw: dict[str, object] = {"fast_path": path != "grpc"}
        if path == "fast-nopoll":
            kw["spin_us"] = 0
        with HiCacheClient(target, **kw) as client:  # type: ignore[arg-type]
            out: dict[str, list[float]] = {}
            for page in pages:
                out.update(_run_page(client, page, ops, calls, shm))
            if client.data_path != ("grpc" if path == "grpc" else "fast"):
                raise RuntimeError(f"calls took the {client.data_path} path, not {path}")
            return out
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(shm, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--path", choices=PATHS, required=True)
    ap.add_argument("--calls", type=int, default=50, help="timed calls per op")
    ap.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of OPS")
    ap.add_argument("--pages", default=",".join(PAGES), help="small, large or both")
    ap.add_argument("--shm-root", default="/dev/shm",
                    help="a tmpfs directory for the run's state directory and buffers")
    args = ap.parse_args(argv)
    ops, pages = args.ops.split(","), args.pages.split(",")
    if set(ops) - set(OPS) or set(pages) - set(PAGES) or args.calls < 1:
        ap.error(f"--ops from {OPS}, --pages from {tuple(PAGES)}, --calls >= 1")
    work = tempfile.mkdtemp(prefix="hicache-lat-")
    try:
        print(json.dumps(run(args.path, args.calls, work, ops, pages, args.shm_root)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
