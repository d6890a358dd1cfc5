"""The disk tier through a real daemon: spill past host capacity, load back, corrupt, restart.

A daemon with ``--disk-path`` on this machine's disk and a host pool of 32 pages; a worker with
sealed memfd buffers stores 96 keys of random bytes in batches, waiting between batches until
the spiller wrote what became old, so host memory evicts only what the disk holds. Every load
lands in zeroed rows.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hicache.errors import KeyNotFound
from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers, WorkerSession
from tests import prom
from tests.daemon_proc import DaemonProc, Daemons, start_daemon

PS = 16
SPEC = PoolSpec("disk", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 1, 16), PS,
                size_tokens=PS * 32)
BATCH = 8
KEYS = 96


class Worker:
    def __init__(self, d: DaemonProc) -> None:
        self.client = HiCacheClient(d.target)
        self.bufs = ShmDeviceBuffers.create(SPEC, 2 * BATCH * PS, sealed=True)
        self.rows = [t.view(torch.uint8) for t in self.bufs.all_tensors()]
        self.session = self.open()
        self.want: dict[bytes, list[torch.Tensor]] = {}

    def open(self) -> WorkerSession:
        return self.client.open_session(SPEC.name, "w", self.bufs.descriptors,
                                        fds=self.bufs.fds, heartbeat=False)

    def store(self, keys: list[bytes], *, all_stored: bool = True) -> list[bytes]:
        """Store random bytes under ``keys``; returns the keys the daemon had no page for
        (NO_SPACE: not cached, not an error), which ``all_stored`` says there may not be."""
        for r in self.rows:
            r[:BATCH * PS] = torch.randint(0, 256, r[:BATCH * PS].shape, dtype=torch.uint8)
        status = self.session.store(keys, torch.arange(len(keys) * PS)).status
        assert set(status) <= {1, 3} and (not all_stored or set(status) == {1}), status
        for i, k in enumerate(keys):
            if status[i] == 1:
                self.want[k] = [r[i * PS:(i + 1) * PS].clone() for r in self.rows]
        return [k for k, st in zip(keys, status, strict=True) if st == 3]

    def exact(self, keys: list[bytes]) -> bool:
        base = BATCH * PS
        for r in self.rows:
            r[base:] = 0
        self.session.load_keys(keys, torch.arange(base, base + len(keys) * PS))
        return all(torch.equal(r[base + i * PS:base + (i + 1) * PS], self.want[k][j])
                   for i, k in enumerate(keys) for j, r in enumerate(self.rows))

    def close(self) -> None:
        self.bufs.close()
        self.client.close()


def disk_args(tmp: Path, *extra: str) -> tuple[str, ...]:
    return ("--disk-path", str(tmp / "disk"), "--disk-capacity", "64GiB", *extra)


def wait_disk_keys(c: HiCacheClient, n: int) -> None:
    deadline = time.monotonic() + 20
    while c.get_pool(SPEC.name).disk_keys < n:
        assert time.monotonic() < deadline, "the spiller did not write the old keys"
        time.sleep(0.01)


def metrics(d: DaemonProc) -> str:
    return d.metrics()


def value(text: str, name: str) -> float:
    return prom.value(text, name, pool=SPEC.name)


@pytest.fixture
def filled(daemons: Daemons, tmp_path: Path) -> Iterator[tuple[DaemonProc, Worker]]:
    d = daemons.start(*disk_args(tmp_path))
    with HiCacheClient(d.target) as c:
        c.create_pool(SPEC)
    w = Worker(d)
    keys = [b"key-%03d" % i for i in range(KEYS)]
    for i in range(0, KEYS, BATCH):
        w.store(keys[i:i + BATCH])
        wait_disk_keys(w.client, i + BATCH)  # everything old is below before more arrives
    yield d, w
    w.close()


def test_keys_past_host_capacity_spill_and_load_back_exact(filled) -> None:  # type: ignore[no-untyped-def]
    d, w = filled
    keys = sorted(w.want)
    pool = w.client.get_pool(SPEC.name)
    assert pool.keys == 32 and pool.disk_keys == KEYS
    look = w.client.lookup(SPEC.name, keys)
    assert look.hit_prefix == KEYS and look.hits == KEYS
    assert look.tiers[:8] == b"\2" * 8 and look.tiers[-8:] == b"\1" * 8
    for i in range(0, 64, BATCH):  # the oldest 64 are on disk only
        assert w.exact(keys[i:i + BATCH])
    assert w.client.lookup(SPEC.name, keys[56:64]).tiers == b"\1" * 8  # promoted last
    text = metrics(d)
    assert value(text, "hicache_tier_promotions_total") >= 64
    assert value(text, "hicache_disk_spill_dropped_pages_total") == 0
    assert prom.value(text, "hicache_tier_keys", pool="disk", tier="disk") == 96


def test_a_corrupt_page_is_reported_missing_and_counted(filled) -> None:  # type: ignore[no-untyped-def]
    d, w = filled
    keys = sorted(w.want)
    pages = Path(d.log_path).parent / "disk" / f"{SPEC.name}.pages"
    data = bytearray(pages.read_bytes())
    for off in range(0, len(data), 4096):  # one byte in every slot's page
        data[off + 100] ^= 0x01
    pages.write_bytes(bytes(data))
    with pytest.raises(KeyNotFound):
        w.exact(keys[:8])  # on disk only: every read fails its checksum, nothing served
    assert w.client.lookup(SPEC.name, keys[:1]).tiers == b"\0"
    assert value(metrics(d), "hicache_disk_checksum_failures_total") >= 1
    assert w.exact(keys[-8:])  # host copies are untouched


def test_disk_keys_survive_a_restart_and_removal_reaches_the_disk(filled,  # type: ignore[no-untyped-def]
                                                                  tmp_path: Path) -> None:
    d, w = filled
    keys = sorted(w.want)
    w.client.close()
    d.stop(signal.SIGKILL)
    d = start_daemon(tmp_path, *disk_args(tmp_path), socket=d.socket)
    try:
        w.client = HiCacheClient(d.target)
        w.session = w.open()
        assert w.client.lookup(SPEC.name, keys).hits == KEYS
        assert w.exact(keys[8:16])
        assert w.client.remove_keys(SPEC.name, keys[:4]) == 4
        assert w.client.lookup(SPEC.name, keys[:4]).hits == 0
        w.client.clear_pool(SPEC.name)
        assert w.client.get_pool(SPEC.name).disk_keys == 0
        assert w.client.lookup(SPEC.name, keys).hits == 0
    finally:
        d.stop(signal.SIGKILL)


def test_stores_faster_than_the_spill_window_drop_and_count(tmp_path: Path) -> None:
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(f'[tier.disk]\npath = "{tmp_path / "disk"}"\ncapacity = "64GiB"\n'
                   'spill_ahead = 2048\nfsync = "never"\n')  # one page written ahead
    d = start_daemon(tmp_path, "--config", str(cfg))
    w = None
    try:
        with HiCacheClient(d.target) as c:
            c.create_pool(SPEC)
        w = Worker(d)
        keys = [b"fast-%03d" % i for i in range(KEYS)]
        no_space: list[bytes] = []
        for i in range(0, KEYS, BATCH):
            # no waiting: eviction overtakes the spiller; a page the spiller is still writing
            # is not reused until it is done, so a store may find one page short (NO_SPACE)
            no_space += w.store(keys[i:i + BATCH], all_stored=False)
        dropped = value(metrics(d), "hicache_disk_spill_dropped_pages_total")
        assert dropped > 0
        assert len(no_space) < KEYS // 2
        assert w.client.lookup(SPEC.name, no_space).hits == 0  # never cached anywhere
        tiers = w.client.lookup(SPEC.name, keys).tiers
        found = [k for k, t in zip(keys, tiers, strict=True) if t]
        assert len(found) <= KEYS - dropped
        loaded = 0
        for k in found:  # whatever loads is exact (a load may evict what is not below yet)
            try:
                assert w.exact([k])
                loaded += 1
            except KeyNotFound:
                assert w.client.lookup(SPEC.name, [k]).tiers == b"\0"
        assert loaded >= 1
    finally:
        if w is not None:
            w.close()
        d.stop(signal.SIGKILL)
