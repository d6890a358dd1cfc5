"""Cache benchmark: what naming pages by key costs, measured side by side in one run.

1. Lookup of 128 and 4096 keys: p50 inside the daemon (the index alone, in this process) and
   end to end through a daemon process over its Unix socket.
2. Store and LoadKeys of 64-page batches vs raw Backup and Load of the very same host pages
   through the same daemon, session and shm buffers, alternating (target >= 0.95). Each Store
   writes new keys; between the keyed and the raw calls the keys are removed and their pages
   handed to a raw Alloc (untimed; the allocator gives the pages freed last first).
3. Eviction: the cost of a Store that must evict, per evicted page, beside one that finds free
   pages (the index alone).
4. Index bytes per key (tracemalloc over an index of 100,000 keys, plus the native tables'
   own count), for each eviction policy, filled and after five more poolfuls stored through
   it, against the estimate the pool table charges the memory budget (``KEY_INDEX_BYTES``).
5. Allocator free of 64 pages from a 7M-page pool (target <= 0.1 ms), beside the previous
   allocator's way of freeing (concatenating the whole free list), on the same pool size.

Run: ``python benchmarks/bench_cache.py [--quick] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache_bench.daemon import start_daemon
from hicache_client import HiCacheClient, ShmDeviceBuffers
from hicached import DType, HostPool, KVGeometry, Layout, PoolKind, PoolSpec
from hicached.cache.index_types import KEY_INDEX_BYTES
from hicached.cache.pool_cache import PoolCache
from hicached.cache.reuse_lru import ReuseLRU
from hicached.core.allocator import PageAllocator
from hicached.core.pool import MemoryOptions

GEOMETRY = KVGeometry(PoolKind.MHA, DType.BFLOAT16, layer_num=32, head_num=8, head_dim=128)
PAGE = 64
BATCH = 64
SMALL = KVGeometry(PoolKind.MHA, DType.BFLOAT16, layer_num=2, head_num=1, head_dim=8)


def median_ms(fn: Callable[[], object], reps: int) -> float:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


def keys_of(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i:08d}".encode().ljust(32, b".") for i in range(n)]


def index_pool(pages: int, eviction: str = "lru") -> tuple[HostPool, PoolCache]:
    spec = PoolSpec("index", SMALL, 1, Layout.LAYER_FIRST, size_tokens=pages)
    pool = HostPool(spec, MemoryOptions(hugepages=False, reserve_bytes=0))
    return pool, PoolCache(pool, eviction=eviction)


def fill(cache: PoolCache, keys: list[bytes]) -> None:
    for i in range(0, len(keys), 4096):
        t = cache.begin_store(keys[i:i + 4096])
        cache.finish_store(t, True)


def lookups(client: HiCacheClient, pool: str, reps: int) -> list[dict[str, Any]]:
    rows = []
    local_pool, cache = index_pool(8192)
    fill(cache, keys_of("k", 8192))
    for n in (128, 4096):
        keys = keys_of("k", n)
        client.lookup(pool, keys)

        def in_index(k: list[bytes] = keys) -> object:
            return cache.lookup(k)

        def end_to_end(k: list[bytes] = keys) -> object:
            return client.lookup(pool, k)

        rows.append({"keys": n, "in_daemon_ms": median_ms(in_index, reps),
                     "end_to_end_ms": median_ms(end_to_end, reps)})
    local_pool.close()
    return rows


def keyed_vs_raw(client: HiCacheClient, shm: Path, reps: int) -> list[dict[str, Any]]:
    """Store, LoadKeys, Backup and Load of the very same host pages: the keys' pages are freed
    (RemoveKeys) and handed to a raw Alloc, then freed again for the next Store (untimed)."""
    spec = PoolSpec("cache-bench", GEOMETRY, PAGE, Layout.PAGE_FIRST,
                    size_tokens=4 * BATCH * PAGE)
    client.create_pool(spec)
    rng = np.random.default_rng(0)
    nbytes = BATCH * spec.page_bytes
    times: dict[str, list[float]] = {"store": [], "load_keys": [], "backup": [], "load": []}

    @contextmanager
    def timed(op: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        times[op].append(time.perf_counter() - t0)

    with ShmDeviceBuffers.create(spec, 2 * BATCH * PAGE, str(shm), prefix="cache") as bufs:
        for t in bufs.all_tensors():
            t.view(torch.uint8).fill_(7)
        s = client.open_session(spec.name, "bench", bufs.descriptors, lease_ms=600_000)
        dev_pages = torch.from_numpy(rng.permutation(2 * BATCH)[:BATCH])
        dev = (dev_pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
        pages_seen: set[int] = set()
        for r in range(reps + 1):
            keys = keys_of(f"b{r}", BATCH)
            with timed("store"):
                s.store(keys, dev)
            with timed("load_keys"):
                s.load_keys(keys, dev)
            client.remove_keys(spec.name, keys)
            host = client.alloc(spec.name, BATCH * PAGE)  # the pages the keys just left
            pages_seen.update((host[::PAGE] // PAGE).tolist())
            with timed("backup"):
                s.backup(host, dev)
            with timed("load"):
                s.load(host, dev)
            client.free(spec.name, host)
        s.close()
    client.delete_pool(spec.name)
    assert len(pages_seen) == BATCH, "every operation was meant to use the same pages"
    out = []
    for op, keyed, raw in (("store vs backup", "store", "backup"),
                           ("load_keys vs load", "load_keys", "load")):
        mk, mr = statistics.median(times[keyed][1:]), statistics.median(times[raw][1:])
        out.append({"op": op, "bytes": nbytes, "keyed_gbps": nbytes / mk / 1e9,
                    "raw_gbps": nbytes / mr / 1e9, "ratio": mr / mk})
    return out


def eviction(reps: int) -> dict[str, Any]:
    pages = 4096
    pool, cache = index_pool(pages)
    fill(cache, keys_of("old", pages))
    evicting, free = [], []
    for r in range(reps):
        batch = keys_of(f"new{r}", BATCH)
        t0 = time.perf_counter()
        t = cache.begin_store(batch)  # the pool is full: evicts BATCH pages
        evicting.append(time.perf_counter() - t0)
        cache.finish_store(t, True)
        cache.remove(batch)  # now BATCH pages are free
        t0 = time.perf_counter()
        t = cache.begin_store(keys_of(f"again{r}", BATCH))
        free.append(time.perf_counter() - t0)
        cache.finish_store(t, True)
    pool.close()
    me, mf = statistics.median(evicting), statistics.median(free)
    return {"batch": BATCH, "store_evicting_ms": me * 1e3, "store_free_ms": mf * 1e3,
            "eviction_us_per_page": (me - mf) / BATCH * 1e6}


def index_bytes(n: int) -> dict[str, Any]:
    """Per key of a full pool of ``n`` pages, for each eviction policy: what filling it
    costs, and what it holds after five more poolfuls were stored through it (every Store
    evicting; the ``reuse`` ghost full). Python's allocations by tracemalloc, the native
    tables' by their own count (``nbytes``: tracemalloc does not see them)."""
    out: dict[str, Any] = {"keys": n, "charged": KEY_INDEX_BYTES}
    for name in ("lru", "reuse"):
        pool, cache = index_pool(n, name)
        keys = keys_of("m", 6 * n)  # the keys arrive from the wire either way; not counted
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        fill(cache, keys[:n])
        filled = tracemalloc.get_traced_memory()[0]
        fill(cache, keys[n:])
        steady = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        policy = cache.index._evictable
        native = policy.nbytes() if isinstance(policy, ReuseLRU) else 0
        pool.close()
        out[name] = {"fill_bytes_per_key": (filled - before) / n,
                         "steady_bytes_per_key": (steady - before + native) / n,
                         "native_bytes_per_key": native / n}
    out["bytes_per_key"] = out["lru"]["fill_bytes_per_key"]
    return out


def previous_free(free_list: np.ndarray, head: int, pages: np.ndarray) -> tuple[np.ndarray, int]:
    """How the previous allocator freed: concatenate the rest of the free list and the pages."""
    return np.concatenate([free_list[head:], pages]), 0


def allocator_free(pages: int, reps: int) -> dict[str, Any]:
    a = PageAllocator(pages, 1, layer_num=1)
    a.alloc(pages // 2)  # half the pool in use, half free
    ours = []
    for _ in range(reps):
        idx = a.alloc(BATCH)
        t0 = time.perf_counter()
        a.free(idx)
        ours.append(time.perf_counter() - t0)
    free_list = np.arange(pages // 2, dtype=np.int64)
    prev = []
    for _ in range(reps):
        taken = free_list[:BATCH].copy()
        t0 = time.perf_counter()
        free_list, _ = previous_free(free_list, BATCH, taken)
        prev.append(time.perf_counter() - t0)
    return {"pages": pages, "free_64_ms": statistics.median(ours) * 1e3,
            "previous_free_64_ms": statistics.median(prev) * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    reps = 5 if args.quick else 15
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="hicache-cache-bench-") as work, \
            tempfile.TemporaryDirectory(prefix="hicache-bench-", dir="/dev/shm") as shm_dir:
        proc, target = start_daemon(work, shm_dir, "8GiB")
        try:
            client = HiCacheClient(target)
            client.create_pool(PoolSpec("lookup", SMALL, 1, size_tokens=1024))
            report["lookup"] = lookups(client, "lookup", reps * 20)
            report["keyed_vs_raw"] = keyed_vs_raw(client, Path(shm_dir), reps)
            client.close()
        finally:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(30)
    report["eviction"] = eviction(reps * 4)
    report["index"] = index_bytes(20_000 if args.quick else 100_000)
    report["allocator"] = allocator_free(7_000_000, reps * 4)

    for r in report["lookup"]:
        print(f"Lookup of {r['keys']:>5} keys: p50 {r['in_daemon_ms']:.3f} ms in the index, "
              f"{r['end_to_end_ms']:.3f} ms end to end")
    print(f"\n64-page batches ({report['keyed_vs_raw'][0]['bytes'] >> 20} MiB), keyed vs raw "
          f"through one daemon, medians of {reps}:")
    print(f"{'op':<20}{'keyed GB/s':>12}{'raw GB/s':>10}{'ratio':>8}")
    for r in report["keyed_vs_raw"]:
        print(f"{r['op']:<20}{r['keyed_gbps']:>12.2f}{r['raw_gbps']:>10.2f}{r['ratio']:>8.2f}")
    e = report["eviction"]
    print(f"\nStore of {e['batch']} keys: {e['store_evicting_ms']:.3f} ms evicting vs "
          f"{e['store_free_ms']:.3f} ms into free pages -> {e['eviction_us_per_page']:.2f} us "
          f"per evicted page (index alone)")
    i = report["index"]
    for name in ("lru", "reuse"):
        r = i[name]
        print(f"index ({name}): {r['fill_bytes_per_key']:.0f} bytes per key filling "
              f"{i['keys']:,} pages, {r['steady_bytes_per_key']:.0f} after five poolfuls more "
              f"(native tables {r['native_bytes_per_key']:.0f}); the budget charges "
              f"{i['charged']}")
    a = report["allocator"]
    print(f"allocator, {a['pages']:,} pages: free of 64 pages {a['free_64_ms']:.4f} ms vs "
          f"{a['previous_free_64_ms']:.4f} ms for the previous way (concatenating the free "
          f"list)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
