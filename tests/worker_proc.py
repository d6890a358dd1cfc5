"""A CPU worker process: shm device buffers, a session, backup / load / verify rounds.

Usage: python -m tests.worker_proc TARGET POOL WORKER_ID SEED ROUNDS SHM_DIR [--forever]
Prints one JSON line with what it verified; exits 1 on any mismatch.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from hicache_client import HiCacheClient, ShmDeviceBuffers


def main() -> int:
    target, pool, worker, seed, rounds, shm_dir = sys.argv[1:7]
    forever = "--forever" in sys.argv
    client = HiCacheClient(target)
    info = client.get_pool(pool)
    spec, ps = info.spec, info.spec.page_size
    gen = torch.Generator().manual_seed(int(seed))
    tokens = 8 * ps
    verified = mismatches = 0
    with ShmDeviceBuffers.create(spec, tokens, shm_dir, prefix=f"w{worker}") as bufs:
        tensors = bufs.all_tensors()
        with client.open_session(pool, worker, bufs.descriptors) as session:  # its lease
            print(json.dumps({"worker": worker, "session": session.session_id}), flush=True)
            i = 0
            while forever or i < int(rounds):
                i += 1
                host = client.alloc(pool, 4 * ps)
                dev = torch.arange(4 * ps) + ps * (i % 4)
                for t in tensors:
                    raw = t.view(torch.uint8)
                    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8,
                                            generator=gen))
                expect = [t.view(torch.uint8)[dev].clone() for t in tensors]
                session.backup(host, dev)
                for t in tensors:
                    t.view(torch.uint8).zero_()
                session.load(host, dev)
                for t, e in zip(tensors, expect, strict=True):
                    if torch.equal(t.view(torch.uint8)[dev], e):
                        verified += 1
                    else:
                        mismatches += 1
                client.free(pool, host)
                if forever:
                    time.sleep(0.01)
    print(json.dumps({"worker": worker, "rounds": i, "buffers": len(tensors),
                      "verified_buffers": verified, "mismatches": mismatches}), flush=True)
    client.close()
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
