"""Puts a corrupt object into the cluster store, as a faulty node would: ``size`` random bytes
under ``name`` (a page whose digest cannot match). Runs inside the test's network namespace.

Usage: python -m tests.mooncake_poison MASTER NAME SIZE
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    master, name, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master)
    if rc != 0:
        print(f"setup returned {rc}", file=sys.stderr)
        return 1
    rc = store.put(name, os.urandom(size))
    print(f"put {name}: {rc}")
    store.close()
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
