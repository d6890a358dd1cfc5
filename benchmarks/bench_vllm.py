"""vLLM offloading benchmark: what hicached's spec adds over the raw client calls, side by side.

vLLM's own ``Scheduler`` and ``OffloadingConnector`` (both roles, CPU; the newest release
served, or ``--vllm RELEASE``) with
``hicache_vllm.spec`` against a daemon process on a Unix socket (``tests/vllm_harness.py``'s
engine, its stand-in forward switched off: no compute is timed). For a 64-block prefix already
in the daemon, alternating, medians of N:

- ``connector``: a request with that prefix, from its first scheduler step to its end through
  vLLM's steps (its lookups answered RETRY then HIT, the load job submitted, the blocks loaded
  into its KV while the engine steps, the last token scheduled), vLLM's own prefix cache reset
  first; ``connector_sync`` the same with vLLM's synchronous loads (``sync_load_budget_bytes``:
  the load waited for within the step that computes the last token);
- ``vllm_cached``: the same request again right after, its blocks in vLLM's own prefix cache:
  the steps vLLM takes for a hit without any connector (the floor of ``connector``);
- ``spec``: the same hit through the spec's calls alone (``lookup`` of every key until HIT,
  ``prepare_load``, ``submit_load``, ``wait``, ``complete_load``), no scheduler;
- ``raw``: the same work as plain client calls on the worker's own session: a held
  ``Lookup`` and a ``LoadKeys`` of the same keys into the same staging rows, then the copy into
  the same blocks of the KV tensors (target: connector <= 1.2x raw).

Stores: 64 new blocks through the worker (``prepare_store`` + ``submit_store`` + ``wait``)
against the raw gather into the staging rows + ``Store``, GB/s.

Beside them, vLLM's own ``CPUOffloadingManager`` (its bookkeeping for the same 64 keys:
``lookup`` of each, ``prepare_load``, ``complete_load``); its worker needs CUDA and cannot
run here, so no bytes move in that column: it is the floor of a manager that holds nothing
outside the engine.

Two geometries: ``large`` (32 layers, 8 KV heads x 128, bf16, block 16: 128 MiB per 64 blocks)
and ``small`` (4 layers, 2 heads x 64, fp32, block 16: per-call costs dominate). Bytes are
checked once per geometry (KV zeroed first).

Run: ``python benchmarks/bench_vllm.py [--quick] [--vllm RELEASE] [--json FILE]`` (it runs
itself with that release's code from ``.vllm-<release>``, as the tests do).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BLOCKS = 64
GEOMETRIES: dict[str, dict[str, Any]] = {
    "large": {"layers": 32, "heads": 8, "head_size": 128, "dtype": "bfloat16"},
    "small": {"layers": 4, "heads": 2, "head_size": 64, "dtype": "float32"},
}


def _reexec(release: str) -> None:
    """Run again with that vLLM release's code on the path, as the tests run their engines."""
    vllm = REPO / f".vllm-{release}"
    if not (vllm / ".complete").exists():
        sys.exit(f"vLLM's code is not in {vllm}: bash scripts/test.sh (or scripts/setup.sh "
                 "--test) puts it there")
    env = dict(os.environ, PYTHONPATH=f"{vllm}:{REPO}", VLLM_TARGET_DEVICE="cpu",
               HF_HUB_OFFLINE="1", HICACHED_BENCH_VLLM="1")
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 997 + 1 for i in range(n)]


class Bench:
    def __init__(self, geometry: str, target: str, model: str, **extra: Any) -> None:
        import torch

        from tests.vllm_harness import Engine

        g = dict(GEOMETRIES[geometry])
        g["dtype"] = getattr(torch, g["dtype"])
        self.e = e = Engine(model, target, num_blocks=3 * BLOCKS + 8,
                            extra={"staging_blocks": BLOCKS,  # a hit is held up to 1/4 of a pool
                                   "pool_size_tokens": 8 * BLOCKS * 16, **extra}, **g)
        e._forward = lambda rid, start, n: None  # type: ignore[method-assign]  # no compute
        e._check_done = lambda done: None  # type: ignore[method-assign]
        self.bs = e.block_size
        self.manager = e.scheduler_side.manager
        self.worker = e.worker.connector_worker.worker
        self.n = 0
        end = time.monotonic() + 30
        while not e.links_up():  # the sessions open in the background
            assert time.monotonic() < end, "the daemon links never came up"
            time.sleep(0.01)

    def step_until_done(self, rid: str) -> None:
        sched = self.e.scheduler
        while rid in sched.requests or sched.has_finished_requests():
            self.e.step()

    def drain(self) -> None:
        """Untimed: every transfer ended, the requests forgotten, vLLM's prefix cache empty."""
        conn = self.e.scheduler.connector
        end = time.monotonic() + 60
        while conn.has_pending_push_work() or conn.connector_scheduler._jobs:
            assert time.monotonic() < end, "transfers never ended"
            self.e.step()
        self.e.tokens.clear()
        assert self.e.scheduler.reset_prefix_cache()

    def request(self, prompt: list[int]) -> str:
        self.n += 1
        rid = f"r{self.n}"
        self.e.add(rid, prompt)
        return rid

    def timed_hit(self, prompt: list[int]) -> float:
        """Seconds from a request's first step to its end; its whole-block prefix must have
        come from a cache (the request is added before the clock starts: vLLM's intake is not
        ours)."""
        rid = self.request(prompt)
        t0 = time.perf_counter()
        self.step_until_done(rid)
        took = time.perf_counter() - t0
        got = self.e.loaded_tokens[rid]
        assert got == BLOCKS * self.bs, (got, self.worker.stats, self.e.manager_stats())
        return took

    def blocks_of(self, rid: str) -> list[int]:
        return list(self.e._blocks[rid])


def run_geometry(name: str, target: str, model: str, reps: int) -> dict[str, Any]:
    import numpy as np
    import torch
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from hicache_vllm.vllm_api import current

    b = Bench(name, target, model)
    e, manager, worker = b.e, b.manager, b.worker
    prompt = _prompt(BLOCKS * b.bs + 1, 41)
    keys = e.offload_keys(prompt)
    # the prefix stored once, from random KV; what a load brings back is checked against it
    for t in e.kv.values():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                dtype=torch.uint8))
    rid = b.request(prompt)
    b.step_until_done(rid)
    stored = b.blocks_of(rid)[:BLOCKS]
    want = [t.view(torch.uint8)[stored].clone() for t in e.kv.values()]  # bytes: NaNs too
    b.drain()
    assert worker.stats["store_pages"] >= BLOCKS, worker.stats
    page_bytes = worker.pool.page_bytes
    nbytes = page_bytes * BLOCKS

    for t in e.kv.values():  # exactness once: KV zeroed, then what the connector loads
        t.zero_()
    rid = b.request(prompt)
    b.step_until_done(rid)
    got = b.blocks_of(rid)[:BLOCKS]
    assert e.loaded_tokens[rid] == BLOCKS * b.bs, e.loaded_tokens[rid]
    assert all(torch.equal(t.view(torch.uint8)[got], w)
               for t, w in zip(e.kv.values(), want, strict=True))
    b.drain()
    dst = np.asarray(got, dtype=np.int64)

    session, client = worker.link.session, worker.link.client
    jobs = iter(range(1 << 30, 1 << 31))

    def mine(job: int) -> None:
        """The job's result taken here (vLLM's connector knows nothing of it; none of its
        own jobs is in flight now)."""
        done = worker.get_finished()
        assert [r.job_id for r in done] == [job] and done[0].success, done

    def via_connector() -> None:
        times["connector"].append(b.timed_hit(prompt))
        # the floor: the same request again, its blocks now in vLLM's own prefix cache (the
        # steps vLLM takes for a hit that needs no connector)
        times["vllm_cached"].append(b.timed_hit(prompt))

    def via_spec() -> None:
        b.n += 1
        ctx = ReqContext(f"s{b.n}")
        for i, k in enumerate(keys):  # as vLLM's connector records them before its lookups
            ctx.set_offload_key_position(k, (i + 1) * b.bs)
        while True:
            answers = [manager.lookup(k, ctx) for k in keys]
            if any(a.name == "RETRY" for a in answers):
                manager.on_schedule_end(None)
                continue
            break
        assert all(a.name == "HIT" for a in answers), answers
        spec = manager.prepare_load(keys, ctx)
        job = next(jobs)
        worker.submit_load(job, spec, current().device_side(GPULoadStoreSpec(
            dst.tolist(), group_sizes=[BLOCKS], block_indices=[0]), worker.kv_caches))
        worker.wait({job})
        mine(job)
        manager.complete_load(keys, ctx)
        manager.on_request_finished(ctx)

    ids = torch.from_numpy(dst)
    base = worker._slots * worker.plan.blocks_per_chunk

    def via_raw() -> None:
        r = client.lookup(session.pool, keys, session_id=session.session_id, hold_ms=30000)
        assert r.held == BLOCKS
        session.load_keys(keys, worker._tokens(worker._slots, BLOCKS))
        for canon, stage in zip(worker.layers, worker._stage, strict=True):
            canon.index_copy_(0, ids, stage[base:base + BLOCKS])

    vllm_manager = CPUOffloadingManager(num_chunks=4 * BLOCKS)
    vctx = ReqContext("v")
    out = vllm_manager.prepare_store(keys, vctx)
    assert out is not None
    vllm_manager.complete_store(keys, vctx)

    def via_vllm_manager() -> None:
        ctx = ReqContext("v")
        assert all(vllm_manager.lookup(k, ctx).name == "HIT" for k in keys)
        vllm_manager.prepare_load(keys, ctx)
        vllm_manager.complete_load(keys, ctx)

    times: dict[str, list[float]] = {"connector": [], "vllm_cached": [], "spec": [], "raw": [],
                                     "vllm_manager": []}
    fns = {"connector": via_connector, "spec": via_spec, "raw": via_raw,
           "vllm_manager": via_vllm_manager}
    for _ in range(reps):
        for op, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if op == "connector":  # timed inside
                b.drain()
            else:
                times[op].append(time.perf_counter() - t0)
    load = {op: statistics.median(v) * 1e3 for op, v in times.items()}

    # stores: 64 new blocks each time (new keys: every page is copied)
    st: dict[str, list[float]] = {"spec": [], "raw": []}
    for i in range(reps):
        new = [os.urandom(32) for _ in range(BLOCKS)]
        ctx = ReqContext(f"w{i}")
        t0 = time.perf_counter()
        out = manager.prepare_store(new, ctx)
        assert out is not None
        job = next(jobs)
        worker.submit_store(job, current().device_side(GPULoadStoreSpec(
            dst.tolist(), group_sizes=[BLOCKS], block_indices=[0]), worker.kv_caches),
            out.store_spec)
        worker.wait({job})
        mine(job)
        manager.complete_store(new, ctx)
        st["spec"].append(time.perf_counter() - t0)
        assert client.remove_keys(session.pool, new) == BLOCKS  # the prefix is never evicted
        new = [os.urandom(32) for _ in range(BLOCKS)]
        t0 = time.perf_counter()
        for canon, stage in zip(worker.layers, worker._stage, strict=True):
            torch.index_select(canon, 0, ids, out=stage[:BLOCKS])
        res = session.store(new, worker._tokens(0, BLOCKS))
        st["raw"].append(time.perf_counter() - t0)
        assert res.stored == BLOCKS, res
        assert client.remove_keys(session.pool, new) == BLOCKS
    store = {op: nbytes / statistics.median(v) / 1e9 for op, v in st.items()}
    e.close()

    # vLLM's synchronous loads (its sync_load_budget_bytes): the hit loaded within the step
    # that computes the request's last token, no step spent waiting for it
    b = Bench(name, target, model, sync_load_budget_bytes=1 << 40)
    sync = []
    for _ in range(reps):
        sync.append(b.timed_hit(prompt))
        b.drain()
    load["connector_sync"] = statistics.median(sync) * 1e3
    b.e.close()
    return {"geometry": name, "blocks": BLOCKS, "page_bytes": page_bytes,
            "load_ms": load, "load_connector_over_raw": load["connector"] / load["raw"],
            "load_connector_sync_over_raw": load["connector_sync"] / load["raw"],
            "load_connector_less_vllm_over_raw":
                (load["connector"] - load["vllm_cached"]) / load["raw"],
            "load_spec_over_raw": load["spec"] / load["raw"],
            "store_gbps": store, "store_spec_over_raw": store["spec"] / store["raw"],
            "reps": reps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 repetitions, small geometry only")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default="")
    ap.add_argument("--vllm", default="",
                    help="the vLLM release (default: the newest hicache.engines tests)")
    args = ap.parse_args()
    if not os.environ.get("HICACHED_BENCH_VLLM"):
        from hicache import engines

        _reexec(args.vllm or engines.lines("vllm")[-1].tested)
    sys.path.insert(0, str(REPO))
    from hicache_bench.daemon import start_daemon
    from tests.vllm_harness import model_dir

    work = tempfile.mkdtemp(prefix="hicache-bench-vllm-")
    shm = tempfile.mkdtemp(prefix="hicache-bench-vllm-", dir="/dev/shm")
    proc, target = start_daemon(work, shm, "4GiB")
    try:
        model = str(model_dir(Path(work)))
        names = ["small"] if args.quick else list(GEOMETRIES)
        reps = 5 if args.quick else args.reps
        results = [run_geometry(n, target, model, reps) for n in names]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    from importlib import metadata

    print(f"vLLM {metadata.version('vllm')} offloading through hicached, {BLOCKS}-block "
          "prefix, medians")
    for r in results:
        ms = r["load_ms"]
        print(f"[{r['geometry']}] page {r['page_bytes'] / 1024:.0f} KiB: load connector "
              f"{ms['connector']:.2f} ms, spec {ms['spec']:.2f} ms, raw {ms['raw']:.2f} ms "
              f"(connector/raw {r['load_connector_over_raw']:.2f}x, spec/raw "
              f"{r['load_spec_over_raw']:.2f}x); with vLLM's sync loads: connector "
              f"{ms['connector_sync']:.2f} ms ({r['load_connector_sync_over_raw']:.2f}x); "
              f"vLLM's own prefix-cache hit {ms['vllm_cached']:.2f} ms (connector less it / "
              f"raw {r['load_connector_less_vllm_over_raw']:.2f}x); vLLM CPUOffloadingManager "
              f"bookkeeping {ms['vllm_manager']:.3f} ms")
        gb = r["store_gbps"]
        print(f"[{r['geometry']}] store spec {gb['spec']:.2f} GB/s, raw {gb['raw']:.2f} GB/s "
              f"(spec/raw {r['store_spec_over_raw']:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
