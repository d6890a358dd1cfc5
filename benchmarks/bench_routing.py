"""Routing benchmark: two nodes, one request stream, sent where a real router says its prefix is
vs round robin; the prefix hit rate and the tokens computed side by side.

Each node is a real ``hicached serve`` (a pool of ``--pool-pages`` pages, its own KV event
stream per pool) with one engine instance: this process, as a worker, doing per request what an
engine does (a ``Lookup`` of the prompt's pages on its node: the hit is the leading run found;
a ``Store`` of every page after it, with the pages' tokens and the key before them, as the
SGLang linker and the vLLM spec now send). The router is Dynamo's standalone KV indexer
(``python -m dynamo.indexer``, ai-dynamo-runtime; in a private network namespace, since it
binds every address) following both daemons' pool streams, one instance each. Policies, each
on fresh daemons and a fresh router, the same requests in the same order:

- ``router``: the instance the indexer scores highest (its longest matched prefix); ties (a
  new conversation) go to the instance with fewer requests so far, then alternate.
- ``round_robin``: alternate.
- ``oracle``: each daemon asked directly (a ``Lookup`` of both): the best any router could do
  with an exact view, for how much of it the router's view gets.

The workload (default): ``--conversations`` multi-turn conversations, each opening with one of
``--system-prompts`` shared system prompts (``--system-pages`` pages each), then turns of a
question (2-4 pages) and an answer (1-2 pages): turn t's prompt is the system prompt and every
earlier question and answer, then its own question; its answer is stored after it, as an engine
stores what it computed. ``--active`` conversations are open at a time, the next request drawn
from one of them at random. ``--trace FILE`` replays a trace instead (one JSON per line with
``hash_ids``, chained block ids: each id stands for one page of tokens).

Printed per policy: requests, prompt pages, hit pages and the hit rate, tokens computed (pages
missed x page size), requests per node, and for ``router`` how often its score differed from
the node's actual hit: below (stores it had not heard of yet), above (evictions it had not
heard of yet). Requests come back to back unless ``--gap-ms`` spaces their arrivals: the
router's view then has that long to catch up, as between the turns of a real conversation.

Run: ``python benchmarks/bench_routing.py [--quick] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicache_bench.daemon import start_daemon
from hicache_client import HiCacheClient, ShmDeviceBuffers
from tests.dynamo_indexer import DynamoIndexer, unavailable
from tests.mooncake_env import Netns

PS = 16
GEOMETRY = KVGeometry(PoolKind.MHA, DType.BFLOAT16, layer_num=2, head_num=1, head_dim=32)
MAX_PAGES = 256
"""The longest prompt, in pages, a request may have (the worker's device buffer)."""


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    """Page ids, in order: page i's tokens are ``tokens_of(prompt[i])``; a prefix of ids is a
    prefix of tokens."""
    answer: list[int] = field(default_factory=list)
    """Pages stored after the prompt (what the engine computed and keeps)."""


def tokens_of(pages: list[int]) -> np.ndarray:
    ids = np.asarray(pages, dtype=np.int64)
    return (ids[:, None] * PS + np.arange(PS, dtype=np.int64)[None, :]).ravel()


def key_of(page_id: int) -> bytes:
    """A page's key, a digest as an engine's are (a router tells blocks apart by the first
    8 bytes: docs/api.md, "KV events for routers")."""
    return hashlib.blake2b(page_id.to_bytes(8, "big"), digest_size=32).digest()


def conversations(args: argparse.Namespace) -> list[Request]:
    rng = random.Random(args.seed)
    next_id = iter(range(1, 1 << 40))
    systems = [[next(next_id) for _ in range(args.system_pages)]
               for _ in range(args.system_prompts)]

    def turns(c: int) -> Iterator[Request]:
        history = list(systems[c % len(systems)])
        for _ in range(rng.randint(args.turns // 2, args.turns)):
            question = [next(next_id) for _ in range(rng.randint(2, 4))]
            answer = [next(next_id) for _ in range(rng.randint(1, 2))]
            if len(history) + len(question) + len(answer) > MAX_PAGES:
                return
            yield Request(history + question, answer)
            history += question + answer

    waiting = [turns(c) for c in range(args.conversations)]
    rng.shuffle(waiting)
    active: list[Iterator[Request]] = []
    out: list[Request] = []
    while waiting or active:
        while waiting and len(active) < args.active:
            active.append(waiting.pop())
        conv = rng.choice(active)
        r = next(conv, None)
        if r is None:
            active.remove(conv)
        else:
            out.append(r)
    return out


def trace(path: str, limit: int) -> list[Request]:
    out = []
    with open(path) as f:
        for line in f:
            ids = json.loads(line)["hash_ids"][:MAX_PAGES]
            out.append(Request([i + 1 for i in ids]))
            if len(out) == limit:
                break
    return out


class Node:
    """One daemon with one engine instance on it (this process, as its worker)."""

    def __init__(self, work: Path, name: str, pool_pages: int) -> None:
        self.work = work / name
        self.work.mkdir()
        (self.work / "ev").mkdir(mode=0o700)
        self.proc, target = start_daemon(
            str(self.work), "/dev/shm", "1GiB", "",
            "--kv-events-pool-endpoint", f"ipc://{self.work}/ev/{{pool}}",
            "--kv-events-pool-replay-endpoint", f"ipc://{self.work}/ev/{{pool}}.replay")
        self.spec = PoolSpec("route", GEOMETRY, PS, size_tokens=PS * pool_pages)
        self.client = HiCacheClient(target)
        self.client.create_pool(self.spec)
        self.bufs = ShmDeviceBuffers.create(self.spec, MAX_PAGES * PS,
                                            prefix=f"hicache-route-{name}")
        self.session = self.client.open_session(self.spec.name, name, self.bufs.descriptors)
        pool = self.client.get_pool(self.spec.name)
        self.endpoint, self.replay = pool.kv_events_endpoint, pool.kv_events_replay_endpoint
        self.requests = 0

    def hit(self, r: Request) -> int:
        """The leading pages of ``r``'s prompt this node holds."""
        return int(self.session.lookup([key_of(p) for p in r.prompt]).hit_prefix)

    def serve(self, r: Request) -> int:
        """What the engine does with ``r``: look it up, store every page after the hit (the
        answer's too), with their tokens and the key before. Returns the hit pages."""
        self.requests += 1
        hit = self.hit(r)
        pages = (r.prompt + r.answer)[hit:]
        if pages:
            self.session.store([key_of(p) for p in pages], torch.arange(len(pages) * PS),
                               token_ids=tokens_of(pages),
                               parent_key=key_of(r.prompt[hit - 1]) if hit else b"")
        return hit

    def close(self) -> None:
        self.session.close()
        self.bufs.close()
        self.client.close()
        self.proc.terminate()
        self.proc.wait(30)


def play(policy: str, requests: list[Request], args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"hicache-bench-route-{policy}-"))
    nodes: list[Node] = []
    netns = router = queries = None
    try:
        nodes = [Node(work, f"n{i}", args.pool_pages) for i in range(2)]
        choose: Callable[[Request], tuple[int, int | None]]
        turn = [0]

        def pick(scores: list[int]) -> int:
            best = max(scores)
            tied = [i for i, s in enumerate(scores) if s == best]
            if len(tied) > 1:
                fewest = min(nodes[i].requests for i in tied)
                tied = [i for i in tied if nodes[i].requests == fewest]
            turn[0] += 1
            return tied[turn[0] % len(tied)]

        if policy == "router":
            netns = Netns()
            router = DynamoIndexer(netns, work, block_size=PS)
            router.start()
            for i, n in enumerate(nodes):
                router.register(i + 1, n.endpoint, n.replay)
            queries = asked = router.queries()

            def choose(r: Request) -> tuple[int, int | None]:
                got = asked.ask(tokens_of(r.prompt))
                scores = [got[i + 1] // PS for i in range(len(nodes))]
                i = pick(scores)
                return i, scores[i]
        elif policy == "oracle":
            def choose(r: Request) -> tuple[int, int | None]:
                return pick([n.hit(r) for n in nodes]), None
        else:
            def choose(r: Request) -> tuple[int, int | None]:
                return pick([0] * len(nodes)), None

        prompt_pages = hit_pages = below = above = 0
        t0 = time.monotonic()
        for r in requests:
            i, believed = choose(r)
            actual = nodes[i].serve(r)
            below += believed is not None and believed < actual
            above += believed is not None and believed > actual
            prompt_pages += len(r.prompt)
            hit_pages += actual
            if args.gap_ms:  # the time between two requests' arrivals
                time.sleep(args.gap_ms / 1000)
        elapsed = time.monotonic() - t0
        out = {"requests": len(requests), "prompt_pages": prompt_pages,
               "hit_pages": hit_pages, "hit_rate": hit_pages / max(prompt_pages, 1),
               "computed_tokens": (prompt_pages - hit_pages) * PS,
               "requests_per_node": [n.requests for n in nodes], "seconds": elapsed}
        if policy == "router":
            out["router_below_hit"] = below  # it had not heard of stores yet
            out["router_above_hit"] = above  # it had not heard of evictions yet
        return out
    finally:
        if queries is not None:
            queries.close()
        if router is not None:
            router.kill()
        if netns is not None:
            netns.close()
        for n in nodes:
            n.close()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--trace", help="a JSONL trace with hash_ids (chained block ids)")
    ap.add_argument("--limit", type=int, default=1000, help="requests taken from --trace")
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--active", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--system-pages", type=int, default=16)
    ap.add_argument("--pool-pages", type=int, default=1024, help="each node's pool")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="time between two requests' arrivals (0: back to back, the router's "
                         "view as late as it gets)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if why := unavailable():
        sys.exit(f"bench_routing needs Dynamo's indexer: {why}")
    if args.quick:
        args.conversations, args.active, args.limit = 16, 8, 200
    requests = trace(args.trace, args.limit) if args.trace else conversations(args)
    results = {p: play(p, requests, args) for p in ("router", "round_robin", "oracle")}
    print(f"{len(requests)} requests, {sum(len(r.prompt) for r in requests)} prompt pages of "
          f"{PS} tokens, two nodes of {args.pool_pages} pages each")
    print(f"{'policy':<12} {'hit rate':>9} {'hit pages':>10} {'computed tokens':>16} "
          f"{'per node':>12} {'seconds':>8}")
    for p, r in results.items():
        print(f"{p:<12} {r['hit_rate']:>9.3f} {r['hit_pages']:>10} {r['computed_tokens']:>16} "
              f"{'/'.join(map(str, r['requests_per_node'])):>12} {r['seconds']:>8.1f}")
    rr, ro = results["round_robin"], results["router"]
    print(f"router vs round robin: hit rate x{ro['hit_rate'] / max(rr['hit_rate'], 1e-9):.2f}, "
          f"computed tokens x{ro['computed_tokens'] / max(rr['computed_tokens'], 1):.2f}; "
          f"the router's score was below the node's hit on {ro['router_below_hit']} and above "
          f"it on {ro['router_above_hit']} of {ro['requests']} requests")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
