from __future__ import annotations

import pytest

from hicache.errors import SessionNotFound
from hicached.core.worker_buffers import WorkerBuffers
from hicached.service.sessions import SessionManager
from hicached.transport.base import Attachment
from tests.helpers import make_pool, mha, spec


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class CountingAttachment(Attachment):
    def __init__(self) -> None:
        super().__init__(WorkerBuffers({}), [], 123)
        self.releases = 0

    def release(self) -> None:
        self.releases += 1
        super().release()


@pytest.fixture
def setup():  # type: ignore[no-untyped-def]
    pool = make_pool(spec(mha()))
    clock = Clock()
    reaped: list[str] = []
    m = SessionManager(2.0, clock=clock, on_reap=lambda s: reaped.append(s.session_id))
    yield pool, clock, m, reaped
    pool.close()


def test_lease_expiry_reaps_and_releases(setup) -> None:  # type: ignore[no-untyped-def]
    pool, clock, m, reaped = setup
    att = CountingAttachment()
    s = m.open("p", pool, "w", att, 16)
    clock.t = 1.5
    m.heartbeat(s.session_id)
    clock.t = 3.0
    assert m.reap() == []
    clock.t = 3.6
    assert [x.session_id for x in m.reap()] == [s.session_id] == reaped
    assert att.releases == 1 and m.reaped_total == 1
    with pytest.raises(SessionNotFound):
        m.get(s.session_id)


def test_mappings_outlive_an_in_flight_transfer(setup) -> None:  # type: ignore[no-untyped-def]
    pool, _clock, m, _ = setup
    att = CountingAttachment()
    s = m.open("p", pool, "w", att, 16)
    with m.transfer(s.session_id):
        m.close(s.session_id)
        assert att.releases == 0, "released under a running copy"
    assert att.releases == 1
    with pytest.raises(SessionNotFound):
        with m.transfer(s.session_id):
            pass


def test_transfers_renew_the_lease(setup) -> None:  # type: ignore[no-untyped-def]
    pool, clock, m, _ = setup
    s = m.open("p", pool, "w", CountingAttachment(), 16)
    clock.t = 1.9
    with m.transfer(s.session_id):
        pass
    clock.t = 3.5
    assert m.reap() == []
    assert m.count("p") == 1 and m.count("other") == 0


def test_close_all(setup) -> None:  # type: ignore[no-untyped-def]
    pool, _clock, m, _ = setup
    atts = [CountingAttachment() for _ in range(3)]
    for a in atts:
        m.open("p", pool, "w", a, 16)
    m.close_all()
    assert [a.releases for a in atts] == [1, 1, 1] and m.count() == 0


def test_a_lease_above_the_maximum_is_clamped_and_reaped_in_time() -> None:
    pool = make_pool(spec(mha()))
    try:
        clock = Clock()
        m = SessionManager(2.0, clock=clock, max_lease_seconds=10.0)
        greedy = m.open("p", pool, "w", CountingAttachment(), 16, lease_seconds=86400.0)
        modest = m.open("p", pool, "w", CountingAttachment(), 16, lease_seconds=8.0)
        assert (greedy.lease_seconds, greedy.lease_clamped) == (10.0, True)
        assert (modest.lease_seconds, modest.lease_clamped) == (8.0, False)
        clock.t = 10.5  # a dead worker's mappings go within the maximum, not a day later
        assert {s.session_id for s in m.reap()} == {greedy.session_id, modest.session_id}
    finally:
        pool.close()


def test_the_reaper_sleeps_while_no_session_is_open(setup) -> None:  # type: ignore[no-untyped-def]
    """An idle daemon's reaper costs nothing: it runs only while a session is open."""
    import threading

    pool, clock, m, reaped = setup
    passes: list[int] = []
    ran = threading.Event()
    real_reap = m.reap

    def counting_reap():  # type: ignore[no-untyped-def]
        passes.append(1)
        ran.set()
        return real_reap()

    m.reap = counting_reap  # type: ignore[method-assign]
    m.start_reaper(interval=0.005)
    try:
        assert not ran.wait(0.3) and not passes  # 60 periods without a session: no pass
        s = m.open("p", pool, "w", CountingAttachment(), 16)
        assert ran.wait(5)  # a session: the reaper runs, and reaps it when its lease ends
        clock.t = 10.0
        for _ in range(500):
            if reaped:
                break
            ran.clear()
            ran.wait(0.05)
        assert reaped == [s.session_id]
    finally:
        m.close_all()


@pytest.mark.parametrize("how", ["closed", "reaped"])
def test_an_end_is_told_only_once_no_copy_of_the_session_runs(setup, how: str) -> None:  # type: ignore[no-untyped-def]
    """A session ends (closed, or its lease ran out) while a copy of it runs: until that copy
    ends every call naming it hears SESSION_ENDING (retry), never SESSION_NOT_FOUND, which a
    worker reads as "nothing of it can land any more"; after it, SESSION_NOT_FOUND, and the
    daemon keeps nothing of it."""
    from hicache.errors import SessionEnding

    pool, clock, m, _ = setup
    a = CountingAttachment()
    s = m.open("p", pool, "w", a, 16)
    with m.transfer(s.session_id):  # a copy under way (a load on a paused daemon, resumed)
        if how == "closed":
            m.close(s.session_id)
        else:
            clock.t += 3.0
            m.reap()
        assert m.ending == 1 and a.releases == 0
        for call in (m.get, m.heartbeat, m.close):
            with pytest.raises(SessionEnding) as info:
                call(s.session_id)
            assert info.value.metadata["retry_after_ms"] == "50"
            assert info.value.metadata["session_id"] == s.public_id
        with pytest.raises(SessionEnding):  # no new copy begins on it either
            m.begin_copy(s)
    assert m.ending == 0 and a.releases == 1
    for call in (m.get, m.heartbeat, m.close):
        with pytest.raises(SessionNotFound):
            call(s.session_id)
    with pytest.raises(SessionNotFound):
        m.begin_copy(s)


@pytest.mark.parametrize("how", ["closed", "reaped", "closed_at_shutdown"])
def test_no_call_hears_gone_between_a_sessions_removal_and_its_end(setup, how: str) -> None:  # type: ignore[no-untyped-def]
    """The session leaves the table and stops there, its end not yet settled, while a copy
    of it runs: a call naming it meanwhile hears SESSION_ENDING, not SESSION_NOT_FOUND (the
    worker's fence), and once the copy ends, SESSION_NOT_FOUND."""
    import threading

    from hicache import seams
    from hicache.errors import SessionEnding

    pool, clock, m, _ = setup
    s = m.open("p", pool, "w", CountingAttachment(), 16)
    ends = {"closed": lambda: m.close(s.session_id), "closed_at_shutdown": m.close_all,
            "reaped": m.reap}
    with m.transfer(s.session_id):
        if how == "reaped":
            clock.t += 3.0
        with seams.Pause("session.removed") as stop:
            ender = threading.Thread(target=ends[how])
            ender.start()
            assert stop.wait_reached(5)
            for call in (m.get, m.heartbeat, m.close):
                with pytest.raises(SessionEnding):
                    call(s.session_id)
            stop.release()
            ender.join(5)
    with pytest.raises(SessionNotFound):
        m.heartbeat(s.session_id)


def test_sessions_that_end_quietly_leave_no_ending_books(setup) -> None:  # type: ignore[no-untyped-def]
    pool, _, m, _ = setup
    for _ in range(1000):
        s = m.open("p", pool, "w", CountingAttachment(), 16)
        with m.transfer(s.session_id):
            pass
        m.close(s.session_id)
    assert m.ending == 0 and m.count() == 0
