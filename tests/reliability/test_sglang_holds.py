"""A hit is a promise, under stress, through SGLang 0.5.23's own cache classes: batches of two
requests load their hits from a small pool while two other workers' processes store into it
as fast as they can (every store evicts). With holds (the linker's default) not one of 1,000
requests is aborted, and every load is exact (rows zeroed first); without them (holds off)
the aborts are counted, as SGLang saw them before holds.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon_proc import REPO, start_daemon
from tests.helpers import require_module
from tests.reliability.figures import record

require_module("sglang", "sglang==0.5.23 (scripts/setup.sh --test)")

import torch  # noqa: E402

from tests.sglang_harness import LAYERS, SGLangCache, tokens_of  # noqa: E402

REQUESTS = 1000
SEQUENCES = 12
PAGES_PER_REQUEST = 3
POOL_PAGES = 24


@pytest.mark.parametrize("holds", [True, False], ids=["holds", "no_holds"])
def test_batches_under_eviction_pressure(tmp_path: Path, holds: bool) -> None:
    d = start_daemon(tmp_path, "--no-shm-paths", "--max-held-fraction", "0.5",
                     "--lease-seconds", "30")
    cache = SGLangCache(d.target, d.shm_dir, size=512, extra={
        "pool_size_tokens": 4 * POOL_PAGES, "lookup_hold_ms": 5000 if holds else 0})
    stop = tmp_path / "stop"
    storers: list[subprocess.Popen[str]] = []
    aborted = exact = hit_tokens = 0
    try:
        seqs = [tokens_of(10_000 * (i + 1), 4 * PAGES_PER_REQUEST) for i in range(SEQUENCES)]
        storers = [subprocess.Popen(
            [sys.executable, "-m", "tests.reliability.storer_worker", d.target,
             cache.linker.spec.name, str(i), str(stop)], cwd=REPO, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True) for i in range(2)]
        for n in range(REQUESTS // 2):
            a, b = seqs[(2 * n) % SEQUENCES], seqs[(2 * n + 1) % SEQUENCES]
            for tokens in (a, b):  # stored again (what is still there is skipped)
                cache.prefill(tokens)
            cache.poll_offloads()
            cache.evict_all()  # only the daemon can hit now
            cache.zero_kv()
            hits, failed, slots = cache.hit_and_load_batch([(f"a{n}", a), (f"b{n}", b)])
            aborted += len(failed)
            hit_tokens += sum(hits)
            for (rid, tokens), hit in zip(((f"a{n}", a), (f"b{n}", b)), hits, strict=True):
                if rid in failed or not hit:
                    continue
                got = slots[rid]
                ok = all(torch.equal(cache.layer_rows(role, layer, got),
                                     cache.expected(tokens[:hit], role, layer))
                         for role in cache.roles for layer in range(LAYERS))
                assert ok, f"{rid}: a load that SGLang accepted is not exact"
                exact += 1
            for got in slots.values():  # the harness never inserts: give the slots back
                cache.allocator.free(got)
    finally:
        stop.touch()
        results = [json.loads(p.communicate(timeout=60)[0].strip().splitlines()[-1])
                   for p in storers]
        cache.close()
        d.stop(signal.SIGKILL)
    stores = sum(r["stored"] for r in results)
    record(f"sglang_holds_{'on' if holds else 'off'}", requests=REQUESTS, aborted=aborted,
           exact_loads=exact, hit_tokens=hit_tokens, other_workers_stored=stores)
    assert stores > 1000, "the other workers did not keep the pool under pressure"
    if holds:
        assert aborted == 0, f"{aborted} of {REQUESTS} requests were aborted with holds on"
        # hits are what the storers' pressure leaves: 18-200 exact loads of 1,000 requests
        # measured (18 and 49 on a clean clone running the whole suite); what this test
        # checks is the abort count above, these only show that loads happened
        assert exact > 10, "too few hits to tell anything"
