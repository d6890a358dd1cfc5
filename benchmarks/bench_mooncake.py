"""The cluster tier's put / get throughput against Mooncake's own Python calls on the same bytes.

Everything runs in a private network namespace (the script re-executes itself under
``unshare -n``; Mooncake binds wildcard addresses): a Mooncake master, a holder process that
lends the only memory segment (so every page crosses TCP to it, on both paths), two daemons
with no segment of their own (A writes, B reads), and the baseline client in this process.

Rows, per page size (PAGE_FIRST pools: one contiguous run per page):

- put: a worker's Store of N pages into daemon A (write policy ``through``), timed until A
  reports all N put into the cluster (``GetPool.cluster_puts``; the Store's host copy
  included), vs one ``batch_put_from`` of the same N pages from a registered buffer.
- the same two baselines with each page as the two runs (K, V) the pool holds it in, through
  ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``: what Mooncake itself
  does with the pool's layout.
- get: daemon B's LoadKeys of N keys only the cluster holds (one ``batch_get_into`` into
  fresh host pages, then the copy into the worker's rows, zeroed first and checked), vs one
  ``batch_get_into`` of the same keys into a registered buffer.

Rounds alternate daemon and baseline so that drift hits both; medians are printed.

Usage: python benchmarks/bench_mooncake.py [--rounds 7] [--json]   (root, or user namespaces)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec  # noqa: E402
from hicache_client import HiCacheClient, ShmDeviceBuffers  # noqa: E402
from tests.daemon_proc import DaemonProc, start_daemon  # noqa: E402
from tests.mooncake_env import master_binary, mooncake_toml  # noqa: E402

GEOMETRY = KVGeometry(PoolKind.MHA, DType.BFLOAT16, layer_num=32, head_num=8, head_dim=128)
MASTER = "127.0.0.1:50051"
HOLDER = """
import sys, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
assert s.setup("127.0.0.1", "P2PHANDSHAKE", int(sys.argv[1]), 16 << 20, "tcp", "",
               sys.argv[2]) == 0
print("ready", flush=True)
time.sleep(1e9)
"""


def raw_client(nbytes: int) -> tuple[Any, mmap.mmap, int]:
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", MASTER) == 0
    buf = mmap.mmap(-1, nbytes)
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert s.register_buffer(ptr, nbytes) == 0
    return s, buf, ptr


def op_seconds(d: DaemonProc, op: str) -> float:
    """Seconds the daemon spent in the store's ``op`` calls so far (its own histogram)."""
    with HiCacheClient(d.target) as c:
        port = c.get_info().metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(rf'^hicache_remote_op_seconds_sum{{op="{op}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def one_size(page: int, n: int, rounds: int, a: DaemonProc, b: DaemonProc) -> dict[str, Any]:
    spec = PoolSpec(f"bench-p{page}", GEOMETRY, page, Layout.PAGE_FIRST,
                    size_tokens=page * n * 2)
    nbytes = n * spec.page_bytes
    ca, cb = HiCacheClient(a.target), HiCacheClient(b.target)
    ca.create_pool(spec)
    cb.create_pool(spec)
    ba = ShmDeviceBuffers.create(spec, n * page, sealed=True)
    bb = ShmDeviceBuffers.create(spec, n * page, sealed=True)
    sa = ca.open_session(spec.name, "bench-a", ba.descriptors, fds=ba.fds, heartbeat=True)
    sb = cb.open_session(spec.name, "bench-b", bb.descriptors, fds=bb.fds, heartbeat=True)
    rows_a = [t.view(torch.uint8) for t in ba.all_tensors()]
    rows_b = [t.view(torch.uint8) for t in bb.all_tensors()]
    store, _buf, ptr = raw_client(nbytes)
    ptrs = [ptr + i * spec.page_bytes for i in range(n)]
    sizes = [spec.page_bytes] * n
    out: dict[str, list[float]] = {k: [] for k in ("put", "raw_put", "get", "raw_get",
                                                   "tier_put", "tier_get", "runs_put",
                                                   "runs_get")}
    half = spec.page_bytes // 2  # the pool's page is two runs, K then V: the same for Mooncake
    run_ptrs = [[p, p + half] for p in ptrs]
    run_sizes = [[half, half]] * n
    idx = torch.arange(n * page)
    for r in range(rounds + 1):  # round 0 warms connections and pages up, not counted
        keys = [b"r%d-%d" % (r, i) for i in range(n)]
        for t in rows_a:
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
        done = ca.get_pool(spec.name).cluster_puts
        in_put, in_get = op_seconds(a, "put"), op_seconds(b, "get")
        t0 = time.perf_counter()
        assert sa.store(keys, idx).stored == n
        while ca.get_pool(spec.name).cluster_puts < done + n:
            time.sleep(0.001)  # a poll of its own, off the two CPUs the daemons share
        put = time.perf_counter() - t0
        for t in rows_b:
            t.zero_()
        t0 = time.perf_counter()
        sb.load_keys(keys, idx)
        get = time.perf_counter() - t0
        tier_put = op_seconds(a, "put") - in_put
        tier_get = op_seconds(b, "get") - in_get
        assert all(torch.equal(x[:n * page], y[:n * page])
                   for x, y in zip(rows_a, rows_b, strict=True)), "B loaded other bytes"
        names = [f"raw/{r}/{i}" for i in range(n)]
        t0 = time.perf_counter()
        assert store.batch_put_from(names, ptrs, sizes) == [0] * n
        raw_put = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert store.batch_get_into(names, ptrs, sizes) == sizes
        raw_get = time.perf_counter() - t0
        store.batch_remove(names, True)
        t0 = time.perf_counter()
        assert store.batch_put_from_multi_buffers(names, run_ptrs, run_sizes) == [0] * n
        runs_put = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = store.batch_get_into_multi_buffers(names, run_ptrs, run_sizes)
        runs_get = time.perf_counter() - t0
        assert got == sizes, got
        store.batch_remove(names, True)
        ca.remove_keys(spec.name, keys)  # from A's host memory and the cluster
        if r:
            for k, v in (("put", put), ("raw_put", raw_put), ("get", get), ("raw_get", raw_get),
                         ("tier_put", tier_put), ("tier_get", tier_get),
                         ("runs_put", runs_put), ("runs_get", runs_get)):
                out[k].append(nbytes / v / 1e9)
    sa.close()
    sb.close()
    store.unregister_buffer(ptr)
    store.close()
    for c in (ca, cb):
        c.delete_pool(spec.name)
        c.close()
    ba.close()
    bb.close()
    med = {k: statistics.median(v) for k, v in out.items()}
    return {"page_bytes": spec.page_bytes, "pages": n, "rounds": rounds,
            **{f"{k}_gbps": round(v, 3) for k, v in med.items()},
            "put_ratio": round(med["put"] / med["raw_put"], 3),
            "get_ratio": round(med["get"] / med["raw_get"], 3),
            "tier_put_ratio": round(med["tier_put"] / med["raw_put"], 3),
            "tier_get_ratio": round(med["tier_get"] / med["raw_get"], 3),
            "runs_put_ratio": round(med["tier_put"] / med["runs_put"], 3),
            "runs_get_ratio": round(med["tier_get"] / med["runs_get"], 3)}


def inner(args: argparse.Namespace) -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    work = Path(tempfile.mkdtemp(prefix="hicache-bench-mc-"))
    procs: list[subprocess.Popen[bytes]] = []
    daemons: list[DaemonProc] = []
    try:
        host, port = MASTER.split(":")
        procs.append(subprocess.Popen(
            [master_binary(), f"--rpc_address={host}", f"--rpc_port={port}",
             "--metrics_host=127.0.0.1", "--metrics_port=50052"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(0.5)
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(1 << 30), MASTER],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        procs.append(holder)
        assert holder.stdout is not None and holder.stdout.readline().startswith(b"ready")
        cfg = work / "tier.toml"
        cfg.write_text(mooncake_toml(MASTER, segment_size=0, timeout_seconds=10.0))
        for name in ("a", "b"):
            (work / name).mkdir()
            daemons.append(start_daemon(work / name, "--config", str(cfg), "--memory-budget",
                                        "4GiB", "--log-level", "WARNING"))
        for d in daemons:
            with HiCacheClient(d.target) as c:
                while c.get_info().cluster_tier != "up":
                    time.sleep(0.05)
        rows = [one_size(page, n, args.rounds, *daemons) for page, n in ((16, 64), (64, 16))]
    finally:
        for d in daemons:
            d.stop(signal.SIGTERM)
        for p in procs:
            p.kill()
            p.wait()
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"cluster tier over TCP in one namespace, medians of {args.rounds} rounds "
          "(GB/s; daemon vs Mooncake's own batch_put_from / batch_get_into, same bytes)")
    print("tier: the daemon's own put / get calls (its hicache_remote_op_seconds); end to "
          "end: Store until put / LoadKeys, host copies included")
    print(f"{'page':>6} {'pages':>5} | {'raw put':>7} {'tier':>5} {'ratio':>5} {'e2e':>5} "
          f"{'ratio':>5} | {'raw get':>7} {'tier':>5} {'ratio':>5} {'e2e':>5} {'ratio':>5}")
    for r in rows:
        print(f"{r['page_bytes'] >> 20:>4}Mi {r['pages']:>5} | {r['raw_put_gbps']:>7.2f} "
              f"{r['tier_put_gbps']:>5.2f} {r['tier_put_ratio']:>5.2f} {r['put_gbps']:>5.2f} "
              f"{r['put_ratio']:>5.2f} | {r['raw_get_gbps']:>7.2f} {r['tier_get_gbps']:>5.2f} "
              f"{r['tier_get_ratio']:>5.2f} {r['get_gbps']:>5.2f} {r['get_ratio']:>5.2f}")
    print("the same pages as two runs each (K, V), as the pool holds them, through Mooncake's "
          "batch_*_multi_buffers:")
    for r in rows:
        print(f"{r['page_bytes'] >> 20:>4}Mi {r['pages']:>5} | put {r['runs_put_gbps']:.2f} "
              f"GB/s, tier / it {r['runs_put_ratio']:.2f} | get {r['runs_get_gbps']:.2f} GB/s, "
              f"tier / it {r['runs_get_ratio']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner:
        inner(args)
        return
    flags = ["-n"] if os.geteuid() == 0 else ["-rn"]
    os.execvp("unshare", ["unshare", *flags, sys.executable, __file__, "--inner",
                          *sys.argv[1:]])


if __name__ == "__main__":
    main()
