"""A worker that stores keys for as long as it lives, through daemon restarts.

Usage: python -m tests.restart_worker_proc TARGET POOL SEED PAUSE_S

It hands over sealed memfd buffers, stores batches of fresh keys (page bytes a function of the
key: ``tests.cache_worker_proc.content``) and prints one JSON line per attempt before it is
sent (``{"try": [n, ...]}``) and one per reply (``{"ack": [n, ...]}``: keys the daemon said
are stored or present). When the daemon goes away it reconnects and opens a new session, as a
real worker does; the test kills it at the end.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from hicache.errors import HiCacheError
from hicache_client import HiCacheClient, ShmDeviceBuffers, WorkerSession
from tests.cache_worker_proc import content, key_of

BATCH = 8


def main() -> int:
    target, pool, seed, pause = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    client = HiCacheClient(target, reconnect_seconds=60)
    spec = client.get_pool(pool).spec
    ps = spec.page_size
    bufs = ShmDeviceBuffers.create(spec, BATCH * ps, sealed=True)
    tensors = [t.view(torch.uint8) for t in bufs.all_tensors()]
    session: WorkerSession | None = None
    n = seed * 10_000_000
    while True:
        numbers = list(range(n, n + BATCH))
        keys = [key_of(i) for i in numbers]
        for slot, k in enumerate(keys):
            for i, t in enumerate(tensors):
                rows = t[slot * ps:(slot + 1) * ps]
                rows.copy_(content(k, i, tuple(rows.shape)))
        try:
            if session is None:
                session = client.open_session(pool, f"restart-{seed}", bufs.descriptors,
                                              fds=bufs.fds, lease_ms=2000)
            print(json.dumps({"try": numbers}), flush=True)
            r = session.store(keys, torch.arange(BATCH * ps))
        except HiCacheError as exc:
            if session is not None:
                session.stop_heartbeat()
            session = None  # the daemon went away (or the pool is re-attaching): reconnect
            print(json.dumps({"error": exc.reason}), flush=True)
            time.sleep(0.05)
            continue
        if r.no_space:
            print(json.dumps({"fatal": "the pool is full: the test pool must hold every key"}),
                  flush=True)
            return 1
        print(json.dumps({"ack": [x for x, s in zip(numbers, r.status, strict=True)
                                  if s in (1, 2)]}), flush=True)
        n += BATCH
        time.sleep(pause)


if __name__ == "__main__":
    sys.exit(main())
