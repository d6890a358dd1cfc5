"""A worker of the one-writer stress test (tests/reliability/test_page_writer.py).

Roles:

- ``raw``: a buggy raw client: allocates a page, then backs it up (its own bytes, never a key's)
  from one thread while another thread frees it, over and over.
- ``keyed``: stores pages under keys whose bytes are a function of the key, and loads random
  stored keys back into rows zeroed first, counting every page that does not hold its key's
  bytes (``mismatches``): the raw client's bytes in a keyed page would show there.

Both start on a barrier (a file per worker in SYNC, then all go) and run at least SECONDS, then
on until every worker has done ENOUGH of its own work (a raw backup, a checked keyed load), so
that a loaded machine stretches the run instead of thinning it; CAP_SECONDS more at most. Prints
one JSON line. Usage: python -m tests.reliability.page_writer_worker TARGET POOL ROLE ID SECONDS
SHM_DIR SYNC NWORKERS
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time

import numpy as np
import torch

from hicache.errors import HiCacheError
from hicache_client import HiCacheClient, ShmDeviceBuffers

RAW_PAGES = 8
"""Pages of each raw backup (a longer check before the copy: a wider window)."""
KEYED_BATCH = 4
ENOUGH = 30
"""Raw backups, or checked keyed loads, each worker does before it may stop."""
CAP_SECONDS = 60.0
"""How far past SECONDS a worker goes on waiting for the others to have done enough."""


def key_bytes(key: bytes, shape: torch.Size, member: int) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(key + bytes([member])).digest()[:8], "little") >> 1
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed),
                         dtype=torch.uint8)


def barrier(sync: str, name: str, n: int) -> None:
    open(os.path.join(sync, f"{name}.ready"), "w").close()
    while len([f for f in os.listdir(sync) if f.endswith(".ready")]) < n:
        time.sleep(0.01)


class Run:
    """Whether a worker goes on: always before its deadline; after it, until every worker has
    marked itself done (a ``.done`` file in SYNC, written once its own count reaches ENOUGH),
    or CAP_SECONDS later."""

    def __init__(self, sync: str, name: str, n: int, seconds: float) -> None:
        self._sync, self._name, self._n = sync, name, n
        self._deadline = time.monotonic() + seconds
        self._cap = self._deadline + CAP_SECONDS
        self._marked = False

    def going(self, done: int) -> bool:
        now = time.monotonic()
        if now < self._deadline:
            return True
        if not self._marked and done >= ENOUGH:
            open(os.path.join(self._sync, f"{self._name}.done"), "w").close()
            self._marked = True
        if now > self._cap:
            return False
        return len([f for f in os.listdir(self._sync) if f.endswith(".done")]) < self._n


def raw(client: HiCacheClient, pool: str, s, tensors: list[torch.Tensor], ps: int,  # type: ignore[no-untyped-def]
        run: Run, stats: dict[str, int]) -> None:
    for t in tensors:
        t.fill_(0xEE)  # the raw client's bytes: never a key's
    dev = torch.arange(RAW_PAGES * ps)
    while run.going(stats["raw_backups"]):
        try:
            host = client.alloc(pool, RAW_PAGES * ps)
        except HiCacheError:
            stats["raw_no_space"] = stats.get("raw_no_space", 0) + 1
            continue
        freed = threading.Thread(target=lambda h=host: _quiet(client.free, pool, h))
        freed.start()
        try:
            s.backup(host, dev)
            stats["raw_backups"] += 1
        except HiCacheError as exc:
            stats[f"raw_{exc.reason.lower()}"] = stats.get(f"raw_{exc.reason.lower()}", 0) + 1
        freed.join()
        _quiet(client.free, pool, host)  # whichever order they ran in: free it once more


def _quiet(fn, *args) -> None:  # type: ignore[no-untyped-def]
    try:
        fn(*args)
    except HiCacheError:
        pass


def keyed(s, tensors: list[torch.Tensor], ps: int, me: int, run: Run,  # type: ignore[no-untyped-def]
          stats: dict[str, int]) -> None:
    rng = np.random.default_rng(me)
    stored: list[bytes] = []
    n = 0

    def check(keys: list[bytes], slots: torch.Tensor) -> None:
        for j, key in enumerate(keys):
            for i, t in enumerate(tensors):
                rows = t[int(slots[j * ps]):int(slots[j * ps]) + ps]
                if not torch.equal(rows, key_bytes(key, rows.shape, i)):
                    stats["mismatches"] += 1
                    break
            stats["loaded"] += 1

    batch = torch.arange(KEYED_BATCH * ps)
    back = torch.arange(KEYED_BATCH * ps, 2 * KEYED_BATCH * ps)
    while run.going(stats["loaded"]):
        keys = [b"w%d-%d" % (me, n + j) for j in range(KEYED_BATCH)]
        n += KEYED_BATCH
        for j, key in enumerate(keys):
            for i, t in enumerate(tensors):
                t[j * ps:(j + 1) * ps].copy_(key_bytes(key, t[j * ps:(j + 1) * ps].shape, i))
        status = s.store(keys, batch).status
        stored += [k for k, st in zip(keys, status, strict=True) if st == 1]
        if not stored:
            continue
        pick = [stored[-1 - int(rng.integers(min(len(stored), 8)))]]
        for t in tensors:
            t[back[0]:back[-1] + 1].zero_()
        try:
            s.load_keys(pick, back[:ps])
        except HiCacheError:
            stats["evicted"] += 1  # a small pool: evicted by someone's store
            continue
        check(pick, back)
    for key in stored[-64:]:  # what is still cached at the end: one by one, zeroed first
        for t in tensors:
            t[back[0]:back[-1] + 1].zero_()
        try:
            s.load_keys([key], back[:ps])
        except HiCacheError:
            continue
        check([key], back)
    stats["stored"] = len(stored)


def main() -> int:
    target, pool, role, ident, seconds, shm_dir, sync, nworkers = sys.argv[1:9]
    client = HiCacheClient(target)
    spec = client.get_pool(pool).spec
    ps = spec.page_size
    stats = {"stored": 0, "loaded": 0, "evicted": 0, "mismatches": 0, "raw_backups": 0}
    with ShmDeviceBuffers.create(spec, 2 * RAW_PAGES * ps, shm_dir, prefix=f"pw{ident}") as bufs:
        tensors = [t.view(torch.uint8) for t in bufs.all_tensors()]
        with client.open_session(pool, f"{role}-{ident}", bufs.descriptors) as s:
            barrier(sync, ident, int(nworkers))
            run = Run(sync, ident, int(nworkers), float(seconds))
            if role == "raw":
                raw(client, pool, s, tensors, ps, run, stats)
            else:
                keyed(s, tensors, ps, int(ident), run, stats)
    print(json.dumps(stats), flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
