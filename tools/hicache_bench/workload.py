"""A worker process of the soak and the torture: a node's traffic, checked byte for byte.

``python -m hicache_bench.workload TARGET POOL WORKER MODE [--grpc] [--seconds S]``

Every page a worker stores holds bytes that are a function of its key (``page_content``), so
any load anywhere can be checked against what was stored under it. Buffers are sealed memfds
(no torch): the rows are written and read as numpy arrays.

- ``soak``: sessions opened and closed; now and then the process ends without closing its
  session (``CRASH_EXIT``: a crash, the daemon reaps it); in a session, rounds of a Store of
  fresh keys, a Lookup holding what it finds of the worker's recent keys, a LoadKeys of the
  held prefix into rows zeroed first, checked, and now and then a RemoveKeys or a
  ReleaseHolds. One JSON line of counts (``calls``, ``errors``, ``wrong_bytes``,
  ``sessions``, ``loads``, ``reasons``) every second and at the end.
- ``torture``: Stores of fresh keys and RemoveKeys of stored ones, each announced before it
  is sent (``{"try": [...]}``, ``{"removing": [...]}``) and acknowledged after its reply
  (``{"stored": [...]}``, ``{"removed": [...]}``), through daemon kills: a call that fails
  reconnects and opens a new session, as a real worker does. Keys are numbers
  (``key_of``).

Primitives: ``key_of(n)``, ``page_content(key, index, nbytes)``, ``Pages`` (a session's
buffers as pages: ``fill``, ``zero``, ``check``), ``SPEC`` (the pool both commands use).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import zlib

import numpy as np

from hicache.errors import HiCacheError
from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers

PAGE_SIZE = 16
GEOMETRY = KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 1, 16)
"""2 layers x K/V x 16 tokens x 1 head x 16 bf16: 2 KiB pages."""


def spec(name: str, pages: int) -> PoolSpec:
    return PoolSpec(name, GEOMETRY, PAGE_SIZE, size_tokens=PAGE_SIZE * pages)


SPEC = spec("soak", 4096)
BATCH = 8
CRASH_EXIT = 3
"""The exit status of a worker that ended without closing its session on purpose."""


def key_of(n: int) -> bytes:
    return b"page-%012d" % n


def page_content(key: bytes, index: int, nbytes: int) -> np.ndarray:
    """The bytes of buffer ``index``'s rows of the page stored under ``key``."""
    rng = np.random.default_rng(zlib.crc32(key) * 64 + index)
    return rng.integers(0, 256, size=nbytes, dtype=np.uint8)


class Pages:
    """A session's buffers seen as pages of ``page_size`` rows (every buffer of a page)."""

    def __init__(self, bufs: ShmDeviceBuffers, page_size: int) -> None:
        self.ps = page_size
        self.rows = [bufs.rows(d.member, d.role, d.layer) for d in bufs.descriptors]

    def _page(self, rows: np.ndarray, slot: int) -> np.ndarray:
        return rows[slot * self.ps:(slot + 1) * self.ps].reshape(-1)

    def fill(self, slot: int, key: bytes) -> None:
        for i, rows in enumerate(self.rows):
            page = self._page(rows, slot)
            page[:] = page_content(key, i, page.size)

    def zero(self, slots: range) -> None:
        for rows in self.rows:
            rows[slots.start * self.ps:slots.stop * self.ps] = 0

    def check(self, slot: int, key: bytes) -> int:
        """Bytes of the page at ``slot`` that differ from what ``key`` stores."""
        wrong = 0
        for i, rows in enumerate(self.rows):
            page = self._page(rows, slot)
            wrong += int(np.count_nonzero(page != page_content(key, i, page.size)))
        return wrong

    def indices(self, slots: range) -> np.ndarray:
        return np.arange(slots.start * self.ps, slots.stop * self.ps, dtype=np.int64)


def _say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def soak(client: HiCacheClient, pool: str, worker: int, seconds: float) -> int:
    rng = random.Random(worker)
    spec_ = client.get_pool(pool).spec
    bufs = ShmDeviceBuffers.create(spec_, 2 * BATCH * spec_.page_size, sealed=True)
    pages = Pages(bufs, spec_.page_size)
    counts = {"calls": 0, "errors": 0, "wrong_bytes": 0, "sessions": 0, "loads": 0,
              "loaded_pages": 0}
    reasons: dict[str, int] = {}
    recent: list[bytes] = []
    n = worker * 10**9
    end = time.monotonic() + seconds
    said = time.monotonic()

    def failed(exc: HiCacheError) -> None:
        counts["errors"] += 1
        reasons[exc.reason] = reasons.get(exc.reason, 0) + 1

    while time.monotonic() < end:
        try:
            session = client.open_session(pool, f"soak-{worker}", bufs.descriptors,
                                          fds=bufs.fds)
        except HiCacheError as exc:
            failed(exc)
            time.sleep(0.05)
            continue
        counts["sessions"] += 1
        counts["calls"] += 1
        for _ in range(rng.randint(1, 6)):
            keys = [key_of(n + i) for i in range(BATCH)]
            n += BATCH
            for slot, k in enumerate(keys):
                pages.fill(slot, k)
            try:
                session.store(keys, pages.indices(range(0, BATCH)))
                counts["calls"] += 1
                recent = (recent + keys)[-64:]
                want = rng.sample(recent, min(len(recent), BATCH))
                found = session.lookup(want, 2000)
                counts["calls"] += 1
                held = int(found.promised)
                if held:
                    pages.zero(range(BATCH, 2 * BATCH))
                    session.load_keys(want[:held], pages.indices(range(BATCH, BATCH + held)))
                    counts["calls"] += 1
                    counts["loads"] += 1
                    counts["loaded_pages"] += held
                    for i, k in enumerate(want[:held]):
                        counts["wrong_bytes"] += pages.check(BATCH + i, k)
                if rng.random() < 0.2 and recent:
                    gone = rng.sample(recent, min(len(recent), 4))
                    client.remove_keys(pool, gone)
                    counts["calls"] += 1
                    recent = [k for k in recent if k not in gone]
                if rng.random() < 0.1:
                    session.release_holds()
                    counts["calls"] += 1
            except HiCacheError as exc:
                failed(exc)
                break
        if time.monotonic() - said >= 1.0:
            _say(**counts, reasons=reasons)
            said = time.monotonic()
        if rng.random() < 0.1:  # a crash: no goodbye, the daemon reaps the session
            _say(**counts, reasons=reasons, crashed=True)
            os._exit(CRASH_EXIT)
        try:
            session.close()
            counts["calls"] += 1
        except HiCacheError as exc:
            failed(exc)
    _say(**counts, reasons=reasons, done=True)
    bufs.close()
    return 0


def torture(client: HiCacheClient, pool: str, worker: int, pause: float = 0.0) -> int:
    """Until killed: Stores of fresh keys and RemoveKeys of acknowledged ones, announced and
    acknowledged on stdout (see the module's docstring)."""
    rng = random.Random(worker)
    spec_ = client.get_pool(pool).spec
    bufs = ShmDeviceBuffers.create(spec_, BATCH * spec_.page_size, sealed=True)
    pages = Pages(bufs, spec_.page_size)
    session = None
    stored: list[int] = []
    n = worker * 10**9
    while True:
        try:
            if session is None:
                session = client.open_session(pool, f"torture-{worker}", bufs.descriptors,
                                              fds=bufs.fds)
            if stored and rng.random() < 0.25:
                gone = rng.sample(stored, min(len(stored), 4))
                _say(removing=gone)
                client.remove_keys(pool, [key_of(g) for g in gone])
                _say(removed=gone)
                stored = [s for s in stored if s not in gone]
                continue
            numbers = list(range(n, n + BATCH))
            for slot, x in enumerate(numbers):
                pages.fill(slot, key_of(x))
            _say(**{"try": numbers})
            r = session.store([key_of(x) for x in numbers], pages.indices(range(BATCH)))
            n += BATCH
            acked = [x for x, s in zip(numbers, r.status, strict=True) if s in (1, 2)]
            if r.no_space:
                _say(fatal="the pool is full: the torture's pool must hold every key")
                return 1
            _say(stored=acked)
            stored += acked
            if pause:
                time.sleep(pause)
        except HiCacheError as exc:
            session = None  # the daemon went away: reconnect, a new session
            _say(error=exc.reason)
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hicache_bench.workload")
    ap.add_argument("target")
    ap.add_argument("pool")
    ap.add_argument("worker", type=int)
    ap.add_argument("mode", choices=["soak", "torture"])
    ap.add_argument("--grpc", action="store_true", help="gRPC only (no fast path)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--pause", type=float, default=0.0, help="torture: seconds between Stores")
    args = ap.parse_args(argv)
    client = HiCacheClient(args.target, fast_path=not args.grpc, reconnect_seconds=30)
    if args.mode == "soak":
        return soak(client, args.pool, args.worker, args.seconds)
    return torture(client, args.pool, args.worker, args.pause)


if __name__ == "__main__":
    sys.exit(main())
