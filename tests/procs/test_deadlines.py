"""Nothing waits past its deadline, whatever the daemon does: a real daemon SIGSTOPped (as
one swapping, stuck in I/O or paused), over the fast path and over gRPC.

- The client honours a call's ``timeout`` on both paths, its set-up included: a fresh client
  (GetInfo not asked yet), a warm one, one whose other thread is stuck asking for the fast
  path, one on gRPC alone.
- A load whose deadline passed while the daemon was stopped is refused when it resumes
  (``DEADLINE_PASSED``): the rows its caller gave up on stay as they were (zeroed first).
- The session survives: after SIGCONT the same session loads again and its
  ``loads_in_flight`` falls to 0.
- A store is bound by its caller's deadline too (once it has given up it may reuse the device
  pages it named): one that reaches a stopped daemon is refused when it resumes, and one
  whose copy outlives its deadline keeps none of its pages; neither changes the pool, and the
  keys are stored afresh from what the rows hold then.
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
import torch

from hicache.errors import HiCacheError
from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers
from tests.daemon_proc import DaemonProc, Daemons, start_daemon, wait_serving

PS = 4
SPEC = PoolSpec("deadlines", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 2, 32), PS,
                Layout.LAYER_FIRST, size_tokens=PS * 16)
SLACK = 0.05
"""What a call may take beyond its timeout (scheduling of this 2-CPU machine included)."""


@pytest.fixture
def daemon(daemons: Daemons) -> DaemonProc:
    d = daemons.start("--lease-seconds", "30")
    with HiCacheClient(d.target) as c:
        c.create_pool(SPEC)
    return d


class Stopped:
    def __init__(self, d: DaemonProc) -> None:
        self.d = d

    def __enter__(self) -> Stopped:
        self.d.pause()
        return self

    def __exit__(self, *exc: object) -> None:
        self.d.proc.send_signal(signal.SIGCONT)


def timed(fn) -> tuple[float, HiCacheError | None]:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    try:
        fn()
        err = None
    except HiCacheError as exc:
        err = exc
    return time.monotonic() - t0, err


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "grpc"])
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "fresh"])
def test_a_lookup_returns_within_its_timeout_from_a_stopped_daemon(
        daemon: DaemonProc, fast: bool, warm: bool) -> None:
    c = HiCacheClient(daemon.target, fast_path=fast)
    if warm:
        c.lookup(SPEC.name, [b"k"])
        assert c.data_path == ("fast" if fast else "grpc")
    with Stopped(daemon):
        took, err = timed(lambda: c.lookup(SPEC.name, [b"k"], timeout=0.5))
    assert err is not None and err.grpc_code == grpc.StatusCode.DEADLINE_EXCEEDED, err
    assert took <= 0.5 + SLACK, f"lookup(timeout=0.5) took {took:.3f} s"
    assert c.lookup(SPEC.name, [b"k"], timeout=5).hit_prefix == 0  # and works again
    c.close()


def test_a_thread_stuck_asking_for_the_fast_path_does_not_hold_up_another(
        daemon: DaemonProc) -> None:
    c = HiCacheClient(daemon.target)
    with Stopped(daemon):
        first = threading.Thread(target=lambda: timed(
            lambda: c.lookup(SPEC.name, [b"k"], timeout=3)))
        first.start()
        time.sleep(0.1)  # it is inside GetInfo now, holding the client's fast-path lock
        took, err = timed(lambda: c.lookup(SPEC.name, [b"k"], timeout=0.3))
        assert err is not None
        assert took <= 0.3 + SLACK, f"lookup(timeout=0.3) took {took:.3f} s"
    first.join(10)
    c.close()


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "grpc"])
def test_a_load_that_missed_its_deadline_never_lands(daemon: DaemonProc, fast: bool) -> None:
    c = HiCacheClient(daemon.target, fast_path=fast, reconnect_seconds=0)
    with ShmDeviceBuffers.create(SPEC, PS * 8, daemon.shm_dir, prefix="dl") as bufs:
        s = c.open_session(SPEC.name, "deadline", bufs.descriptors)
        tensors = [t.view(torch.uint8) for t in bufs.all_tensors()]
        for t in tensors:
            t[:PS].fill_(7)
        s.store([b"late"], torch.arange(PS))
        for t in tensors:
            t[PS:].zero_()
        with Stopped(daemon):
            took, err = timed(lambda: s.load_keys([b"late"], torch.arange(PS, 2 * PS),
                                                  timeout=0.3))
            assert err is not None and err.grpc_code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert took <= 0.3 + SLACK, f"load_keys(timeout=0.3) took {took:.3f} s"
        deadline = time.monotonic() + 10
        while c.heartbeat(s.session_id).loads_in_flight:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.2)  # whatever the daemon was going to do with the late request: done
        assert all(not t[PS:].any() for t in tensors), "a load landed after its deadline"
        s.load_keys([b"late"], torch.arange(PS, 2 * PS), timeout=5)  # the same session
        assert all(bool((t[PS:2 * PS] == 7).all()) for t in tensors)
        s.close()
    if fast:  # gRPC may drop a call past its deadline before the handler sees it
        assert "DEADLINE_PASSED" in daemon.log()
    c.close()


def _fill(tensors: list[torch.Tensor], value: int) -> None:
    for t in tensors:
        t[:PS].fill_(value)


def _stored(c: HiCacheClient, s: object, key: bytes, tensors: list[torch.Tensor]) -> int:
    """The byte value the daemon holds for ``key`` (loaded into rows zeroed first), or -1."""
    if c.lookup(SPEC.name, [key]).hit_prefix == 0:
        return -1
    for t in tensors:
        t[PS:2 * PS].zero_()
    s.load_keys([key], torch.arange(PS, 2 * PS), timeout=5)  # type: ignore[attr-defined]
    values = {int(v) for t in tensors for v in t[PS:2 * PS].unique()}
    assert len(values) == 1, f"a torn page: {values}"
    return values.pop()


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "grpc"])
def test_a_store_that_reached_a_stopped_daemon_past_its_deadline_keeps_nothing(
        daemon: DaemonProc, fast: bool) -> None:
    c = HiCacheClient(daemon.target, fast_path=fast, reconnect_seconds=0)
    with ShmDeviceBuffers.create(SPEC, PS * 8, daemon.shm_dir, prefix="dls") as bufs:
        s = c.open_session(SPEC.name, "store-deadline", bufs.descriptors)
        tensors = [t.view(torch.uint8) for t in bufs.all_tensors()]
        _fill(tensors, 5)
        s.store([b"warm"], torch.arange(PS))  # the path chosen (fast: asked for already)
        with Stopped(daemon):
            took, err = timed(lambda: s.store([b"given-up"], torch.arange(PS), timeout=0.3))
            assert err is not None and err.grpc_code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert took <= 0.3 + SLACK, f"store(timeout=0.3) took {took:.3f} s"
            _fill(tensors, 9)  # the caller gave up: its rows hold other KV now
        time.sleep(0.3)  # whatever the daemon was going to do with the late request: done
        assert _stored(c, s, b"given-up", tensors) == -1, "a store kept after its deadline"
        assert s.store([b"given-up"], torch.arange(PS), timeout=5).stored == 1
        assert _stored(c, s, b"given-up", tensors) == 9
        s.close()
    if fast:  # gRPC may drop a call past its deadline before the handler sees it
        assert "the store's deadline passed" in daemon.log()
    c.close()


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "grpc"])
def test_a_store_whose_copy_outlives_its_deadline_keeps_none_of_its_pages(
        tmp_path, fast: bool) -> None:  # type: ignore[no-untyped-def]
    """The daemon stops 0.6 s between a store's copy and keeping its pages
    (``store.copied``); the caller gave up after 0.2 s and wrote other KV into its rows."""
    d = start_daemon(tmp_path, "--lease-seconds", "30",
                     env={"HICACHE_SEAM_DELAYS": "store.copied=600000"})
    try:
        wait_serving(d.target)
        c = HiCacheClient(d.target, fast_path=fast, reconnect_seconds=0)
        c.create_pool(SPEC)
        with ShmDeviceBuffers.create(SPEC, PS * 8, d.shm_dir, prefix="dlc") as bufs:
            s = c.open_session(SPEC.name, "store-copy-deadline", bufs.descriptors)
            tensors = [t.view(torch.uint8) for t in bufs.all_tensors()]
            _fill(tensors, 5)
            keys_before = c.get_pool(SPEC.name).keys
            _, err = timed(lambda: s.store([b"slow"], torch.arange(PS), timeout=0.2))
            assert err is not None and err.grpc_code == grpc.StatusCode.DEADLINE_EXCEEDED
            _fill(tensors, 9)
            time.sleep(0.8)  # the copy ends, late
            assert c.get_pool(SPEC.name).keys == keys_before
            assert _stored(c, s, b"slow", tensors) == -1, "a copy past its deadline was kept"
            assert s.store([b"slow"], torch.arange(PS), timeout=5).stored == 1  # 0.6 s
            assert _stored(c, s, b"slow", tensors) == 9
            s.close()
        c.close()
        assert "while its pages were copied; none of them was kept" in d.log()
    finally:
        assert d.stop() == 0, d.log()
