"""Integrity worker: back up its own pages with versioned content, load and verify them, then
load and verify every worker's pages (overlapping reads). Prints one JSON line.

Usage: python -m tests.reliability.integrity_worker TARGET POOL WORKER NWORKERS PAGES SECONDS
                                                    SHM_DIR SYNC_DIR
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch

from hicache.errors import HiCacheError
from hicache_client import HiCacheClient, ShmDeviceBuffers


def content(shape: torch.Size, page: int, gen: int, salt: int) -> torch.Tensor:
    n = int(np.prod(shape))
    x = (torch.arange(n, dtype=torch.int64) * (2 * gen + 1) + page * 131 + salt * 7919) % 251
    return x.to(torch.uint8).reshape(shape)


def main() -> int:
    target, pool, worker, nworkers, npages, seconds, shm_dir, sync = sys.argv[1:9]
    w, nw, npg = int(worker), int(nworkers), int(npages)
    client = HiCacheClient(target)
    spec = client.get_pool(pool).spec
    ps = spec.page_size
    rng = np.random.default_rng(w)
    stats = {"worker": w, "backups": 0, "loads": 0, "pages_verified": 0, "bytes_verified": 0,
             "mismatches": 0, "lost_acknowledged": 0, "errors": 0}
    with ShmDeviceBuffers.create(spec, 2 * npg * ps, shm_dir, prefix=f"int{w}") as bufs:
        tensors = [t.view(torch.uint8) for t in bufs.all_tensors()]
        host = client.alloc(pool, npg * ps).reshape(npg, ps)
        acked: dict[int, int] = {}

        def fill(slot: int, page: int, gen: int) -> None:
            for i, t in enumerate(tensors):
                rows = t[slot * ps:(slot + 1) * ps]
                rows.copy_(content(rows.shape, page, gen, i))

        def verify(slot: int, page: int, gen: int) -> None:
            for i, t in enumerate(tensors):
                rows = t[slot * ps:(slot + 1) * ps]
                if torch.equal(rows, content(rows.shape, page, gen, i)):
                    stats["bytes_verified"] += rows.numel()
                else:
                    stats["mismatches"] += 1
            stats["pages_verified"] += 1

        with client.open_session(pool, f"integrity-{w}", bufs.descriptors) as s:
            deadline = time.monotonic() + float(seconds)
            gen = 0
            while time.monotonic() < deadline:
                gen += 1
                k = int(rng.integers(1, npg + 1))
                pages = rng.choice(npg, size=k, replace=False)
                for slot, p in enumerate(pages):
                    fill(slot, int(host[p, 0]), gen)
                dev = torch.arange(k * ps)
                s.backup(host[torch.from_numpy(pages)].reshape(-1), dev)
                stats["backups"] += 1
                for p in pages:
                    acked[int(p)] = gen
                back = rng.choice(npg, size=k, replace=False)
                back = np.array([p for p in back if int(p) in acked] or [int(pages[0])])
                slots = torch.arange(npg, npg + back.size)
                dev = (slots[:, None] * ps + torch.arange(ps)).reshape(-1)
                s.load(host[torch.from_numpy(back)].reshape(-1), dev)
                stats["loads"] += 1
                for slot, p in zip(slots.tolist(), back.tolist(), strict=True):
                    verify(slot, int(host[p, 0]), acked[p])
            # publish the last acknowledged generation of every page, then read everyone's
            mine = {int(host[p, 0]): g for p, g in acked.items()}
            tmp = os.path.join(sync, f"{w}.tmp")
            with open(tmp, "w") as f:
                json.dump(mine, f)
            os.rename(tmp, os.path.join(sync, f"{w}.json"))
            while len([n for n in os.listdir(sync) if n.endswith(".json")]) < nw:
                time.sleep(0.05)
            everyone: dict[int, int] = {}
            for name in os.listdir(sync):
                if name.endswith(".json"):
                    with open(os.path.join(sync, name)) as f:
                        everyone.update({int(k): v for k, v in json.load(f).items()})
            items = sorted(everyone.items())
            for i in range(0, len(items), npg):
                chunk = items[i:i + npg]
                hidx = torch.tensor([[p + j for j in range(ps)] for p, _ in chunk]).reshape(-1)
                dev = torch.arange(len(chunk) * ps)
                try:
                    s.load(hidx, dev)
                except HiCacheError:
                    stats["errors"] += 1
                    stats["lost_acknowledged"] += len(chunk)
                    continue
                stats["loads"] += 1
                for slot, (p, g) in enumerate(chunk):
                    before = stats["mismatches"]
                    verify(slot, p, g)
                    if stats["mismatches"] != before:
                        stats["lost_acknowledged"] += 1
            # every worker has read everything before anyone frees its pages
            open(os.path.join(sync, f"{w}.done"), "w").close()
            while len([n for n in os.listdir(sync) if n.endswith(".done")]) < nw:
                time.sleep(0.05)
        client.free(pool, host.reshape(-1))
    print(json.dumps(stats), flush=True)
    client.close()
    return 0 if stats["mismatches"] == 0 and stats["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
