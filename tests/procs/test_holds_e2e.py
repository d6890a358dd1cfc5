"""A hit is a promise, end to end: a real daemon, two workers' sessions on real shared memory,
over the fast path and over gRPC. Every load lands in rows zeroed first and is compared with
the bytes the storing worker wrote (its own buffers, not a mapping of the pool).

- Another worker's Stores evict the hit between Lookup and LoadKeys: with a hold the load is
  exact; without one it fails KEY_NOT_FOUND (what SGLang saw as an aborted batch).
- A held key removed or cleared is gone for every later Lookup and still loads for its holder.
- ReleaseHolds, a session's end and the deadline (``--max-hold-ms``) end holds, counted in
  ``hicache_holds_*``; the quota (``--max-held-fraction``) makes ``held`` < ``hit_prefix``.
- A Lookup naming a session of another pool, or none that exists, is refused.
- Keys only the disk holds are promoted at Lookup time and held once up.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hicache.errors import KeyNotFound, SessionNotFound, SpecInvalid
from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers
from hicache_client.session import WorkerSession
from tests import prom
from tests.daemon_proc import DaemonProc, Daemons, start_daemon

PS = 4
PAGES = 16
SPEC = PoolSpec("holds-e2e", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 2, 32), PS,
                Layout.LAYER_FIRST, size_tokens=PS * PAGES)


@pytest.fixture(scope="module")
def daemon(module_daemons: Daemons) -> DaemonProc:
    return module_daemons.start("--max-hold-ms", "600", "--max-held-fraction", "0.5")


class Worker:
    """A session on its own shared-memory buffers, with bytes that are a function of a key."""

    def __init__(self, daemon: DaemonProc, name: str, fast: bool, pages: int = 2 * PAGES
                 ) -> None:
        self.client = HiCacheClient(daemon.target, fast_path=fast, reconnect_seconds=2)
        self.client.create_pool(SPEC)
        self.bufs = ShmDeviceBuffers.create(SPEC, pages * PS, daemon.shm_dir, prefix=name)
        self.session: WorkerSession = self.client.open_session(SPEC.name, name,
                                                               self.bufs.descriptors)
        self.tensors = [t.view(torch.uint8) for t in self.bufs.all_tensors()]

    @staticmethod
    def bytes_of(key: bytes, shape: torch.Size, member: int) -> torch.Tensor:
        seed = int.from_bytes(key[:6].ljust(6, b"\0"), "little") * 7 + member
        return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed),
                             dtype=torch.uint8)

    def store(self, keys: list[bytes]) -> int:
        for j, k in enumerate(keys):
            for i, t in enumerate(self.tensors):
                rows = t[j * PS:(j + 1) * PS]
                rows.copy_(self.bytes_of(k, rows.shape, i))
        return self.session.store(keys, torch.arange(len(keys) * PS)).stored

    def load_exact(self, keys: list[bytes]) -> None:
        base = PAGES * PS  # rows past what store() writes
        for t in self.tensors:
            t[base:].zero_()
        self.session.load_keys(keys, torch.arange(base, base + len(keys) * PS))
        for j, k in enumerate(keys):
            for i, t in enumerate(self.tensors):
                rows = t[base + j * PS:base + (j + 1) * PS]
                assert torch.equal(rows, self.bytes_of(k, rows.shape, i)), (k, i)

    def close(self) -> None:
        try:
            self.session.close()
        finally:
            self.bufs.close()
            self.client.close()


@pytest.fixture(params=[True, False], ids=["fast", "grpc"])
def workers(request: pytest.FixtureRequest, daemon: DaemonProc) -> Iterator[
        tuple[Worker, Worker]]:
    fast = bool(request.param)
    a, b = Worker(daemon, "holder", fast), Worker(daemon, "storer", fast)
    a.client.clear_pool(SPEC.name)
    assert a.client.data_path == ("fast" if fast else "grpc")
    yield a, b
    a.close()
    b.close()


def keys_of(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}{i:03d}".encode() for i in range(n)]


def store_below(storer: Worker, keys: list[bytes], churn: str) -> None:
    """``keys`` stored, then evicted from host memory by other stores (named ``churn``...)
    once the spiller wrote them below: only the disk has them."""
    storer.store(keys)
    for i in range(6):
        deadline = time.monotonic() + 10
        while storer.client.get_pool(SPEC.name).disk_keys < len(keys) + i * PAGES // 2:
            assert time.monotonic() < deadline, "the spiller did not write the keys"
            time.sleep(0.01)
        storer.store(keys_of(f"{churn}{i}-", PAGES // 2))


def metric(daemon: DaemonProc, name: str, **labels: str) -> float:
    port = int(HiCacheClient(daemon.target).get_info().metrics_port)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return prom.value(text, name, 0.0, **labels)


@pytest.mark.parametrize("hold", [True, False], ids=["held", "not_held"])
def test_eviction_between_lookup_and_load(workers: tuple[Worker, Worker], hold: bool) -> None:
    holder, storer = workers
    hit = keys_of("hit", 4)
    assert storer.store(hit) == 4
    r = holder.session.lookup(hit, hold_ms=5000 if hold else 0)
    assert r.hit_prefix == 4 and r.held == (4 if hold else 0)
    for i in range(4):  # the other worker fills the pool twice over: an LRU cache evicts
        storer.store(keys_of(f"fill{i}-", PAGES // 2))
    if hold:
        holder.load_exact(hit)
        for i in range(4):  # the load consumed the holds: evictable again
            storer.store(keys_of(f"again{i}-", PAGES // 2))
        assert holder.session.lookup(hit).hit_prefix == 0, "consumed holds kept the pages"
    else:
        with pytest.raises(KeyNotFound):
            holder.load_exact(hit)


def test_a_removed_held_key_loads_for_its_holder_only(workers: tuple[Worker, Worker]) -> None:
    holder, storer = workers
    keys = keys_of("rm", 3)
    storer.store(keys)
    assert holder.session.lookup(keys, hold_ms=5000).held == 3
    assert storer.client.remove_keys(SPEC.name, keys[:1]) == 1
    assert storer.client.clear_pool(SPEC.name) == 2
    assert storer.session.lookup(keys, hold_ms=5000).hit_prefix == 0
    with pytest.raises(KeyNotFound):
        storer.session.load_keys(keys[:1], torch.arange(PS))
    holder.load_exact(keys)
    pool = holder.client.get_pool(SPEC.name)
    assert pool.keyed_pages == 0, "the removed pages outlived the holds"


def test_release_the_end_of_a_session_and_the_deadline(
        daemon: DaemonProc, workers: tuple[Worker, Worker]) -> None:
    holder, storer = workers
    keys = keys_of("rel", 4)
    storer.store(keys)
    before = {r: metric(daemon, "hicache_holds_released_total", pool=SPEC.name, reason=r)
              for r in ("released", "session_end")}
    expired = metric(daemon, "hicache_holds_expired_total", pool=SPEC.name)
    assert holder.session.lookup(keys, hold_ms=5000).held == 4
    assert holder.session.release_holds(keys[:1]) == 1
    assert holder.session.release_holds() == 3
    assert storer.session.lookup(keys, hold_ms=60_000).held == 4  # capped at 600 ms
    deadline = time.monotonic() + 5
    while metric(daemon, "hicache_held_pages", pool=SPEC.name) > 0:
        assert time.monotonic() < deadline, "holds did not expire at max_hold_ms"
        time.sleep(0.1)
    assert metric(daemon, "hicache_holds_expired_total", pool=SPEC.name) - expired == 4
    assert holder.session.lookup(keys, hold_ms=5000).held == 4
    holder.session.close()
    deadline = time.monotonic() + 5
    while metric(daemon, "hicache_held_pages", pool=SPEC.name) > 0:
        assert time.monotonic() < deadline, "the session's holds outlived it"
        time.sleep(0.05)
    after = {r: metric(daemon, "hicache_holds_released_total", pool=SPEC.name, reason=r)
             for r in ("released", "session_end")}
    assert after["released"] - before["released"] == 4
    assert after["session_end"] - before["session_end"] == 4
    holder.session = holder.client.open_session(SPEC.name, "holder-2", holder.bufs.descriptors)


def test_a_session_holds_at_most_its_share(workers: tuple[Worker, Worker]) -> None:
    holder, storer = workers
    keys = keys_of("q", PAGES)
    assert storer.store(keys[:8]) == 8 and storer.store(keys[8:]) == 8
    r = holder.session.lookup(keys, hold_ms=5000)
    assert r.hit_prefix == PAGES and r.held == PAGES // 2  # max_held_fraction 0.5
    assert r.promised == r.held
    holder.session.release_holds()


def test_lookups_that_name_a_wrong_session_are_refused(daemon: DaemonProc,
                                                       workers: tuple[Worker, Worker]) -> None:
    holder, _ = workers
    other = PoolSpec("holds-other", SPEC.geometry, PS, Layout.LAYER_FIRST, size_tokens=PS * 4)
    holder.client.create_pool(other)
    with pytest.raises(SpecInvalid) as exc:
        holder.client.lookup(other.name, [b"k"], session_id=holder.session.session_id,
                             hold_ms=100)
    assert exc.value.metadata["field"] == "session_id"
    with pytest.raises(SessionNotFound):
        holder.client.lookup(SPEC.name, [b"k"], session_id="0" * 32, hold_ms=100)
    assert holder.client.lookup(SPEC.name, [b"k"]).held == 0  # no session: nothing held
    holder.client.delete_pool(other.name)


def test_keys_only_the_disk_holds_are_promoted_and_held(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "--max-held-fraction", "0.5", "--disk-path",
                     str(tmp_path / "disk"), "--disk-capacity", "64GiB")
    try:
        holder, storer = Worker(d, "dholder", True), Worker(d, "dstorer", True)
        try:
            keys = keys_of("disk", 4)
            store_below(storer, keys, "d")
            tiers = holder.session.lookup(keys).tiers
            assert set(tiers) == {2}, tiers
            r = holder.session.lookup(keys, hold_ms=5000)
            assert r.hit_prefix == 4 and r.held == 0 and r.promised == 4
            deadline = time.monotonic() + 5
            while holder.client.lookup(SPEC.name, keys).tiers != b"\x01" * 4:
                assert time.monotonic() < deadline, "the Lookup's prefetch never landed"
                time.sleep(0.02)
            for i in range(6):  # host memory churns again: the promoted keys are held
                storer.store(keys_of(f"e{i}-", PAGES // 4))
            assert holder.client.lookup(SPEC.name, keys).tiers == b"\x01" * 4
            holder.load_exact(keys)
        finally:
            holder.close()
            storer.close()
    finally:
        assert d.stop() == 0, d.log()



@pytest.mark.parametrize("fast", [True, False], ids=["fast", "grpc"])
def test_a_hit_on_disk_is_promised_up_to_the_session_s_share(tmp_path: Path,
                                                              fast: bool) -> None:
    """Six keys only the disk has, a session whose share of the 16-page pool is 4 pages: the
    Lookup says 4 are promised (not 6: the client no longer counts every key below host
    memory), over either wire, and a LoadKeys of those 4 gets their exact bytes."""
    d = start_daemon(tmp_path, "--max-held-fraction", "0.25", "--disk-path",
                     str(tmp_path / "disk"), "--disk-capacity", "64GiB")
    try:
        holder, storer = Worker(d, "pholder", fast), Worker(d, "pstorer", True)
        try:
            keys = keys_of("share", 6)
            store_below(storer, keys, "s")
            assert set(holder.session.lookup(keys).tiers) == {2}
            r = holder.session.lookup(keys, hold_ms=5000)
            assert (r.hit_prefix, r.held, r.promised, r.promise) == (6, 0, 4, 4), r
            holder.load_exact(keys[:4])
        finally:
            holder.close()
            storer.close()
    finally:
        assert d.stop() == 0, d.log()
