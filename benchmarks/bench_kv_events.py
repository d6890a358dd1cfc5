"""KV events benchmark: what publishing the stream costs the data path, and what it sustains.

Two real daemon processes side by side, identical but for ``--kv-events-endpoint``: "off"
(no stream: the daemon as it was) and "on" (the stream on an ``ipc://`` socket, one
subscriber receiving as fast as it can, decoding nothing: on a 2-CPU machine a router's own
work would be taken from the daemons' CPUs, and from "on"'s blocks more than "off"'s). This
process is the worker of both (one session each, shm buffers, the fast path); every Store
names fresh keys in a full pool, so each one also evicts (two events per Store: a STORED and
an EVICTED). Alternating blocks of ``BLOCK``
calls, medians:

1. 1-page Store latency, off vs on (target: on within 5 % of off).
2. 64-page Store throughput in pages/s, off vs on (target: within 5 %).
3. A slow subscriber (sleeps 1 ms per message, a receive high-water mark of 1000) on "on"
   while this process stores 1-page batches for ``--seconds``: the Store latency beside "off"
   measured in the same alternation, the events published per second, the events the daemon
   dropped (its queue full: ``hicache_kv_events_dropped_total``) and the messages the
   subscriber missed (ZeroMQ dropped them at the high-water mark, ``hwm`` = ``HWM`` here: the
   gaps it saw, which a router replays). Then the same with 64-page Stores (64 blocks stored
   and 64 evicted per Store) and a subscriber sleeping 50 ms per message: the blocks per
   second the stream carries while nothing waits for the subscriber.

With ``--pool-streams`` the "on" daemon also publishes the pool's own stream
(``[kv_events] pool_endpoint``, a second fast subscriber on it) and both sides' Stores carry
their pages' tokens and the key before them, as the engines' stores do for routers: the cost
of what a router following instances gets. It also measures what the tokens alone cost, on
"on" alone (both streams followed): alternating blocks of 1-page Stores with tokens and
parent and without, on one daemon, one session, one full pool (two daemons differ by more
than that on this VM): the medians, and the median of the blocks' ratios (target: under
5 % of a 1-page Store). With ``--lookahead L`` too, the same for vLLM's lookahead block
hashes: 1-page Stores with tokens and parent, with and without ``L`` lookahead tokens per page
(what a vLLM 0.34 engine with EAGLE, L = 1, or an MTP chain stores).

Run: ``python benchmarks/bench_kv_events.py [--quick] [--pool-streams [--lookahead L]]
[--seconds S] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import torch

from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicache_bench.daemon import start_daemon
from hicache_client import HiCacheClient, ShmDeviceBuffers

GEOMETRY = KVGeometry(PoolKind.MHA, DType.BFLOAT16, layer_num=4, head_num=2, head_dim=64)
PS = 16
POOL_PAGES = 1024
SPEC = PoolSpec("kvbench", GEOMETRY, PS, size_tokens=PS * POOL_PAGES)
BLOCK = 50

SUBSCRIBER = """
import sys, time, msgspec, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.SUB); s.setsockopt(zmq.RCVHWM, 16)
s.setsockopt(zmq.SUBSCRIBE, b""); s.connect(sys.argv[1]); delay = float(sys.argv[2])
n = gaps = blocks = 0; last = -1; stop = time.monotonic() + float(sys.argv[3])
decode = msgspec.msgpack.decode
while time.monotonic() < stop:
    if not s.poll(100): continue
    _, seq, payload = s.recv_multipart(); seq = int.from_bytes(seq, "big")
    gaps += last >= 0 and seq > last + 1; last = seq; n += 1
    if delay:  # the fast one only receives: its CPU is not taken from the daemons
        blocks += sum(len(e.get("block_hashes", ())) for e in decode(payload)[1])
    if delay: time.sleep(delay)
print(n, gaps, blocks, flush=True)
"""
HWM = 64
"""The "on" daemon's high-water mark: a subscriber 64 messages behind misses the next."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        m = re.search(rf"^{name} (\S+)$", r.read().decode(), re.M)
    return float(m.group(1)) if m else 0.0


class Side:
    def __init__(self, target: str, name: str, tokens: bool = False) -> None:
        self.client = HiCacheClient(target)
        self.client.create_pool(SPEC)
        self.bufs = ShmDeviceBuffers.create(SPEC, 64 * PS, prefix=f"kvbench-{name}")
        for t in self.bufs.all_tensors():
            t.view(torch.uint8).random_()
        self.session = self.client.open_session(SPEC.name, name, self.bufs.descriptors)
        assert self.client.data_path == "fast"
        self.n = 0
        self.tokens = tokens
        self.lookahead = 0
        """Lookahead tokens per page the Stores give (with their tokens)."""
        self.last = b""

    def store(self, pages: int) -> float:
        keys = [b"%s-%09d" % (self.session.session_id.encode()[-8:], self.n + i)
                for i in range(pages)]
        self.n += pages
        chain: dict[str, Any] = (
            {"token_ids": torch.arange(self.n * PS, (self.n + pages) * PS).numpy(),
             "parent_key": self.last} if self.tokens else {})
        if self.tokens and self.lookahead:  # the tokens after each page
            chain["lookahead_token_ids"] = (torch.arange(pages)[:, None] * PS
                                            + torch.arange(self.lookahead)
                                            + (self.n + 1) * PS).numpy()
        t0 = time.perf_counter()
        self.session.store(keys, torch.arange(pages * PS), **chain)  # type: ignore[arg-type]
        took = time.perf_counter() - t0
        self.last = keys[-1]
        return took

    def close(self) -> None:
        self.session.close()
        self.bufs.close()
        self.client.close()


def alternate(sides: dict[str, Side], pages: int, reps: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(reps):
        for name, side in sides.items():
            out[name] += [side.store(pages) for _ in range(BLOCK)]
    return out


def token_cost(side: Side, reps: int) -> dict[str, float]:
    """1-page Stores on one side with and without tokens and parent, in alternating blocks
    (which goes first alternates too): medians in us, and the median ratio of blocks."""
    blocks: dict[bool, list[float]] = {False: [], True: []}
    for r in range(reps):
        for tokens in ((False, True) if r % 2 else (True, False)):
            side.tokens = tokens
            blocks[tokens].append(statistics.median(side.store(1) for _ in range(BLOCK)))
    side.tokens = True
    return {"without_us": 1e6 * statistics.median(blocks[False]),
            "with_us": 1e6 * statistics.median(blocks[True]),
            "ratio": statistics.median(b / a for a, b in zip(blocks[False], blocks[True],
                                                             strict=True))}


def lookahead_cost(side: Side, reps: int, lookahead: int) -> dict[str, float]:
    """1-page Stores with tokens and parent, with and without ``lookahead`` lookahead tokens,
    in alternating blocks as ``token_cost``."""
    blocks: dict[bool, list[float]] = {False: [], True: []}
    for r in range(reps):
        for ahead in ((False, True) if r % 2 else (True, False)):
            side.lookahead = lookahead if ahead else 0
            blocks[ahead].append(statistics.median(side.store(1) for _ in range(BLOCK)))
    side.lookahead = 0
    return {"without_us": 1e6 * statistics.median(blocks[False]),
            "with_us": 1e6 * statistics.median(blocks[True]), "lookahead": lookahead,
            "ratio": statistics.median(b / a for a, b in zip(blocks[False], blocks[True],
                                                             strict=True))}


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = {k: tempfile.mkdtemp(prefix=f"hicache-bench-kv-{k}-") for k in ("off", "on")}
    port = free_port()
    endpoint = f"ipc://{work['on']}/kv.sock"
    with open(os.path.join(work["on"], "kv.toml"), "w") as toml:
        toml.write(f"[kv_events]\nhwm = {HWM}\n")
    streams: list[str] = []
    if args.pool_streams:
        os.mkdir(os.path.join(work["on"], "ev"), 0o700)
        streams = ["--kv-events-pool-endpoint", f"ipc://{work['on']}/ev/{{pool}}"]
    procs = {"off": start_daemon(work["off"], "/dev/shm", "1GiB"),
             "on": start_daemon(work["on"], "/dev/shm", "1GiB", f"127.0.0.1:{port}",
                                "--kv-events-endpoint", endpoint, "--config",
                                os.path.join(work["on"], "kv.toml"), *streams)}
    sub: subprocess.Popen[bytes] | None = None
    pool_sub: subprocess.Popen[bytes] | None = None
    try:
        sides = {k: Side(target, k, tokens=args.pool_streams)
                 for k, (_, target) in procs.items()}
        reps = 6 if args.quick else 40
        res: dict[str, Any] = {"pool_streams": bool(args.pool_streams)}
        fast = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, endpoint, "0", "3600"],
                                stdout=subprocess.PIPE)
        if args.pool_streams:
            pool_sub = subprocess.Popen([sys.executable, "-c", SUBSCRIBER,
                                         f"ipc://{work['on']}/ev/{SPEC.name}", "0", "3600"],
                                        stdout=subprocess.PIPE)
        time.sleep(0.5)
        for side in sides.values():  # fill both pools: every later Store evicts
            for _ in range(POOL_PAGES // 64 + 1):
                side.store(64)
        one = alternate(sides, 1, reps)
        res["store_1_page_us"] = {k: 1e6 * statistics.median(v) for k, v in one.items()}
        if args.pool_streams:
            res["tokens_1_page"] = token_cost(sides["on"], 2 * reps)
            if args.lookahead:
                res["lookahead_1_page"] = lookahead_cost(sides["on"], 2 * reps,
                                                         args.lookahead)
        many = alternate(sides, 64, max(reps // 2, 2))
        res["store_64_pages_per_s"] = {k: 64 / statistics.median(v) for k, v in many.items()}
        fast.terminate()
        fast.wait(10)
        if pool_sub is not None:
            pool_sub.terminate()
            pool_sub.wait(10)
        seconds = 3.0 if args.quick else args.seconds
        for pages, delay in ((1, 0.001), (64, 0.05)):
            sub = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, endpoint, str(delay),
                                    str(seconds + 2)], stdout=subprocess.PIPE)
            time.sleep(0.5)
            published0 = scrape(port, "hicache_kv_events_published_total")
            dropped0 = scrape(port, "hicache_kv_events_dropped_total")
            t0 = time.monotonic()
            slow: dict[str, list[float]] = {k: [] for k in sides}
            while time.monotonic() - t0 < seconds:
                for name, side in sides.items():
                    slow[name] += [side.store(pages) for _ in range(BLOCK)]
            elapsed = time.monotonic() - t0
            time.sleep(0.5)
            published = scrape(port, "hicache_kv_events_published_total") - published0
            received, gaps, blocks = (int(x) for x in
                                      sub.communicate(timeout=seconds + 30)[0].split())
            res[f"slow_subscriber_{pages}"] = {
                "store_us": {k: 1e6 * statistics.median(v) for k, v in slow.items()},
                "stores_per_s_on": len(slow["on"]) / elapsed * 2,
                "events_per_s": published / elapsed, "delay_s": delay,
                "dropped_in_daemon": scrape(port, "hicache_kv_events_dropped_total")
                - dropped0, "messages_received": received, "gaps_seen": gaps,
                "blocks_received": blocks}
        for side in sides.values():
            side.close()
        return res
    finally:
        for s in (sub, pool_sub):
            if s is not None and s.poll() is None:
                s.kill()
        for proc, _ in procs.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        for d in work.values():
            shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--pool-streams", action="store_true",
                   help="the pool's own stream too, and Stores with tokens and parent")
    p.add_argument("--lookahead", type=int, default=0,
                   help="with --pool-streams: what L lookahead tokens per page cost a Store")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    r = run(args)
    s1, s64 = r["store_1_page_us"], r["store_64_pages_per_s"]
    print(f"Store over the fast path, full pool (each Store evicts), medians of alternating "
          f"blocks of {BLOCK}" + (" (on: the node's stream and the pool's own; Stores with "
                                  "tokens and parent on both sides)" if r["pool_streams"]
                                  else "") + ":")
    print(f"  1 page:   off {s1['off']:7.1f} us  on {s1['on']:7.1f} us  "
          f"(on/off x{s1['on'] / s1['off']:.3f})")
    print(f"  64 pages: off {s64['off']:9.0f} pages/s  on {s64['on']:9.0f} pages/s  "
          f"(on/off x{s64['on'] / s64['off']:.3f})")
    if "tokens_1_page" in r:
        t = r["tokens_1_page"]
        print(f"What the tokens and parent cost a 1-page Store ('on' alone, both streams "
              f"followed): without {t['without_us']:.1f} us  with {t['with_us']:.1f} us  "
              f"(median block ratio x{t['ratio']:.3f}; target under x1.05)")
    if "lookahead_1_page" in r:
        t = r["lookahead_1_page"]
        print(f"What {t['lookahead']} lookahead token(s) per page cost a 1-page Store with "
              f"tokens and parent: without {t['without_us']:.1f} us  with "
              f"{t['with_us']:.1f} us  (median block ratio x{t['ratio']:.3f})")
    for pages in (1, 64):
        slow = r[f"slow_subscriber_{pages}"]
        ss = slow["store_us"]
        print(f"A subscriber sleeping {slow['delay_s'] * 1000:.0f} ms per message on 'on' "
              f"(hwm {HWM}), {pages}-page Stores as fast as they go:")
        print(f"  Store: off {ss['off']:7.1f} us  on {ss['on']:7.1f} us  "
              f"(on/off x{ss['on'] / ss['off']:.3f})")
        print(f"  {slow['events_per_s']:.0f} events/s published; "
              f"{slow['dropped_in_daemon']:.0f} dropped in the daemon (queue full); the "
              f"subscriber read {slow['messages_received']} messages "
              f"({slow['blocks_received']} blocks) and saw {slow['gaps_seen']} gap(s) "
              f"(missed at the high-water mark: replayed by a router)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
