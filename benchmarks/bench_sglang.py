"""SGLang linker benchmark: what the linker adds over the raw client calls, side by side.

SGLang's real MHATokenToKVPool, allocator and UnifiedRadixCache (CPU, built by SGLang's
factory with the hicached linker, as in tests/integrations/sglang/test_sglang_linker.py)
against a daemon process on a Unix socket. For a 64-page prefix already in the daemon,
alternating, medians of N:

- ``linker``: what the scheduler's cache calls: ``lookup`` + ``load`` +
  ``start_layer_wise_loading`` + the forward's per-layer waits through SGLang's pool
  (``get_key_buffer``) + ``finish_layer_wise_loading``;
- ``raw``: the same work as plain client calls on the linker's own session: ``Lookup`` +
  ``LoadKeys`` of the same keys into the same slots (target: linker <= 1.2x raw);
- ``sglang``: SGLang's whole admission of such a request (``match_prefix`` with its page
  hashing and tree walk + ``init_load_back`` + the same load), for context.

Offload: four 64-page write-throughs of new keys in flight through ``offload``, polled for
completion as the scheduler does (every 0.5 ms here), vs four ``store_async`` of the same
pages waited on directly, GB/s.

Two geometries: ``large`` (32 layers, 8 KV heads x 128, bf16, page 16: 128 MiB per 64 pages,
bandwidth-bound) and ``small`` (4 layers, 2 heads x 64, page 4: per-call costs dominate).
Bytes are checked once per geometry (device slots zeroed first).

Run: ``python benchmarks/bench_sglang.py [--quick] [--json FILE]``.
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
import uuid
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hicache_bench.daemon import start_daemon
from tests.sglang_harness import SGLangCache, install_stand_ins

PAGES = 64
INFLIGHT = 4
POLL_S = 0.0005  # the scheduler's poll of completed offloads, between steps
GEOMETRIES = {
    "large": {"page_size": 16, "layers": 32, "heads": 8, "head_dim": 128},
    "small": {"page_size": 4, "layers": 4, "heads": 2, "head_dim": 64},
}


def fill_random(c: SGLangCache, slots: torch.Tensor) -> None:
    for attr, _ in c.roles.values():
        for buf in getattr(c.kv, attr):
            b = buf.view(torch.uint8)
            b[slots] = torch.randint(0, 256, b[slots].shape, dtype=torch.uint8)


def snapshot(c: SGLangCache, slots: torch.Tensor) -> list[torch.Tensor]:
    return [buf.view(torch.uint8)[slots].clone() for attr, _ in c.roles.values()
            for buf in getattr(c.kv, attr)]


def run_geometry(name: str, target: str, shm_dir: str, reps: int) -> dict[str, Any]:
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.radix_cache import RadixKey

    g = GEOMETRIES[name]
    ps = g["page_size"]
    tokens_n = PAGES * ps
    c = SGLangCache(target, shm_dir, size=3 * tokens_n, v_head_dim=g["head_dim"],
                    model=f"bench/{name}", page_size=ps, layers=g["layers"],
                    heads=g["heads"], head_dim=g["head_dim"],
                    extra={"pool_size_tokens": (INFLIGHT + 2) * tokens_n})
    try:
        linker, counter = c.linker, c.counters[0]
        tokens = array("q", range(10, 10 + tokens_n))
        slots = c.allocator.alloc(tokens_n)
        fill_random(c, slots)
        want = snapshot(c, slots)
        c.cache.insert(InsertParams(key=RadixKey(tokens), value=slots))
        c.poll_offloads()
        c.evict_all()
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        keys = get_storage_hash_str(RadixKey(tokens), None, page_size=ps)
        assert len(keys) == PAGES
        session, client = linker.link.session, linker.link.client
        page_bytes = linker.spec.page_bytes
        nbytes = page_bytes * PAGES

        def via_linker(dst: torch.Tensor) -> None:
            assert linker.lookup("b", [PoolTransfer(PoolName.KV, keys=keys)])[-1] == PAGES
            assert linker.load("b", [PoolTransfer(PoolName.KV, device_indices=dst, keys=keys)])
            index = linker.start_layer_wise_loading()
            counter.set_consumer(index)
            for layer in range(c.layers):
                c.kv.get_key_buffer(layer)
            assert linker.finish_layer_wise_loading(index)

        def via_raw(dst: torch.Tensor) -> None:
            assert client.lookup(linker.spec.name, keys).hit_prefix == PAGES
            session.load_keys(keys, dst)

        def via_sglang(_: torch.Tensor) -> None:
            hit, failed, got = c.hit_and_load(tokens, rid="s")
            assert hit == tokens_n and not failed and got is not None
            c.allocator.free(got)

        # exactness once: zeroed slots, then what the linker loads
        dst = c.allocator.alloc(tokens_n)
        c.zero_kv()
        via_linker(dst)
        assert all(torch.equal(a, b) for a, b in zip(snapshot(c, dst), want, strict=True))

        times: dict[str, list[float]] = {"linker": [], "raw": [], "sglang": []}
        fns = {"linker": via_linker, "raw": via_raw, "sglang": via_sglang}
        for _ in range(reps):
            for op, fn in fns.items():
                t0 = time.perf_counter()
                fn(dst)
                times[op].append(time.perf_counter() - t0)
        load = {op: statistics.median(v) * 1e3 for op, v in times.items()}

        # offload: batches of new keys (every page is copied), INFLIGHT at a time as SGLang's
        # write-through issues them; the scheduler polls for completions between steps
        off: dict[str, list[float]] = {"linker": [], "raw": []}

        def batch() -> list[str]:
            return [uuid.uuid4().hex * 2 for _ in range(PAGES)]

        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(INFLIGHT):
                assert linker.offload([PoolTransfer(PoolName.KV, device_indices=dst,
                                                    keys=batch())])
            while linker.num_completed_offloads() < INFLIGHT:
                time.sleep(POLL_S)
            assert all(linker.pop_completed_offload() for _ in range(INFLIGHT))
            off["linker"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            futures = [session.store_async(batch(), dst) for _ in range(INFLIGHT)]
            assert all(f.result().stored == PAGES for f in futures)
            off["raw"].append(time.perf_counter() - t0)
        offload = {op: INFLIGHT * nbytes / statistics.median(v) / 1e9 for op, v in off.items()}
        return {"geometry": name, **g, "pages": PAGES, "bytes": nbytes,
                "load_ms": load, "load_ratio": load["linker"] / load["raw"],
                "offload_gbps": offload, "offload_ratio": offload["linker"] / offload["raw"]}
    finally:
        c.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    reps = 5 if args.quick else 21
    install_stand_ins()
    out = []
    with tempfile.TemporaryDirectory(prefix="hicache-sglang-bench-") as work, \
            tempfile.TemporaryDirectory(prefix="hicache-bench-", dir="/dev/shm") as shm_dir:
        proc, target = start_daemon(work, shm_dir, "4GiB")
        try:
            for name in GEOMETRIES:
                out.append(run_geometry(name, target, shm_dir, reps))
        finally:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(30)
    print(f"\n64-page prefix hit, medians of {reps} (ms; ratio = linker / raw, target <= 1.2):")
    print(f"{'geometry':<8}{'MiB':>6}{'linker':>9}{'raw':>9}{'ratio':>7}{'sglang':>9}")
    for r in out:
        m = r["load_ms"]
        print(f"{r['geometry']:<8}{r['bytes'] >> 20:>6}{m['linker']:>9.2f}{m['raw']:>9.2f}"
              f"{r['load_ratio']:>7.2f}{m['sglang']:>9.2f}")
    print(f"\n{INFLIGHT} x 64-page offloads in flight (new keys), GB/s "
          "(ratio = linker / raw Store):")
    for r in out:
        o = r["offload_gbps"]
        print(f"{r['geometry']:<8}{o['linker']:>9.2f}{o['raw']:>9.2f}{r['offload_ratio']:>7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
