"""A CPU worker process using the cache: shm device buffers, a session, keyed stores and loads.

Usage: python -m tests.cache_worker_proc TARGET POOL SHM_DIR MODE ARGS...

Modes (each prints JSON lines; the last one is the result; exit 1 on any mismatch):
- ``overlap WORKER SEED UNIVERSE PICK SYNC_DIR NWORKERS``: wait for every worker (files in
  SYNC_DIR), store its own stripe of a UNIVERSE of key numbers and PICK random others, in
  shuffled batches, report which keys this process stored; wait again, then load every key of
  the universe and verify it.
- ``store-forever SEED``: alloc owned raw pages, then store fresh keys in batches forever,
  printing every acknowledged batch (the test kills it).
- ``churn SEED SECONDS``: store fresh keys in batches for SECONDS; after each batch, load
  back the most recent keys still in host memory into zeroed rows and verify them (a key
  evicted meanwhile is skipped); report how many were verified and how many were gone.
- ``instance TOKENS_SEED NTOKENS store|hit``: keys of a token sequence as SGLang computes them;
  ``store`` stores its pages, ``hit`` looks them up and loads them (another process, another
  "instance" of the model).

Page contents are a function of the key only, as for any content-addressed page.
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib

import numpy as np
import torch

from hicache.keys import sglang_page_keys
from hicache_client import HiCacheClient, ShmDeviceBuffers, WorkerSession

BATCH = 8


def key_of(n: int) -> bytes:
    return b"page-%08d" % n


def content(key: bytes, tensor: int, shape: tuple[int, ...]) -> torch.Tensor:
    rng = np.random.default_rng(zlib.crc32(key) * 16 + tensor)
    return torch.from_numpy(rng.integers(0, 256, size=shape, dtype=np.uint8))


class Worker:
    def __init__(self, client: HiCacheClient, pool: str, bufs: ShmDeviceBuffers) -> None:
        self.client, self.pool, self.bufs = client, pool, bufs
        self.ps = client.get_pool(pool).spec.page_size
        self.tensors = [t.view(torch.uint8) for t in bufs.all_tensors()]
        self.mismatches = 0
        self.verified = 0

    def rows(self, slot: int) -> slice:
        return slice(slot * self.ps, (slot + 1) * self.ps)

    def dev(self, n: int) -> torch.Tensor:
        return torch.arange(n * self.ps)

    def fill(self, keys: list[bytes]) -> None:
        for slot, k in enumerate(keys):
            for i, t in enumerate(self.tensors):
                r = t[self.rows(slot)]
                r.copy_(content(k, i, tuple(r.shape)))

    def load_and_verify(self, session: WorkerSession, keys: list[bytes]) -> None:
        for t in self.tensors:
            t[: len(keys) * self.ps].zero_()
        session.load_keys(keys, self.dev(len(keys)))
        for slot, k in enumerate(keys):
            ok = all(torch.equal(t[self.rows(slot)], content(k, i, tuple(t[self.rows(slot)].shape)))
                     for i, t in enumerate(self.tensors))
            self.verified += ok
            self.mismatches += not ok


def barrier(sync: str, name: str, n: int) -> None:
    open(os.path.join(sync, name), "w").close()
    while len([f for f in os.listdir(sync) if f.startswith(name.split(".")[0] + ".")]) < n:
        time.sleep(0.01)


def overlap(w: Worker, session: WorkerSession, args: list[str]) -> dict[str, object]:
    worker, seed, universe, pick, sync, nworkers = args
    n, u, rng = int(nworkers), int(universe), np.random.default_rng(int(seed))
    stripe = set(range(int(worker) * u // n, (int(worker) + 1) * u // n))
    others = rng.choice(sorted(set(range(u)) - stripe), size=int(pick), replace=False)
    numbers = rng.permutation(sorted(stripe | {int(x) for x in others}))
    keys = [key_of(int(i)) for i in numbers]
    barrier(sync, f"start.{worker}", n)
    stored: list[str] = []
    for i in range(0, len(keys), BATCH):
        batch = keys[i:i + BATCH]
        w.fill(batch)
        r = session.store(batch, w.dev(len(batch)))
        assert r.no_space == 0, "the test pool must hold the whole universe"
        stored += [k.decode() for k, s in zip(batch, r.status, strict=True) if s == 1]
    barrier(sync, f"stored.{worker}", n)
    everything = [key_of(i) for i in range(int(universe))]
    for i in range(0, len(everything), BATCH):
        w.load_and_verify(session, everything[i:i + BATCH])
    return {"stored": stored}


def store_forever(w: Worker, session: WorkerSession, args: list[str]) -> dict[str, object]:
    base = int(args[0]) * 1_000_000
    raw = session.alloc(2 * w.ps)
    print(json.dumps({"owned_raw_tokens": int(raw.numel())}), flush=True)
    i = 0
    while True:
        batch = [key_of(base + i * BATCH + j) for j in range(BATCH)]
        w.fill(batch)
        session.store(batch, w.dev(BATCH))
        print(json.dumps({"acknowledged": [k.decode() for k in batch]}), flush=True)
        i += 1


def churn(w: Worker, session: WorkerSession, args: list[str]) -> dict[str, object]:
    from hicache.errors import KeyNotFound

    base, seconds = int(args[0]) * 1_000_000, float(args[1])
    end = time.monotonic() + seconds
    stored: list[bytes] = []
    gone = 0
    i = 0
    while time.monotonic() < end:
        batch = [key_of(base + i * BATCH + j) for j in range(BATCH)]
        i += 1
        w.fill(batch)
        r = session.store(batch, w.dev(len(batch)))
        stored += [k for k, st in zip(batch, r.status, strict=True) if st == 1]
        recent = stored[-4 * BATCH:]
        found = w.client.lookup(w.pool, recent, session_id=session.session_id)
        here = [k for k, t in zip(recent, found.tiers, strict=True) if t == 1][:BATCH]
        try:
            w.load_and_verify(session, here)
        except KeyNotFound:
            gone += 1  # evicted between the Lookup and the load: nothing was loaded
    return {"stored": len(stored), "gone": gone}


def instance(w: Worker, session: WorkerSession, args: list[str]) -> dict[str, object]:
    seed, ntokens, what = args
    tokens = np.random.default_rng(int(seed)).integers(0, 152_064, size=int(ntokens))
    keys = sglang_page_keys(tokens.tolist(), w.ps)
    if what == "store":
        for i in range(0, len(keys), BATCH):
            w.fill(keys[i:i + BATCH])
            session.store(keys[i:i + BATCH], w.dev(len(keys[i:i + BATCH])))
        return {"keys": len(keys)}
    hit = w.client.lookup(w.pool, keys)
    for i in range(0, len(keys), BATCH):
        w.load_and_verify(session, keys[i:i + BATCH])
    return {"keys": len(keys), "hit_prefix": hit.hit_prefix}


def main() -> int:
    target, pool, shm_dir, mode, *args = sys.argv[1:]
    client = HiCacheClient(target)
    spec = client.get_pool(pool).spec
    with ShmDeviceBuffers.create(spec, BATCH * spec.page_size, shm_dir,
                                 prefix=f"cw{os.getpid()}") as bufs:
        w = Worker(client, pool, bufs)
        with client.open_session(pool, f"{mode}-{os.getpid()}", bufs.descriptors
                                 ) as session:  # the daemon's lease
            result = {"overlap": overlap, "store-forever": store_forever,
                      "churn": churn, "instance": instance}[mode](w, session, args)
    result.update(verified=w.verified, mismatches=w.mismatches)
    print(json.dumps(result), flush=True)
    client.close()
    return 1 if w.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
