"""The hicached linker driven by SGLang 0.5.23's own cache classes, against a real daemon.

SGLang builds the linker itself (its factory, the ``dynamic`` backend, our dotted path); the
tests run the scheduler's steps (tests/sglang_harness.py) and check KV bytes after zeroing the
device slots they land in. Covered: MHA (bf16, fp8 stored as uint8) and MLA; a second process
hitting what the first stored; the daemon killed between offload and load and coming back; a
load whose keys vanished (only its request aborts); MLA over two TP ranks sharing one pool that
rank 0 writes; MHA over two ranks with a pool each.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests import prom
from tests.daemon_proc import REPO, DaemonProc, Daemons
from tests.helpers import require_module

require_module("sglang", "sglang==0.5.23 (scripts/setup.sh --test)")

import torch  # noqa: E402

from hicache.errors import Unavailable  # noqa: E402
from hicache_client import HiCacheClient  # noqa: E402
from tests.sglang_harness import LAYERS, SGLangCache, tokens_of  # noqa: E402


@pytest.fixture
def daemon(daemons: Daemons) -> DaemonProc:
    return daemons.start("--no-shm-paths")  # CPU workers hand over sealed memfds


def assert_exact(cache: SGLangCache, tokens, slots) -> None:
    assert slots is not None
    for role in cache.roles:
        for layer in range(LAYERS):
            got, want = cache.layer_rows(role, layer, slots), cache.expected(tokens, role, layer)
            assert torch.equal(got, want), f"{role} layer {layer} differs"


def roundtrip(cache: SGLangCache, tokens) -> None:
    assert cache.offload_and_evict(tokens) == len(tokens)
    cache.zero_kv()  # what lands must come from the daemon
    hit, failed, slots = cache.hit_and_load(tokens)
    assert (hit, failed) == (len(tokens), [])
    assert_exact(cache, tokens, slots)


@pytest.mark.parametrize("kind,dtype,stored", [
    ("mha", torch.bfloat16, "BFLOAT16"),
    ("mha", torch.float8_e4m3fn, "UINT8"),
    ("mla", torch.bfloat16, "BFLOAT16"),
    ("mla", torch.float16, "FLOAT16"),
])
def test_offload_evict_match_load_exact(daemon: DaemonProc, kind, dtype, stored) -> None:
    cache = SGLangCache(daemon.target, daemon.shm_dir, kind=kind, dtype=dtype)
    try:
        assert type(cache.linker).__name__ == "HicachedLinker"
        tokens = tokens_of(1000, 32)
        roundtrip(cache, tokens)
        stats = cache.linker.stats
        assert stats["offload_pages"] == 8 and stats["load_pages"] == 8
        assert stats["lookup_hit_pages"] == 8
        with HiCacheClient(daemon.target) as c:
            pool = c.get_pool(cache.linker.spec.name)
            assert pool.spec.geometry.dtype.value == stored
            assert pool.keys == 8
    finally:
        cache.close()


def test_partial_prefix_hits_only_what_was_stored(daemon: DaemonProc) -> None:
    cache = SGLangCache(daemon.target, daemon.shm_dir)
    try:
        stored = tokens_of(2000, 12)  # 3 pages
        cache.offload_and_evict(stored)
        cache.zero_kv()
        longer = tokens_of(2000, 24)  # same 3 pages, then 3 never stored
        hit, failed, slots = cache.hit_and_load(longer)
        assert (hit, failed) == (12, [])
        assert_exact(cache, stored, slots)
        other = tokens_of(3000, 24)
        assert cache.hit_and_load(other)[0] == 0
    finally:
        cache.close()


@pytest.mark.parametrize("poll_us", [0, 150])
def test_the_linkers_calls_poll_as_configured(daemon: DaemonProc, poll_us: int) -> None:
    """``poll_us`` reaches the linker's client: every fast-path connection its threads opened
    polls at most that long (0: never)."""
    cache = SGLangCache(daemon.target, daemon.shm_dir, extra={"poll_us": poll_us})
    try:
        roundtrip(cache, tokens_of(2500, 16))
        client = cache.linker.link.client
        assert client is not None and client.data_path == "fast"
        conns = list(client._fast._conns)  # type: ignore[union-attr]
        assert conns and {c.frames.poll.max_ns for c in conns} == {poll_us * 1000}
        if not poll_us:
            assert sum(c.frames.poll.polls for c in conns) == 0
    finally:
        cache.close()


def run_worker(daemon: DaemonProc, mode: str, *extra: str, timeout: float = 120
               ) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "tests.sglang_worker_proc", "--target", daemon.target,
         "--shm-dir", daemon.shm_dir, "--mode", mode, *extra],
        cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_another_instance_hits_what_the_first_stored(daemon: DaemonProc) -> None:
    first = run_worker(daemon, "store", "--start", "5000")
    assert first["stats"]["offload_pages"] == 8
    second = run_worker(daemon, "load", "--start", "5000")  # a fresh SGLang cache
    assert second["pool"] == first["pool"]
    assert (second["hit"], second["failed"], second["exact"]) == (32, [], True)
    assert second["stats"]["offloads"] == 0


def test_daemon_killed_between_offload_and_load(daemons: Daemons) -> None:
    d = daemons.start("--no-shm-paths")
    cache = SGLangCache(d.target, d.shm_dir)
    try:
        tokens = tokens_of(7000, 16)
        cache.offload_and_evict(tokens)
        d.stop(signal.SIGKILL)
        # no daemon: no hit, no exception; an offload is dropped and counted
        assert cache.hit_and_load(tokens) == (0, [], None)
        cache.prefill(tokens_of(8000, 8))
        cache.poll_offloads()
        assert cache.linker.stats["offloads_dropped"] + cache.linker.stats[
            "offload_failures"] >= 1
        # the daemon comes back on the same socket: the link reconnects by itself
        d = daemons.start("--no-shm-paths", socket=d.socket)
        deadline = time.monotonic() + 15
        while not cache.linker.link.up:
            assert time.monotonic() < deadline, "the linker did not reconnect"
            time.sleep(0.05)
        assert cache.linker.link.generation == 2
        cache.evict_all()
        roundtrip(cache, tokens_of(9000, 16))
    finally:
        cache.close()


def wait_reachable(client: HiCacheClient | None, timeout: float = 10.0) -> None:
    """Until ``client``'s channel reaches a daemon (a restarted one: connected again)."""
    assert client is not None
    end = time.monotonic() + timeout
    while True:
        try:
            client.get_info()
            return
        except Unavailable:
            assert time.monotonic() < end, "the restarted daemon is not reachable"
            time.sleep(0.02)


@pytest.mark.parametrize("reopen_after_s,deadline_s,hit", [(0.5, 5.0, 16), (3.0, 0.5, 0)],
                         ids=["within_the_deadline", "past_the_deadline"])
def test_a_lookup_after_a_restart_waits_for_the_new_session_within_its_deadline(
        daemons: Daemons, reopen_after_s: float, deadline_s: float, hit: int) -> None:
    """The daemon restarts (its pool re-attached, keys kept) under a quiet worker; the link's
    re-open is held back (its thread stopped before it connects) while SGLang matches: the
    lookup finds the session gone, waits for the new one within its deadline and asks again
    (a hit), or, when the re-open comes later than the deadline, is skipped by then. The vLLM
    spec's lookups go through the same gate."""
    import threading

    d = daemons.start("--no-shm-paths")
    cache = SGLangCache(d.target, d.shm_dir, extra={"lookup_timeout_s": deadline_s})
    link = cache.linker.link
    go = threading.Event()
    connect = link._connect

    def held_back() -> bool:
        go.wait(30)
        return bool(connect())

    try:
        tokens = tokens_of(31000, 16)
        assert cache.offload_and_evict(tokens) == 16
        link._connect = held_back  # type: ignore[method-assign]
        channel = link.client  # (None while the link is down)
        d.stop(signal.SIGKILL)
        d = daemons.start("--no-shm-paths", socket=d.socket)
        # the link's channel may still be in its reconnect backoff (up to 250 ms): then the
        # lookup finds the daemon unreachable, not the session gone, and skips it at once
        wait_reachable(channel)
        threading.Timer(reopen_after_s, go.set).start()
        t0 = time.monotonic()
        assert cache.match(tokens, rid="first") == hit
        took = time.monotonic() - t0
        assert took < deadline_s + 0.5, took  # never past the lookup's deadline
        assert took >= min(reopen_after_s, deadline_s) - 0.1, took  # it did wait
        assert cache.linker.stats["lookups_skipped" if not hit else "lookups"] >= 1
        go.set()
        end = time.monotonic() + 15
        while not link.usable:
            assert time.monotonic() < end, "the link did not re-open"
            time.sleep(0.05)
        assert link.generation == 2
        cache.zero_kv()
        got, failed, slots = cache.hit_and_load(tokens, rid="first")
        assert (got, failed) == (16, [])
        assert_exact(cache, tokens, slots)
    finally:
        go.set()
        cache.close()


@pytest.mark.parametrize("holds", [True, False], ids=["holds", "no_holds"])
def test_a_batch_whose_keys_vanish_after_lookup(daemon: DaemonProc, holds: bool) -> None:
    """Two requests in one batch; between the lookups and the load another instance clears
    the pool (its reset). With holds (the default) both requests still load, exactly: a hit
    is a promise. Without them the batch's load fails, and SGLang 0.5.23, which judges a
    batch's load as one, aborts both; the refused load moved nothing into their slots."""
    cache = SGLangCache(daemon.target, daemon.shm_dir,
                        extra=None if holds else {"lookup_hold_ms": 0})
    try:
        first, second = tokens_of(4000, 16), tokens_of(6000, 12)
        cache.offload_and_evict(first)
        cache.offload_and_evict(second)
        original = cache.linker.lookup
        looked: list[str] = []

        def lookup_then_clear(rid, transfers):
            found = original(rid, transfers)
            looked.append(rid)
            if len(looked) == 2:
                with HiCacheClient(daemon.target) as c:
                    assert c.clear_pool(cache.linker.spec.name) > 0
            return found

        cache.linker.lookup = lookup_then_clear
        cache.zero_kv()
        hits, failed, slots = cache.hit_and_load_batch([("a", first), ("b", second)])
        cache.linker.lookup = original
        assert hits == [16, 12] and set(slots) == {"a", "b"}
        if holds:
            assert failed == []
            assert_exact(cache, first, slots["a"])
            assert_exact(cache, second, slots["b"])
            assert cache.linker.stats["load_failures"] == 0
        else:
            assert sorted(failed) == ["a", "b"]  # SGLang's batch verdict
            for rid in ("a", "b"):
                for role in cache.roles:
                    for layer in range(LAYERS):
                        assert not cache.layer_rows(role, layer, slots[rid]).any()
            assert cache.linker.stats["load_failures"] == 1
        assert cache.linker.link.up  # a refused load is not a lost daemon
        roundtrip(cache, tokens_of(4500, 8))  # the next request is served normally
    finally:
        cache.close()


def test_a_flush_leaves_other_instances_pages(daemon: DaemonProc) -> None:
    """SGLang's ``/flush_cache`` on one instance resets its linker: its own answers and holds
    go, the shared pool's pages stay, for it and for every other instance of the model."""
    first = SGLangCache(daemon.target, daemon.shm_dir)
    second = SGLangCache(daemon.target, daemon.shm_dir)
    try:
        assert first.linker.spec.name == second.linker.spec.name
        tokens, other = tokens_of(21000, 16), tokens_of(23000, 12)
        assert first.offload_and_evict(tokens) == 16
        assert second.match(other, rid="waiting") == 0  # an answer the flush forgets
        assert second.match(tokens, rid="held") == 16  # held for `second`, never loaded
        second.flush()
        assert second.linker.stats["resets"] == 1
        with HiCacheClient(daemon.target) as c:
            pool = c.get_pool(first.linker.spec.name)
            assert pool.keys == 4, "a flush emptied the shared pool"
        session = second.linker.link.session
        assert session is not None
        assert session.release_holds() == 0, "the flush kept its holds"
        for cache in (second, first):
            cache.zero_kv()
            hit, failed, slots = cache.hit_and_load(tokens, rid="after-flush")
            assert (hit, failed) == (16, [])
            assert_exact(cache, tokens, slots)
    finally:
        second.close()
        first.close()


def test_a_waiting_request_asks_the_daemon_once_per_hold(daemon: DaemonProc) -> None:
    """SGLang matches a request it cannot admit again on every scheduler loop: the linker
    answers from the lookup it made while that answer's hold stands, asks again once it may
    have lapsed, and the admitted request loads exactly what it was promised."""
    cache = SGLangCache(daemon.target, daemon.shm_dir, extra={"lookup_hold_ms": 1000})
    try:
        tokens, missing = tokens_of(25000, 16), tokens_of(27000, 8)
        cache.offload_and_evict(tokens)
        for _ in range(50):
            assert cache.match(tokens, rid="waits") == 16
            assert cache.match(missing, rid="misses") == 0
        assert (cache.linker.stats["lookups"], cache.linker.stats["lookups_reused"]) == (2, 98)
        time.sleep(0.55)  # past hold_book.FRESH_SHARE of the hold: it may have lapsed
        assert cache.match(tokens, rid="waits") == 16
        assert cache.linker.stats["lookups"] == 3
        cache.zero_kv()
        hit, failed, slots = cache.hit_and_load(tokens, rid="waits")
        assert (hit, failed) == (16, [])
        assert_exact(cache, tokens, slots)
        assert cache.linker.stats["lookups"] == 3  # admitted on the answer it had
    finally:
        cache.close()


def held_pages(daemon: DaemonProc, pool: str) -> float:
    return prom.value(daemon.metrics(), "hicache_held_pages", pool=pool)


def test_a_hold_goes_when_no_request_counts_on_it_and_not_before(daemon: DaemonProc) -> None:
    """Two waiting requests were told the same hit: one's load declines, the holds stay for
    the other; the other's queued load is cancelled, the holds go (off the scheduler's
    thread); an admitted load consumes them."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    cache = SGLangCache(daemon.target, daemon.shm_dir, extra={"lookup_hold_ms": 30000})
    linker, pool = cache.linker, cache.linker.spec.name
    try:
        tokens = tokens_of(29000, 16)
        assert cache.offload_and_evict(tokens) == 16
        asked: list[list[str]] = []
        original = linker.lookup

        def spy(rid: str, transfers: list[Any]) -> list[int]:
            asked.append(list(transfers[0].keys))
            got: list[int] = original(rid, transfers)
            return got

        linker.lookup = spy
        assert cache.match(tokens, rid="a") == 16 and cache.match(tokens, rid="b") == 16
        linker.lookup = original
        keys = asked[0]
        assert len(keys) == 4 and asked[1] == keys
        assert held_pages(daemon, pool) == 4
        slots = torch.arange(16, 32)
        # a's load declines (its slots do not fit its keys): b still counts on the holds
        assert not linker.load("a", [PoolTransfer(PoolName.KV, keys=keys,
                                                  device_indices=slots[:3])])
        assert linker._holds.settle()
        assert held_pages(daemon, pool) == 4
        # b's load is queued, then cancelled (SGLang aborted it): nothing counts on them
        assert linker.load("b", [PoolTransfer(PoolName.KV, keys=keys, device_indices=slots)])
        assert linker.cancel_queued_load("b")
        assert linker._holds.settle()
        assert held_pages(daemon, pool) == 0
        assert linker._holds.claimed == 0
        # an admitted request's load uses its holds: none is left behind, nothing released
        cache.zero_kv()
        hit, failed, got = cache.hit_and_load(tokens, rid="c")
        assert (hit, failed) == (16, [])
        assert_exact(cache, tokens, got)
        assert linker._holds.settle()
        assert held_pages(daemon, pool) == 0 and linker._holds.claimed == 0
    finally:
        cache.close()


@pytest.mark.parametrize("kind", ["mla", "mha"])
def test_two_tp_ranks(daemon: DaemonProc, tmp_path: Path, kind: str) -> None:
    init = tmp_path / "dist-init"
    cmd = [sys.executable, "-m", "tests.sglang_worker_proc", "--target", daemon.target,
           "--shm-dir", daemon.shm_dir, "--mode", "roundtrip", "--kind", kind, "--start",
           "6000", "--world", "2", "--init", str(init)]
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    for o in outs:
        assert (o["hit"], o["failed"], o["exact"]) == (32, [], True), o
    r0, r1 = outs
    with HiCacheClient(daemon.target) as c:
        pools = {p.spec.name: p for p in c.list_pools()}
    if kind == "mla":  # identical KV on every rank: one pool, written once, read by both
        assert r0["pool"] == r1["pool"] and "tpall" in r0["pool"]
        assert r0["stats"]["offload_pages"] == 8 and r1["stats"]["offloads"] == 0
        assert pools[r0["pool"]].keys == 8
        assert r1["stats"]["load_pages"] == 8
    else:  # MHA heads are split across ranks: a pool per rank
        assert r0["pool"] != r1["pool"]
        assert r0["stats"]["offload_pages"] == r1["stats"]["offload_pages"] == 8
        assert pools[r0["pool"]].keys == pools[r1["pool"]].keys == 8


def test_instances_with_different_device_pool_sizes_share_one_pool(daemon: DaemonProc) -> None:
    tokens = tokens_of(11000, 16)
    first = SGLangCache(daemon.target, daemon.shm_dir, size=256)
    try:
        first.prefill(tokens)
        first.poll_offloads()
    finally:
        first.close()
    second = SGLangCache(daemon.target, daemon.shm_dir, size=512)  # another memory fraction
    try:
        assert second.linker.link.up, "the pool of another size must not keep it out"
        assert second.linker.spec.name == first.linker.spec.name
        second.zero_kv()
        hit, failed, slots = second.hit_and_load(tokens)
        assert (hit, failed) == (16, [])
        assert_exact(second, tokens, slots)
    finally:
        second.close()
    # the pool keeps the size its creator gave it: pool_size_ratio (4) times its device pool
    with HiCacheClient(daemon.target) as c:
        assert c.get_pool(first.linker.spec.name).size_tokens == 4 * 256


def test_a_default_pool_larger_than_the_budget_is_fitted_to_it(daemons: Daemons) -> None:
    """``pool_size_ratio`` times the device pool is more than the daemon's whole budget: the
    linker still comes up, with the pool the budget has room for, and serves hits."""
    d = daemons.start("--no-shm-paths", "--memory-budget", "4MiB")
    cache = SGLangCache(d.target, d.shm_dir, extra={"pool_size_ratio": 1024})
    try:
        assert cache.linker.link.up, d.log()
        asked = cache.linker.spec.size_tokens
        with HiCacheClient(d.target) as c:
            got = c.get_pool(cache.linker.spec.name).size_tokens
            assert 0 < got < asked and c.get_info().memory_used_bytes <= 4 << 20
        roundtrip(cache, tokens_of(13000, 16))
    finally:
        cache.close()
