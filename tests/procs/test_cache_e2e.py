"""The cache end to end: a daemon process, worker processes, real shared memory, real races."""

from __future__ import annotations

import collections
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.errors import HiCacheError
from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers
from tests.cache_worker_proc import content, key_of
from tests.daemon_proc import REAPED_WITHIN_S, REPO, DaemonProc, Daemons
from tests.reliability.figures import record

SPEC = PoolSpec("cache-e2e", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 4, 2, 64), 16,
                Layout.PAGE_FIRST, size_tokens=16 * 160)


@pytest.fixture(scope="module")
def daemon(module_daemons: Daemons) -> DaemonProc:
    return module_daemons.start()


@pytest.fixture
def client(daemon: DaemonProc) -> Iterator[HiCacheClient]:
    c = HiCacheClient(daemon.target, reconnect_seconds=2)
    c.create_pool(SPEC)
    c.clear_pool(SPEC.name)
    yield c
    c.close()


def spawn(daemon: DaemonProc, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.cache_worker_proc", daemon.target,
                             SPEC.name, daemon.shm_dir, *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    parsed: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return parsed


def test_eight_workers_store_overlapping_keys_each_written_once(
        daemon: DaemonProc, client: HiCacheClient, tmp_path: Path) -> None:
    universe, workers = 96, 8
    names = {key_of(i) for i in range(universe)}
    stream = client.watch_events(SPEC.name)  # a router following the cache while they run
    seen: list[bytes] = []
    done = threading.Event()

    def follow() -> None:
        for e in stream:
            seen.extend(k for k in e.keys if e.kind == "STORED" and k in names)
            if len(seen) >= universe:
                done.set()

    follower = threading.Thread(target=follow)
    follower.start()
    procs = [spawn(daemon, "overlap", str(w), str(w + 1), str(universe), "30", str(tmp_path),
                   str(workers)) for w in range(workers)]
    results = [result(p) for p in procs]
    done.wait(10)
    stream.cancel()
    follower.join(10)
    writers = collections.Counter(k for r in results for k in r["stored"])
    assert set(writers) == {key_of(i).decode() for i in range(universe)}
    assert max(writers.values()) == 1, "a key was written by two requests"
    for r in results:  # every worker loaded every key, byte for byte
        assert r["mismatches"] == 0 and r["verified"] == universe
    assert sorted(seen) == sorted(names), "the event stream did not show each store once"
    record("cache_overlap", workers=workers, keys=universe,
           stores=sum(len(r["stored"]) for r in results), pages_verified=universe * workers)


def test_a_worker_killed_mid_store_leaves_only_whole_keys(daemon: DaemonProc,
                                                          client: HiCacheClient) -> None:
    victim = spawn(daemon, "store-forever", "7")
    assert victim.stdout is not None
    owned = json.loads(victim.stdout.readline())["owned_raw_tokens"]
    assert owned > 0 and client.get_pool(SPEC.name).raw_pages == owned // SPEC.page_size
    acknowledged: list[bytes] = []
    while len(acknowledged) < 5 * 8:
        acknowledged += [k.encode() for k in json.loads(victim.stdout.readline())["acknowledged"]]
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    candidates = [key_of(7_000_000 + i) for i in range(len(acknowledged) + 3 * 8)]
    seen = client.lookup(SPEC.name, candidates)
    assert seen.hit_prefix >= len(acknowledged), "an acknowledged key is missing"
    visible = [k for k, t in zip(candidates, seen.tiers, strict=True) if t]
    ps = SPEC.page_size
    with ShmDeviceBuffers.create(SPEC, 8 * ps, daemon.shm_dir, prefix="survivor") as bufs:
        tensors = [t.view(torch.uint8) for t in bufs.all_tensors()]
        with client.open_session(SPEC.name, "survivor", bufs.descriptors) as s:
            for i in range(0, len(visible), 8):
                batch = visible[i:i + 8]
                for t in tensors:
                    t.zero_()
                s.load_keys(batch, torch.arange(len(batch) * ps))
                for slot, k in enumerate(batch):
                    for j, t in enumerate(tensors):
                        rows = t[slot * ps:(slot + 1) * ps]
                        assert torch.equal(rows, content(k, j, tuple(rows.shape))), k
    deadline = time.monotonic() + REAPED_WITHIN_S  # its session reaped, its raw pages freed
    while client.get_pool(SPEC.name).raw_pages:
        assert time.monotonic() < deadline, "the dead worker's owned raw pages leaked"
        time.sleep(0.1)
    record("cache_sigkill_mid_store", acknowledged=len(acknowledged), visible=len(visible),
           faults_injected=1)


def test_another_process_hits_what_one_instance_stored(daemon: DaemonProc,
                                                       client: HiCacheClient) -> None:
    pages, extra = 20, 7
    ntokens = str(pages * SPEC.page_size + extra)  # a partial last page has no key
    stored = result(spawn(daemon, "instance", "5", ntokens, "store"))
    assert stored["keys"] == pages
    hit = result(spawn(daemon, "instance", "5", ntokens, "hit"))
    assert hit["hit_prefix"] == pages and hit["verified"] == pages and hit["mismatches"] == 0


def _race(seconds: float, write: object, read: object) -> None:
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop(step: object) -> None:
        try:
            while not stop.is_set():
                step()  # type: ignore[operator]
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=loop, args=(f,)) for f in (write, read)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]


def test_a_writer_and_a_reader_on_one_page_never_tear(daemon: DaemonProc,
                                                      client: HiCacheClient) -> None:
    ps, key = SPEC.page_size, b"contended"
    versions = [key + b"/A", key + b"/B"]
    counts = collections.Counter[str]()
    with ShmDeviceBuffers.create(SPEC, 2 * ps, daemon.shm_dir, prefix="writer") as wb, \
            ShmDeviceBuffers.create(SPEC, 2 * ps, daemon.shm_dir, prefix="reader") as rb, \
            HiCacheClient(daemon.target) as wc, HiCacheClient(daemon.target) as rc:
        wt = [t.view(torch.uint8) for t in wb.all_tensors()]
        rt = [t.view(torch.uint8) for t in rb.all_tensors()]
        expect = [[content(v, j, tuple(t[:ps].shape)) for j, t in enumerate(rt)]
                  for v in versions]
        ws = wc.open_session(SPEC.name, "writer", wb.descriptors)
        rs = rc.open_session(SPEC.name, "reader", rb.descriptors)
        host = ws.alloc(ps)
        dev = torch.arange(ps)

        def put(version: int) -> None:
            for j, t in enumerate(wt):
                t[:ps].copy_(expect[version][j])

        def which() -> int:
            got = [t[:ps] for t in rt]
            matches = [v for v in (0, 1) if all(torch.equal(g, e)
                                                for g, e in zip(got, expect[v], strict=True))]
            assert matches, "a load returned a torn page: neither whole version"
            return matches[0]

        state = {"v": 0}

        def keyed_write() -> None:
            state["v"] ^= 1
            put(state["v"])
            wc.remove_keys(SPEC.name, [key])
            ws.store([key], dev)

        def keyed_read() -> None:
            for t in rt:
                t.zero_()
            try:
                rs.load_keys([key], dev)
            except HiCacheError as exc:
                assert exc.reason == "KEY_NOT_FOUND"
                counts["keyed_miss"] += 1
                return
            counts[f"keyed_{which()}"] += 1

        def raw_write() -> None:
            state["v"] ^= 1
            put(state["v"])
            try:
                ws.backup(host, dev)
            except HiCacheError as exc:
                assert exc.reason == "PAGE_BUSY"
                counts["raw_write_busy"] += 1

        def raw_read() -> None:
            for t in rt:
                t.zero_()
            try:
                rs.load(host, dev)
            except HiCacheError as exc:
                assert exc.reason == "PAGE_BUSY"
                counts["raw_read_busy"] += 1
                return
            counts[f"raw_{which()}"] += 1

        _race(1.5, keyed_write, keyed_read)
        put(0)
        ws.backup(host, dev)
        _race(1.5, raw_write, raw_read)
        rs.close()
        ws.close()
    assert counts["keyed_0"] + counts["keyed_1"] > 0 and counts["raw_0"] + counts["raw_1"] > 0
    record("cache_one_page_race", **counts)
