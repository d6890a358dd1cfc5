"""The one gate both engine integrations' scheduler-side calls go through
(``DaemonLink.gate`` / ``call``), with a real daemon and a real link: a call whose session the
daemon ended is asked again on the new session within its deadline; a late or down link is
not called (``Skipped``) and nothing waits for it; a re-open that stalls costs one caller its
deadline, once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.errors import SessionNotFound
from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicache_client import HiCacheClient, LookupResult, ShmDeviceBuffers, WorkerSession
from hicache_client.engine_config import EngineConfig
from hicache_client.link import DaemonLink, Handover, Skipped
from hicached.server.app import HiCacheServer
from tests.helpers import served_in_process

SPEC = PoolSpec("gate", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, head_num=1, head_dim=8),
                4, size_tokens=4 * 64)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[HiCacheServer, str, str]]:
    with served_in_process(tmp_path, SPEC) as daemon:
        yield daemon


@pytest.fixture
def link(served: tuple[HiCacheServer, str, str]) -> Iterator[DaemonLink]:
    _, target, shm = served
    bufs = ShmDeviceBuffers.create(SPEC, 4 * 8, shm, prefix="gate")
    cfg = EngineConfig(target=target, reconnect_interval_s=0.2)
    lk = DaemonLink(cfg, SPEC, Handover(bufs.descriptors, fds=bufs.fds), "gate-worker",
                    create_pool=False)
    assert lk.start()
    yield lk
    lk.close()
    bufs.close()


def _lookup(client: HiCacheClient, session: WorkerSession, left: float) -> LookupResult:
    return client.lookup(SPEC.name, [b"k" * 32], timeout=left, session_id=session.session_id,
                         hold_ms=1000)


def test_a_call_on_a_session_the_daemon_ended_is_asked_again_on_the_new_one(
        served: tuple[HiCacheServer, str, str], link: DaemonLink) -> None:
    target = served[1]
    old = link.session
    assert old is not None and link.generation == 1
    with HiCacheClient(target) as other:  # the session ends under the quiet worker
        other.close_session(old.session_id)
    used: list[str] = []

    def ask(client: HiCacheClient, session: WorkerSession, left: float) -> LookupResult:
        used.append(session.session_id)
        return _lookup(client, session, left)

    got = link.call(time.monotonic() + 5, ask)
    assert got.hit_prefix == 0
    assert len(used) == 2 and used[0] == old.session_id and used[1] != old.session_id
    assert link.generation == 2 and link.usable


def test_a_second_gone_answer_is_raised_not_asked_a_third_time(link: DaemonLink) -> None:
    calls: list[int] = []

    def gone(client: HiCacheClient, session: WorkerSession, left: float) -> LookupResult:
        calls.append(1)
        client.close_session(session.session_id)  # each session ends before it is used
        return _lookup(client, session, left)

    with pytest.raises(SessionNotFound):
        link.call(time.monotonic() + 5, gone)
    assert len(calls) == 2


def test_a_late_link_is_skipped_at_once(link: DaemonLink) -> None:
    from hicache.errors import DeadlinePassed

    assert link.report(DeadlinePassed("slow"), session=link.session)  # late now
    t0 = time.monotonic()
    with pytest.raises(Skipped):
        link.call(time.monotonic() + 5, _lookup)
    assert link.gate(5) is None
    assert time.monotonic() - t0 < 0.2  # a late daemon is not waited for


def test_a_stalled_reopen_costs_one_caller_its_deadline_once(
        served: tuple[HiCacheServer, str, str], link: DaemonLink) -> None:
    """The link's thread is stopped before it connects while two calls come: the first waits
    its deadline and is skipped, the second is skipped at once; once the re-open goes on,
    calls are served again."""
    go = threading.Event()
    connect = link._connect

    def held_back() -> bool:
        go.wait(30)
        return connect()

    link._connect = held_back  # type: ignore[method-assign]
    try:
        old = link.session
        assert old is not None
        with HiCacheClient(served[1]) as other:
            other.close_session(old.session_id)
        t0 = time.monotonic()
        with pytest.raises(Skipped):  # found gone, waited for the re-open: in vain
            link.call(time.monotonic() + 0.5, _lookup)
        first = time.monotonic() - t0
        assert 0.4 <= first < 1.0, first
        t1 = time.monotonic()
        with pytest.raises(Skipped):
            link.call(time.monotonic() + 0.5, _lookup)
        assert time.monotonic() - t1 < 0.1  # that re-open already cost a caller its wait
        go.set()
        assert link.wait_usable(10)
        assert link.call(time.monotonic() + 5, _lookup).hit_prefix == 0
    finally:
        go.set()


def test_sessions_the_link_reopens_leave_nothing_in_the_client(
        served: tuple[HiCacheServer, str, str], link: DaemonLink) -> None:
    """The daemon ends the link's session again and again (a restart, a lease that lapsed):
    each time the link opens a new one, and the client keeps what it needs for the session
    in use only."""
    target = served[1]
    with HiCacheClient(target) as other:
        for round_ in range(30):
            old = link.session
            assert old is not None
            other.close_session(old.session_id)
            link.call(time.monotonic() + 5, _lookup)  # asked again on the new one
            assert link.generation == round_ + 2
    client, now = link._state.client, link.session
    assert client is not None and now is not None
    deadline = time.monotonic() + 10  # the link's thread retires the last one after its call
    while set(client._page_sizes) != {now.session_id}:
        assert time.monotonic() < deadline, len(client._page_sizes)
        time.sleep(0.01)
