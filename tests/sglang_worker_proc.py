"""An SGLang worker process (SGLang's real cache classes, CPU) using the hicached linker.

    python -m tests.sglang_worker_proc --target unix:... --shm-dir DIR --mode MODE
        [--kind mha|mla] [--start N] [--tokens N] [--rank R --world W --init FILE]

Modes: ``store`` prefills a prompt and waits for its offloads; ``load`` (a fresh cache) looks
the prompt up, loads it into zeroed device slots and checks the bytes; ``roundtrip`` does both
with an eviction in between. With ``--world`` > 1 the ranks form a gloo process group that
SGLang's cache reduces over (TP ranks). Prints one JSON line: the hit, the aborted requests,
whether the bytes were exact, the linker's counters and pool name.
"""

from __future__ import annotations

import argparse
import json
import sys
from array import array

import torch

from tests.sglang_harness import LAYERS, SGLangCache, tokens_of


def _load(cache: SGLangCache, tokens: array[int], out: dict[str, object]) -> None:
    cache.zero_kv()
    hit, failed, slots = cache.hit_and_load(tokens)
    out["hit"] = hit
    out["failed"] = [r.rid for r in failed]
    out["exact"] = slots is not None and all(
        torch.equal(cache.layer_rows(role, layer, slots), cache.expected(tokens, role, layer))
        for role in cache.roles for layer in range(LAYERS))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--shm-dir", required=True)
    ap.add_argument("--mode", choices=("store", "load", "roundtrip"), required=True)
    ap.add_argument("--kind", default="mha")
    ap.add_argument("--start", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--init", default="")
    args = ap.parse_args()

    group = None
    if args.world > 1:
        torch.distributed.init_process_group("gloo", init_method=f"file://{args.init}",
                                             rank=args.rank, world_size=args.world)
        group = torch.distributed.group.WORLD
    cache = SGLangCache(args.target, args.shm_dir, kind=args.kind, tp_group=group)
    tokens = tokens_of(args.start, args.tokens)
    out: dict[str, object] = {"rank": args.rank, "pool": cache.linker.spec.name}
    if args.mode in ("store", "roundtrip"):
        cache.prefill(tokens)
        cache.poll_offloads()
    if args.mode == "roundtrip":
        if group is not None:
            torch.distributed.barrier()
        out["evicted"] = cache.evict_all()
    if args.mode in ("load", "roundtrip"):
        _load(cache, tokens, out)
    out["stats"] = dict(cache.linker.stats)
    cache.close()
    if group is not None:
        torch.distributed.destroy_process_group()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
