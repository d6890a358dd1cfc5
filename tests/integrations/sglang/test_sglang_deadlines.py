"""The linker never stalls SGLang's scheduler, whatever the daemon does: SGLang 0.5.23's own
cache classes against a real daemon that is SIGSTOPped (a daemon swapping, stuck in I/O,
paused) or slow.

- Lookups while the daemon is stopped: every ``match_prefix`` returns within
  ``lookup_timeout_s`` + 50 ms (the maximum is recorded); after the first deadline the link is
  late and lookups skip the daemon. After SIGCONT the link is fenced and up again with the
  same session (no second OpenSession, buffers mapped once) and hits load exactly.
- A load in flight when the daemon stops fails within ``rpc_timeout_s`` + 0.5 s and aborts
  only its batch's requests; nothing lands in their slots after the daemon resumes; the slots
  are withheld from SGLang's allocator until the fence, then given back.
- ``offload`` returns at once while the daemon's Store is slow (2 s per Store).
- The quarantine itself, on SGLang's real allocator.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.daemon_proc import DaemonProc, Daemons, start_daemon
from tests.helpers import require_module
from tests.reliability.figures import record

require_module("sglang", "sglang==0.5.23 (scripts/setup.sh --test)")

import torch  # noqa: E402

from tests.sglang_harness import LAYERS, SGLangCache, tokens_of  # noqa: E402

LOOKUP_S, RPC_S = 0.5, 2.0


@pytest.fixture
def daemon(daemons: Daemons) -> DaemonProc:
    # killed at the end, not drained: a seam holds its loads for 300 s on purpose
    return daemons.start("--no-shm-paths", "--lease-seconds", "30", checked=False,
                         env={"HICACHE_SEAM_DELAYS": "load_keys.resolved=300000"})


def cache_for(d: DaemonProc) -> SGLangCache:
    return SGLangCache(d.target, d.shm_dir, extra={
        "lookup_timeout_s": LOOKUP_S, "rpc_timeout_s": RPC_S, "reconnect_interval_s": 0.2})


def wait_usable(cache: SGLangCache, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cache.linker.link.usable:
        assert time.monotonic() < deadline, "the link did not come back"
        time.sleep(0.02)


def exact(cache: SGLangCache, tokens, slots) -> bool:  # type: ignore[no-untyped-def]
    return all(torch.equal(cache.layer_rows(role, layer, slots),
                           cache.expected(tokens, role, layer))
               for role in cache.roles for layer in range(LAYERS))


@pytest.mark.alone  # 0.1 s of margin over the deadline: beside other tests it measures them
def test_lookups_against_a_stopped_daemon_keep_their_deadline(daemon: DaemonProc) -> None:
    cache = cache_for(daemon)
    try:
        tokens = tokens_of(100, 32)
        assert cache.offload_and_evict(tokens) == 32
        cache.hit_and_load(tokens_of(50, 8), rid="warm")  # SGLang's lazy imports, done
        generation = cache.linker.link.generation
        daemon.pause()
        times = []
        try:
            for i in range(12):
                t0 = time.monotonic()
                hit, failed, _ = cache.hit_and_load(tokens, rid=f"stopped-{i}")
                times.append(time.monotonic() - t0)
                assert hit == 0 and failed == []  # no hit: SGLang recomputes
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        # the deadline, plus SGLang's own work and a busy 2-CPU node's scheduling (the code
        # before this stop's changes measures 0.53-0.55 s here too)
        assert max(times) <= LOOKUP_S + 0.1, times
        assert sum(t > 0.1 for t in times) == 1, "lookups kept waiting on a late daemon"
        wait_usable(cache)
        assert cache.linker.link.generation == generation, "a new session was opened"
        cache.zero_kv()
        hit, failed, slots = cache.hit_and_load(tokens, rid="after")
        assert (hit, failed) == (32, []) and exact(cache, tokens, slots)
        record("sglang_stopped_lookups", lookups=len(times), max_ms=1e3 * max(times),
               deadline_ms=1e3 * LOOKUP_S)
    finally:
        cache.close()


def test_a_load_in_flight_when_the_daemon_stops(daemon: DaemonProc) -> None:
    cache = cache_for(daemon)
    try:
        first, second = tokens_of(300, 16), tokens_of(700, 16)
        cache.offload_and_evict(first)
        cache.offload_and_evict(second)
        generation = cache.linker.link.generation
        cache.zero_kv()
        original = cache.linker._load_batch

        def stop_during(index, batch):  # type: ignore[no-untyped-def]
            # the daemon sits in the seam (300 ms) with the pages held: stop it there
            import threading

            threading.Timer(0.1, daemon.pause).start()
            return original(index, batch)

        cache.linker._load_batch = stop_during  # type: ignore[method-assign]
        t0 = time.monotonic()
        hits, failed, slots = cache.hit_and_load_batch([("x", first), ("y", second)])
        took = time.monotonic() - t0
        cache.linker._load_batch = original  # type: ignore[method-assign]
        assert hits == [16, 16] and sorted(failed) == ["x", "y"]
        assert took <= RPC_S + 0.5, f"the batch took {took:.2f} s"
        withheld = cache.linker.quarantine.withheld
        assert withheld == 8, withheld
        daemon.proc.send_signal(signal.SIGCONT)
        wait_usable(cache)
        assert cache.linker.quarantine.withheld == 0, "the fence did not give the slots back"
        assert cache.linker.link.generation == generation
        time.sleep(0.5)  # whatever the resumed daemon does with the late load: done
        for rid in ("x", "y"):  # SGLang's slots of the aborted requests: nothing landed
            for role in cache.roles:
                for layer in range(LAYERS):
                    assert not cache.layer_rows(role, layer, slots[rid]).any()
        cache.zero_kv()
        hit, failed, got = cache.hit_and_load(first, rid="again")
        assert (hit, failed) == (16, []) and exact(cache, first, got)
    finally:
        cache.close()


def test_a_load_in_flight_when_the_daemon_stops_past_its_lease_gives_every_slot_back(
        daemon: DaemonProc) -> None:
    """The daemon stops with a load in flight long enough that the link goes down (not just
    late) and the session's lease runs out: it comes back through a new session, not the
    late link's probe. The slots withheld for the load still go back, once the daemon says
    the old session is gone (it reaps it, answers SESSION_ENDING while the resumed load is
    still under way, SESSION_NOT_FOUND after), and nothing lands in them."""
    cache = SGLangCache(daemon.target, daemon.shm_dir, extra={
        "lookup_timeout_s": LOOKUP_S, "rpc_timeout_s": RPC_S, "reconnect_interval_s": 0.2,
        "down_after_s": 1.0, "lease_ms": 1000})
    try:
        first = tokens_of(1300, 16)
        cache.offload_and_evict(first)
        generation = cache.linker.link.generation
        cache.zero_kv()
        original = cache.linker._load_batch

        def stop_during(index, batch):  # type: ignore[no-untyped-def]
            import threading

            threading.Timer(0.1, daemon.pause).start()
            return original(index, batch)

        cache.linker._load_batch = stop_during  # type: ignore[method-assign]
        hits, failed, slots = cache.hit_and_load_batch([("x", first)])
        cache.linker._load_batch = original  # type: ignore[method-assign]
        assert hits == [16] and failed == ["x"]
        assert cache.linker.quarantine.withheld == 4
        deadline = time.monotonic() + 10
        while cache.linker.link.up:  # late, then down after down_after_s of missed probes
            assert time.monotonic() < deadline, "the link never went down"
            time.sleep(0.05)
        time.sleep(1.5)  # past the session's lease
        daemon.resume()
        wait_usable(cache, 20)
        assert cache.linker.link.generation > generation, "it came back by a new session"
        deadline = time.monotonic() + 20
        while cache.linker.quarantine.withheld or cache.linker.link.suspects:
            assert time.monotonic() < deadline, (
                f"{cache.linker.quarantine.withheld} page(s) still withheld")
            time.sleep(0.05)
        assert cache.linker.quarantine.kept == 0
        cache.linker.num_completed_offloads()  # the scheduler's next step: due slots go back
        assert cache.linker.quarantine.due == 0
        time.sleep(0.5)
        for role in cache.roles:  # nothing of the late load landed
            for layer in range(LAYERS):
                assert not cache.layer_rows(role, layer, slots["x"]).any()
        cache.zero_kv()
        hit, failed, got = cache.hit_and_load(first, rid="again")
        assert (hit, failed) == (16, []) and exact(cache, first, got)
    finally:
        cache.close()


@pytest.mark.alone  # a 0.2 s bound on the scheduler's thread: beside other tests it measures them
def test_offload_returns_at_once_while_the_store_is_slow(tmp_path: Path) -> None:
    """The Store takes 1 s in the daemon (half the linker's ``rpc_timeout_s``, so that it
    completes): the scheduler's thread does not wait for it, and it lands."""
    d = start_daemon(tmp_path, "--no-shm-paths",
                     env={"HICACHE_SEAM_DELAYS": "store.taken=1000000"})
    cache = cache_for(d)
    try:
        tokens = tokens_of(900, 32)
        t0 = time.monotonic()
        cache.prefill(tokens)  # the insert offloads (write-through): 8 pages, one Store
        took = time.monotonic() - t0
        assert cache.linker.stats["offloads"] >= 1
        assert took < 0.2, f"prefill + offload took {took:.2f} s on the scheduler's thread"
        cache.poll_offloads(timeout=10)
        assert cache.linker.stats["offload_pages"] == 8
    finally:
        cache.close()
        d.stop(signal.SIGKILL)


def test_the_quarantine_keeps_withheld_pages_from_sglangs_allocator() -> None:
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    from hicache_sglang.quarantine import SlotQuarantine
    from tests.sglang_harness import install_stand_ins

    install_stand_ins()
    from sglang.srt import runtime_context as rc
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    override = rc._CONTEXT.override_server_args(device="cpu", page_size=4)
    override.install()
    try:
        kv = MHATokenToKVPool(size=64, page_size=4, dtype=torch.bfloat16, head_num=1,
                              head_dim=8, layer_num=1, device="cpu", enable_memory_saver=False)
        alloc = PagedTokenToKVPoolAllocator(size=64, page_size=4, dtype=torch.bfloat16,
                                            device="cpu", kvcache=kv, need_sort=False)
        q = SlotQuarantine(alloc, 4)
        assert q.installed
        slots = alloc.alloc(16)
        assert slots is not None
        free_before = alloc.available_size()
        q.withhold(slots[:8], "s1")  # two pages of a load that timed out on session s1
        q.withhold(slots[4:12], "s2")  # one of them, and another, on s2
        alloc.free(slots)
        assert alloc.available_size() == free_before + 4, "withheld pages were handed back"
        assert q.kept == 3 and q.sessions == 2
        import threading

        free_list = alloc.free_pages
        fence = threading.Thread(target=lambda: q.release("s1"))  # the link's thread
        fence.start()
        fence.join(5)
        assert alloc.free_pages is free_list, "the link's thread touched SGLang's allocator"
        assert q.due == 1 and q.kept == 2  # the page only s1 withheld: due back
        assert alloc.available_size() == free_before + 4
        assert q.hand_back() == 1  # the scheduler's thread
        assert alloc.available_size() == free_before + 8 and q.due == 0
        assert q.release("s2") == 2
        alloc.free(alloc.alloc(4))  # the scheduler's next free hands them back with it
        assert alloc.available_size() == free_before + 16
        assert q.kept == 0 and q.withheld == 0 and q.sessions == 0 and q.due == 0
        for _ in range(100):  # frees of pages nobody withholds keep nothing
            q.withhold(slots[:4], "s3")
            got = alloc.alloc(16)
            assert got is not None
            alloc.free(got)
        assert q.kept <= 1
        q.close()
        assert alloc._release_page_ids == q._release_pages
    finally:
        override.restore()
