"""A worker that churns one pool's keys: stores short chains (with their tokens) and removes
keys of a shared key space at random, starting when a start file appears, until it has made
its operations. Prints one JSON line.

Usage: python -m tests.reliability.churn_worker TARGET POOL ID START_FILE OPS SEED
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time

import torch

from hicache.errors import HiCacheError
from hicache_client import HiCacheClient, ShmDeviceBuffers

KEY_SPACE = 96
"""Keys every worker draws from: they store and remove each other's."""


def key(i: int) -> bytes:
    """A 32-byte key, random-looking as SGLang's are (a block hash is its first 8 bytes)."""
    return hashlib.sha256(b"churn-%d" % i).digest()


def main() -> int:
    target, pool, ident, start, ops, seed = sys.argv[1:7]
    rng = random.Random(int(seed))
    client = HiCacheClient(target)
    spec = client.get_pool(pool).spec
    ps = spec.page_size
    stats = {"stores": 0, "removes": 0, "errors": 0}
    with ShmDeviceBuffers.create(spec, 4 * ps, sealed=True) as bufs:
        with client.open_session(pool, f"churn-{ident}", bufs.descriptors,
                                 fds=bufs.fds) as s:
            while not os.path.exists(start):  # every worker begins at once
                time.sleep(0.001)
            for _ in range(int(ops)):
                first = rng.randrange(KEY_SPACE - 4)
                try:
                    if rng.random() < 0.7:
                        n = rng.randint(1, 4)
                        s.store([key(first + i) for i in range(n)], torch.arange(n * ps),
                                token_ids=[first * 1000 + t for t in range(n * ps)],
                                parent_key=key(first - 1) if first else b"")
                        stats["stores"] += 1
                    else:
                        client.remove_keys(pool, [key(first), key(first + 2)])
                        stats["removes"] += 1
                except HiCacheError:
                    stats["errors"] += 1
    print(json.dumps(stats), flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
