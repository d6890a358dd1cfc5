"""The disk tier on its own: pages in and out exact, checksums, LRU, restarts, races.

Real files in a temporary directory on a real filesystem (ext4 or xfs: O_DIRECT needs one);
pages are numpy buffers split into several runs, as a pool's pages are.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hicached.tiers import disk_format as fmt
from hicached.tiers.disk import DiskTier

RUNS = (1000, 3096, 4096)  # one page = three runs, 8 KiB, not 4 KiB-aligned inside
PAGE = sum(RUNS)
DOC = {"spec": {"name": "p"}}


def page(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in RUNS]


def views(bufs: list[np.ndarray]) -> list[memoryview]:
    return [b.data for b in bufs]


def zeroed() -> list[np.ndarray]:
    return [np.zeros(n, np.uint8) for n in RUNS]


@pytest.fixture(params=[False, True], ids=["buffered", "o_direct"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DiskTier]:
    t = DiskTier(str(tmp_path / "disk"), "p", DOC, PAGE, 8, o_direct=request.param)
    assert t.open() == "created"
    yield t
    t.close()


def test_pages_come_back_exact(tier: DiskTier) -> None:
    for i in range(8):
        assert tier.write(b"k%d" % i, views(page(i)))
    for i in reversed(range(8)):
        got = zeroed()
        assert tier.read_into(b"k%d" % i, views(got))
        assert all(np.array_equal(g, w) for g, w in zip(got, page(i), strict=True))
    assert not tier.read_into(b"absent", views(zeroed()))
    assert tier.stats.writes == 8 and tier.stats.reads == 8


def test_a_corrupt_byte_is_dropped_and_counted_never_served(tier: DiskTier) -> None:
    tier.write(b"good", views(page(1)))
    tier.write(b"bad", views(page(2)))
    slot = tier._index[b"bad"]
    with open(tier.pages_path, "r+b") as f:
        f.seek(slot * tier.slot_bytes + 5000)
        byte = f.read(1)
        f.seek(slot * tier.slot_bytes + 5000)
        f.write(bytes([byte[0] ^ 0x40]))
    got = zeroed()
    assert not tier.read_into(b"bad", views(got))
    assert not tier.contains(b"bad") and tier.stats.checksum_failures == 1
    assert tier.read_into(b"good", views(got))


def test_capacity_is_kept_by_lru(tier: DiskTier) -> None:
    for i in range(8):
        tier.write(b"k%d" % i, views(page(i)))
    assert tier.read_into(b"k0", views(zeroed()))  # k0 used: k1 is now the oldest
    for i in range(8, 10):
        assert tier.write(b"k%d" % i, views(page(i)))
    assert [tier.contains(b"k%d" % i) for i in range(10)] == \
        [True, False, False, True, True, True, True, True, True, True]
    assert tier.keys == 8 and tier.stats.evicted == 2
    got = zeroed()
    assert tier.read_into(b"k9", views(got))
    assert all(np.array_equal(g, w) for g, w in zip(got, page(9), strict=True))


def test_a_held_key_is_not_evicted_until_released_and_a_removal_still_removes_it(
        tier: DiskTier) -> None:
    for i in range(8):
        tier.write(b"k%d" % i, views(page(i)))
    assert tier.hold([b"k0", b"k1", b"absent"]) == [b"k0", b"k1"]  # the oldest two
    assert tier.hold([b"k0"]) == [b"k0"] and tier.held == 2
    for i in range(8, 11):  # room: the oldest not held go
        assert tier.write(b"k%d" % i, views(page(i)))
    assert [tier.contains(b"k%d" % i) for i in range(6)] == [True, True, False, False, False,
                                                              True]
    got = zeroed()
    assert tier.read_into(b"k0", views(got))  # the promise's bytes, exact
    assert all(np.array_equal(g, w) for g, w in zip(got, page(0), strict=True))
    tier.release([b"k0", b"k1"])  # k0 is still held once
    assert tier.held == 1
    for i in range(11, 13):
        assert tier.write(b"k%d" % i, views(page(i)))
    assert tier.contains(b"k0") and not tier.contains(b"k1")
    tier.erase(tier.forget([b"k0"]))  # removals are final, held or not
    assert not tier.contains(b"k0")
    tier.release([b"k0"])
    assert tier.held == 0
    for i in range(13, 21):  # every held key released: the whole tier is evictable again
        assert tier.write(b"k%d" % i, views(page(i)))
    assert tier.keys == 8


def test_the_index_survives_a_restart_and_a_torn_record_does_not(tmp_path: Path) -> None:
    d = str(tmp_path / "disk")
    t = DiskTier(d, "p", DOC, PAGE, 8)
    t.open()
    for i in range(4):
        t.write(b"k%d" % i, views(page(i)))
    slot = t._index[b"k2"]
    t.close()  # or killed: records are written with the page, nothing is flushed at close
    with open(Path(d) / "p.index", "r+b") as f:
        f.seek(fmt.HEADER_BYTES + slot * fmt.RECORD_BYTES + 40)
        f.write(b"\xff")  # a torn record: its crc fails
    again = DiskTier(d, "p", DOC, PAGE, 8)
    assert again.open() == "reattached"
    assert [again.contains(b"k%d" % i) for i in range(4)] == [True, True, False, True]
    got = zeroed()
    assert again.read_into(b"k3", views(got))
    assert all(np.array_equal(g, w) for g, w in zip(got, page(3), strict=True))
    for i in range(4, 10):  # its slot is free again and the LRU goes on
        assert again.write(b"k%d" % i, views(page(i)))
    assert again.keys == 8
    other = DiskTier(d, "p", {"spec": {"name": "other"}}, PAGE, 8)
    assert other.open().startswith("cold:")
    assert other.keys == 0


def test_a_page_written_without_its_record_is_not_found(tmp_path: Path) -> None:
    t = DiskTier(str(tmp_path / "disk"), "p", DOC, PAGE, 4)
    t.open()
    assert t._pages is not None
    t._pages.write(0, views(page(7)))  # killed after the page, before the record
    t.close()
    again = DiskTier(str(tmp_path / "disk"), "p", DOC, PAGE, 4)
    assert again.open() == "reattached" and again.keys == 0


def test_a_slot_being_read_is_not_reused(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    t = DiskTier(str(tmp_path / "disk"), "p", DOC, PAGE, 1)
    t.open()
    t.write(b"old", views(page(1)))
    reading, release = threading.Event(), threading.Event()
    assert t._pages is not None
    real = t._pages.read

    def slow(slot: int, buffers: list[memoryview]) -> int:
        reading.set()
        release.wait(10)
        return real(slot, buffers)

    monkeypatch.setattr(t._pages, "read", slow)
    got, result = zeroed(), []
    reader = threading.Thread(target=lambda: result.append(t.read_into(b"old", views(got))))
    reader.start()
    assert reading.wait(10)
    assert not t.write(b"new", views(page(2)))  # the only slot is being read: no room
    assert t.contains(b"old")  # and its key is not evicted from under the read
    t.erase(t.forget([b"old"]))  # removed mid-read: the slot waits for the read to end
    assert not t.write(b"new", views(page(2)))
    release.set()
    reader.join(10)
    assert result == [True]
    assert all(np.array_equal(g, w) for g, w in zip(got, page(1), strict=True))
    assert t.write(b"new", views(page(2)))  # now the slot is free
    assert t.contains(b"new") and not t.contains(b"old")


def test_many_threads_write_and_read_at_once(tmp_path: Path) -> None:
    t = DiskTier(str(tmp_path / "disk"), "p", DOC, PAGE, 64)
    t.open()
    errors: list[str] = []

    def worker(w: int) -> None:
        for i in range(40):
            n = w * 1000 + i
            t.write(b"k%d" % n, views(page(n)))
            got = zeroed()
            if t.read_into(b"k%d" % n, views(got)) and not all(
                    np.array_equal(g, x) for g, x in zip(got, page(n), strict=True)):
                errors.append(f"k{n} wrong")

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert errors == [] and t.stats.checksum_failures == 0
    assert t.keys == 64
    assert os.path.getsize(t.pages_path) == 64 * t.slot_bytes


def test_batches_move_pages_in_parallel_and_fail_one_by_one(tier: DiskTier) -> None:
    assert tier.write_many([(b"b%d" % i, views(page(i))) for i in range(6)]) == [True] * 6
    slot = tier._index[b"b3"]
    with open(tier.pages_path, "r+b") as f:
        f.seek(slot * tier.slot_bytes + 10)
        f.write(b"\0\0\0\0")
    got = [zeroed() for _ in range(6)]
    ok = tier.read_many([(b"b%d" % i, views(g)) for i, g in enumerate(got)])
    assert ok == [True, True, True, False, True, True]
    for i in (0, 1, 2, 4, 5):
        assert all(np.array_equal(g, w) for g, w in zip(got[i], page(i), strict=True))
    assert not tier.contains(b"b3") and tier.stats.checksum_failures == 1
