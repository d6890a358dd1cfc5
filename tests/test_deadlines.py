"""Nothing waits past its deadline, whatever the daemon does: a real daemon SIGSTOPped (as
one swapping, stuck in I/O or paused), over the fast path and over gRPC.

- The client honours a call's ``timeout`` on both paths, its set-up included: a fresh client
  (GetInfo not asked yet), a warm one, one whose other thread is stuck asking for the fast
  path, one on gRPC alone.
- A load whose deadline passed while the daemon was stopped is refused when it resumes
  (``DEADLINE_PASSED``): the rows its caller gave up on stay as they were (zeroed first).
- The session survives: after SIGCONT the same session loads again and its
  ``loads_in_flight`` falls to 0.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from hicache.errors import HiCacheError
from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers
from tests.daemon_proc import DaemonProc, start_daemon

PS = 4
SPEC = PoolSpec("deadlines", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 2, 32), PS,
                Layout.LAYER_FIRST, size_tokens=PS * 16)
SLACK = 0.05
"""What a call may take beyond its timeout (scheduling of this 2-CPU machine included)."""


@pytest.fixture
def daemon(tmp_path) -> Iterator[DaemonProc]:  # type: ignore[no-untyped-def]
    d = start_daemon(tmp_path, "--lease-seconds", "30")
    with HiCacheClient(d.target) as c:
        c.create_pool(SPEC)
    yield d
    d.proc.send_signal(signal.SIGCONT)
    assert d.stop() == 0, d.log()


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
