"""The link's fences (``DaemonLink.suspect`` / ``on_fenced``), with a real daemon and a real
link, each race stopped between its steps by a hook: a heartbeat asked before a load timed out
does not fence it; a suspicion recorded while a fence is given is not swallowed by it; a
dropped session is fenced by the daemon's "gone" to the link's close of it (never kept alive by
a heartbeat); no daemon listening fences only after ``UNREACHABLE_FENCE_S``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import hicache_client.link as link_module
from hicache.errors import DeadlinePassed, Unavailable
from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers
from hicache_client.engine_config import EngineConfig
from hicache_client.link import DaemonLink, Handover
from hicached.server.app import HiCacheServer
from tests.helpers import served_in_process

SPEC = PoolSpec("fence", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, head_num=1, head_dim=8),
                4, size_tokens=4 * 64)


class Recorder:
    """What happened, in order, from every thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, str]] = []

    def add(self, what: str, sid: str) -> None:
        with self.lock:
            self.events.append((what, sid))

    def of(self, sid: str) -> list[str]:
        with self.lock:
            return [w for w, s in self.events if s == sid]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[HiCacheServer, str, str]]:
    with served_in_process(tmp_path, SPEC) as daemon:
        yield daemon


@pytest.fixture
def linked(served: tuple[HiCacheServer, str, str]
           ) -> Iterator[tuple[DaemonLink, Recorder]]:
    _, target, shm = served
    rec = Recorder()
    bufs = ShmDeviceBuffers.create(SPEC, 4 * 8, shm, prefix="fence")
    cfg = EngineConfig(target=target, reconnect_interval_s=0.1, rpc_timeout_s=1.0)
    lk = DaemonLink(cfg, SPEC, Handover(bufs.descriptors, fds=bufs.fds), "fence-worker",
                    on_fenced=lambda sid: rec.add("fenced", sid), create_pool=False)
    assert lk.start()
    yield lk, rec
    lk.close()
    bufs.close()


def _on_link_thread(link: DaemonLink) -> bool:
    return threading.current_thread() is link._thread


def _wait(cond: Any, seconds: float = 10.0, what: str = "") -> None:
    end = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < end, what or "timed out"
        time.sleep(0.01)


def test_a_heartbeat_asked_before_a_load_timed_out_does_not_fence_it(
        linked: tuple[DaemonLink, Recorder]) -> None:
    """The late link's probe sends its heartbeat; the daemon answers "no load in flight";
    before the link acts on it, a load on the session times out (the scheduler withholds its
    slots). That answer predates the load: the fence must wait for a heartbeat sent after."""
    link, rec = linked
    session, client = link.session, link._state.client
    assert session is not None and client is not None
    sid = session.session_id
    answered, go = threading.Event(), threading.Event()
    real = client.heartbeat

    def heartbeat(session_id: str, **kw: Any) -> Any:
        if not _on_link_thread(link) or session_id != sid:
            return real(session_id, **kw)
        rec.add("heartbeat sent", sid)
        got = real(session_id, **kw)
        if not answered.is_set():
            answered.set()
            go.wait(10)  # the link has its answer and has not acted on it yet
        return got

    client.heartbeat = heartbeat  # type: ignore[method-assign]
    try:
        assert link.report(DeadlinePassed("a lookup was slow"), session=session)  # late
        assert answered.wait(10)
        link.suspect(sid, then=lambda: rec.add("withheld", sid))  # a load timed out
        go.set()
        _wait(lambda: link.usable and not link.suspects, what="never fenced")
    finally:
        go.set()
        client.heartbeat = real  # type: ignore[method-assign]
    seen = rec.of(sid)
    assert seen.count("withheld") == 1 and seen[-1] == "fenced", seen
    withheld = seen.index("withheld")
    assert "heartbeat sent" in seen[withheld:], (
        f"fenced on a heartbeat sent before the load timed out: {seen}")
    assert "fenced" not in seen[:withheld], seen


def test_a_suspicion_recorded_while_a_fence_is_given_outlives_it(
        linked: tuple[DaemonLink, Recorder]) -> None:
    """The link's thread is inside ``on_fenced`` (giving slots back) when another load on
    the same session times out: its ``then`` (withholding) waits for that fence to end, and
    its suspicion stays owed after it, not swallowed by the fence in progress."""
    link, rec = linked
    session = link.session
    assert session is not None
    sid = session.session_id
    inside, out = threading.Event(), threading.Event()

    def on_fenced(s: str) -> None:
        rec.add("fence begins", s)
        inside.set()
        out.wait(10)
        rec.add("fenced", s)

    link._on_fenced = on_fenced
    link.suspect(sid, then=lambda: rec.add("withheld", sid))
    # (the link is up, not late: its thread fences nothing of its own session by itself)
    try:
        fencer = threading.Thread(target=link._fence, args=(sid, None))
        fencer.start()
        assert inside.wait(10)
        second = threading.Thread(
            target=link.suspect, args=(sid,),
            kwargs={"then": lambda: rec.add("withheld again", sid)})
        second.start()
        time.sleep(0.3)
        assert "withheld again" not in rec.of(sid), "then ran inside a fence being given"
        out.set()
        fencer.join(10)
        second.join(10)
        assert rec.of(sid) == ["withheld", "fence begins", "fenced", "withheld again"]
        assert link.suspects == 1, "the fence in progress swallowed a newer suspicion"
        assert not link.fenced(sid, 0.2)
    finally:
        out.set()


def test_a_dropped_session_is_fenced_by_the_daemons_gone_to_its_close(
        served: tuple[HiCacheServer, str, str], linked: tuple[DaemonLink, Recorder]) -> None:
    """A load timed out on the link's session, then the link dropped it (an unreachable
    moment) while the daemon keeps it: the link closes it and fences it once the daemon says
    it is gone; it does not heartbeat it (which would keep it alive for another lease)."""
    server, target, _ = served
    link, rec = linked
    session, client = link.session, link._state.client
    assert session is not None and client is not None
    sid = session.session_id
    beats: list[str] = []
    real = client.heartbeat

    def heartbeat(session_id: str, **kw: Any) -> Any:
        if _on_link_thread(link):
            beats.append(session_id)
        return real(session_id, **kw)

    client.heartbeat = heartbeat  # type: ignore[method-assign]
    try:
        link.suspect(sid, then=lambda: rec.add("withheld", sid))
        assert link.report(Unavailable("a moment unreachable"), session=session)
        _wait(lambda: link.usable and not link.suspects, what="the dropped one never fenced")
    finally:
        client.heartbeat = real  # type: ignore[method-assign]
    assert rec.of(sid) == ["withheld", "fenced"]
    assert sid not in beats, "the link renewed the lease of a session it dropped"
    assert session.public_id not in {s.public_id for s in server.daemon.sessions.list()}
    with HiCacheClient(target) as c:  # the new session is the link's, and alive
        assert [s.worker_id for s in c.list_sessions(SPEC.name)] == ["fence-worker"]


def test_no_daemon_listening_fences_only_after_a_while(
        served: tuple[HiCacheServer, str, str], linked: tuple[DaemonLink, Recorder],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon stops (its sockets close) with a suspected session: the fence waits
    ``UNREACHABLE_FENCE_S`` of no daemon without a break (a draining daemon may still be
    ending copies after its sockets closed), then is given."""
    monkeypatch.setattr(link_module, "UNREACHABLE_FENCE_S", 1.5)
    server, _, _ = served
    link, rec = linked
    session = link.session
    assert session is not None
    sid = session.session_id
    link.suspect(sid, then=lambda: rec.add("withheld", sid))
    server.drain_and_stop(0.1)
    t0 = time.monotonic()
    assert link.report(DeadlinePassed("the load timed out"), session=session)  # late
    _wait(lambda: not link.up, what="the link never noticed")
    time.sleep(max(0.0, t0 + 1.0 - time.monotonic()))
    assert rec.of(sid) == ["withheld"], "fenced at once: no daemon is not yet no copy"
    assert link.suspects == 1
    _wait(lambda: not link.suspects, 10, "never fenced with no daemon for long")
    assert time.monotonic() - t0 >= 1.5
    assert rec.of(sid) == ["withheld", "fenced"]
