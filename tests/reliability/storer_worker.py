"""Another instance's worker: stores fresh keys into a pool as fast as it can until told to
stop (a file), keeping the pool under eviction pressure. Prints one JSON line.

Usage: python -m tests.reliability.storer_worker TARGET POOL ID STOP_FILE
"""

from __future__ import annotations

import json
import os
import sys

import torch

from hicache.errors import HiCacheError
from hicache_client import HiCacheClient, ShmDeviceBuffers

BATCH = 4


def main() -> int:
    target, pool, ident, stop = sys.argv[1:5]
    client = HiCacheClient(target)
    spec = client.get_pool(pool).spec
    ps = spec.page_size
    stats = {"stores": 0, "stored": 0, "errors": 0}
    with ShmDeviceBuffers.create(spec, BATCH * ps, sealed=True) as bufs:
        for t in bufs.all_tensors():
            t.view(torch.uint8).random_()
        with client.open_session(pool, f"storer-{ident}", bufs.descriptors,
                                 fds=bufs.fds) as s:
            n = 0
            while not os.path.exists(stop):
                keys = [b"storer-%s-%d" % (ident.encode(), n + i) for i in range(BATCH)]
                n += BATCH
                try:
                    stats["stored"] += s.store(keys, torch.arange(BATCH * ps)).stored
                    stats["stores"] += 1
                except HiCacheError:
                    stats["errors"] += 1
    print(json.dumps(stats), flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
