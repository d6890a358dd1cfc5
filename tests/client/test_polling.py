"""The fast path's poll-before-sleep: the native wait and the adaptive window."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache import polling
from hicache.polling import GROW_START_NS, PROBE_FIRST, PROBE_MAX, AdaptivePoll


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected pair; meanwhile waits poll however busy the machine running the tests is
    (the busy check has a test of its own)."""
    a, b = socket.socketpair()
    before = _native().set_busy_check(False)
    yield a, b
    _native().set_busy_check(before)
    a.close()
    b.close()


def _native():  # type: ignore[no-untyped-def]
    assert polling.native_available(), "hicache._poll is built with the package"
    from hicache import _poll  # type: ignore[attr-defined]

    return _poll


def test_the_native_wait_sees_bytes_times_out_and_sees_a_close(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    wait = _native().wait_readable
    t0 = time.monotonic()
    assert wait(a.fileno(), 20_000_000) == 0  # nothing within 20 ms
    assert time.monotonic() - t0 >= 0.019
    b.sendall(b"x")
    t0 = time.monotonic()
    assert wait(a.fileno(), 5_000_000_000) == 1
    assert time.monotonic() - t0 < 1.0  # at once, not after the window
    assert a.recv(1) == b"x"
    b.close()
    assert wait(a.fileno(), 5_000_000_000) == 1  # a closed peer is readable: recv says EOF
    assert a.recv(1) == b""


def test_the_wait_releases_the_interpreter_lock(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """While one thread polls for 300 ms, another runs Python all along."""
    a, _ = pair
    wait = _native().wait_readable
    counts = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            counts[0] += 1

    t = threading.Thread(target=count)
    t.start()
    time.sleep(0.05)
    before = counts[0]
    wait(a.fileno(), 300_000_000)
    during = counts[0] - before
    stop.set()
    t.join()
    assert during > 100_000, during  # holding the lock, the counter would stand still


@contextmanager
def _one_slot_taken(pair: tuple[socket.socket, socket.socket]) -> Iterator[list[int]]:
    """One poller allowed, its slot taken by a thread polling ``a`` for up to 3 s; on exit
    ``b`` writes, the thread returns what its wait said (into the yielded list)."""
    a, b = pair
    native = _native()
    previous = native.set_max_pollers(1)
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(native.wait_readable(a.fileno(),
                                                                        3_000_000_000)))
    t.start()
    deadline = time.monotonic() + 10
    while native.wait_readable(b.fileno(), 0) != -1:  # until the thread holds the slot (a
        assert time.monotonic() < deadline  # 0 ns probe polls nothing when it is free)
        time.sleep(0.001)
    try:
        yield got
    finally:
        b.sendall(b"x")
        t.join()
        native.set_max_pollers(previous)


def test_no_more_threads_poll_at_once_than_the_limit(
        pair: tuple[socket.socket, socket.socket]) -> None:
    native = _native()
    b = pair[1]
    with _one_slot_taken(pair) as got:
        t0 = time.monotonic()
        assert native.wait_readable(b.fileno(), 1_000_000_000) == -1  # not polled: sleep
        assert time.monotonic() - t0 < 0.5
    assert got == [1]
    assert native.wait_readable(b.fileno(), 1_000_000) == 0  # the slot is free again
    with pytest.raises(ValueError):
        native.set_max_pollers(-1)


def _child_polls(fd: int, out: Any) -> None:
    from hicache import _poll  # type: ignore[attr-defined]

    out.put(_poll.wait_readable(fd, 1_000_000))


def test_a_child_forked_while_a_thread_polls_can_poll(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """The parent's polling thread does not exist in the child: its slot is free there."""
    import multiprocessing as mp

    b = pair[1]
    with _one_slot_taken(pair):
        assert _native().wait_readable(b.fileno(), 1_000_000) == -1  # the one slot is taken
        ctx = mp.get_context("fork")
        out = ctx.SimpleQueue()
        child = ctx.Process(target=_child_polls, args=(b.fileno(), out))
        child.start()
        child.join(10)
        assert out.get() == 0  # polled its 1 ms and found nothing


def _spin_until(stop: float) -> None:
    while time.monotonic() < stop:
        pass


def test_nothing_polls_while_the_node_has_more_runnable_threads_than_cpus() -> None:
    """With one busy process per CPU and one more, a wait does not poll (-2) and sleeps at
    once; when they are gone it polls again."""
    import multiprocessing as mp
    import os

    native = _native()
    a, b = socket.socketpair()
    try:
        native.set_busy_check(True)
        n = len(os.sched_getaffinity(0)) + 1
        ctx = mp.get_context("fork")
        procs = [ctx.Process(target=_spin_until, args=(time.monotonic() + 3.0,))
                 for _ in range(n)]
        for p in procs:
            p.start()
        skipped_in = None
        deadline = time.monotonic() + 2.5
        while skipped_in is None and time.monotonic() < deadline:
            t0 = time.monotonic()
            if native.wait_readable(a.fileno(), 50_000_000) == -2:
                skipped_in = time.monotonic() - t0
            time.sleep(0.002)  # past the once-a-millisecond reading
        for p in procs:
            p.join()
        assert skipped_in is not None and skipped_in < 0.04  # skipped, not a 50 ms poll
        deadline = time.monotonic() + 5
        while native.wait_readable(a.fileno(), 1_000_000) != 0:  # polls again (once the
            assert time.monotonic() < deadline  # machine running the tests is not busy)
            time.sleep(0.002)
    finally:
        a.close()
        b.close()


def test_the_limit_is_a_quarter_of_the_cpus() -> None:
    import os
    assert polling.max_pollers() == max(1, len(os.sched_getaffinity(0)) // 4)


def test_the_window_grows_on_short_waits_and_falls_to_zero_on_long_ones() -> None:
    p = AdaptivePoll(200)
    assert p.window_ns == 0
    p.learn(30_000, caught=False)  # short: a window would have caught it
    assert p.window_ns == GROW_START_NS
    p.learn(120_000, caught=False)
    assert p.window_ns == 2 * GROW_START_NS
    p.learn(150_000, caught=False)
    assert p.window_ns == 200_000  # capped at max
    p.learn(10_000, caught=True)  # caught: the window was right
    assert p.window_ns == 200_000
    p.learn(5_000_000, caught=False)  # an idle gap: shrink
    assert p.window_ns == 100_000
    p.learn(5_000_000, caught=False)
    assert p.window_ns == 50_000
    p.learn(5_000_000, caught=False)
    assert p.window_ns == 0
    off = AdaptivePoll(0)
    off.learn(10_000, caught=False)
    assert off.window_ns == 0


@given(st.integers(0, 1000), st.lists(st.tuples(st.integers(0, 10_000_000), st.booleans()),
                                      max_size=60))
def test_the_window_stays_within_its_bounds(max_us: int,
                                            waits: list[tuple[int, bool]]) -> None:
    """Whatever the waits: 0 or between the grow start (or the max, if smaller) and the max;
    a wait longer than the max never grows it, a caught one never changes it."""
    p = AdaptivePoll(max_us)
    for waited, caught in waits:
        before = p.window_ns
        p.learn(waited, caught)
        w = p.window_ns
        assert w == 0 or min(GROW_START_NS, p.max_ns) <= w <= p.max_ns
        if caught or waited > p.max_ns:
            assert w <= before


class _FakeWait:
    """The native wait, scripted: ``catch(window_ns)`` says whether the bytes come within it."""

    def __init__(self, catch: Any) -> None:
        self.catch = catch
        self.windows: list[int] = []

    def __call__(self, fd: int, window_ns: int) -> int:
        self.windows.append(window_ns)
        return 1 if self.catch(window_ns) else 0


def _scripted(max_us: int, catch: Any) -> tuple[AdaptivePoll, _FakeWait]:
    p = AdaptivePoll(max_us)
    fake = _FakeWait(catch)
    p._wait = fake  # type: ignore[assignment]
    return p, fake


def test_a_window_at_zero_probes_and_opens_when_the_probe_catches() -> None:
    """Replies a poll catches in 130 us but that take 300 us when slept for (the wake-up):
    slept waits alone never grow the window, so it probes with the largest window, and a
    caught probe opens it; from then on every wait polls and catches."""
    p, fake = _scripted(200, lambda window: window >= 130_000)
    for _ in range(PROBE_FIRST - 1):
        assert p.wait(0) is False
        p.learn(300_000, caught=False)
    assert fake.windows == [] and p.window_ns == 0
    assert p.wait(0) is True
    assert fake.windows == [200_000]
    p.learn(130_000, caught=True)
    assert p.window_ns == 200_000 and p.probes == 1
    for _ in range(50):
        assert p.wait(0) is True
        p.learn(130_000, caught=True)
    assert p.window_ns == 200_000 and (p.polls, p.caught, p.probes) == (51, 51, 1)


def test_an_idle_connection_probes_ever_less_often() -> None:
    """Bytes that never come within a window: the gap between probes doubles up to PROBE_MAX,
    so 100,000 idle waits spend a handful of windows, and the window stays shut."""
    p, fake = _scripted(200, lambda window: False)
    n = 100_000
    for _ in range(n):
        assert p.wait(0) is False
        p.learn(5_000_000, caught=False)
    assert p.window_ns == 0 and set(fake.windows) == {200_000}
    gaps: list[int] = []
    gap = PROBE_FIRST
    while sum(gaps) + gap <= n:
        gaps.append(gap)
        gap = min(PROBE_MAX, 2 * gap)
    assert p.probes == len(fake.windows) == len(gaps)
    assert p.probes < 8 + n // PROBE_MAX + 1


def test_a_probe_the_node_is_too_busy_for_does_not_poll() -> None:
    p = AdaptivePoll(200)
    calls: list[int] = []

    def busy(fd: int, window_ns: int) -> int:
        calls.append(window_ns)
        return -2

    p._wait = busy  # type: ignore[assignment]
    for _ in range(3 * PROBE_FIRST):
        assert p.wait(0) is False
        p.learn(300_000, caught=False)
    assert len(calls) == 3 and (p.polls, p.probes, p.window_ns) == (0, 0, 0)
    assert p.busy == 3


@given(st.integers(1, 1000), st.lists(st.tuples(st.integers(0, 10_000_000), st.booleans()),
                                      max_size=400))
def test_a_shut_window_probes_neither_more_often_than_the_first_gap_nor_less_than_the_last(
        max_us: int, waits: list[tuple[int, bool]]) -> None:
    """Whatever the bytes do, the window stays within its bounds, and a window at 0 polls
    after no fewer than PROBE_FIRST - 1 and no more than PROBE_MAX - 1 waits without."""
    catches = [False]
    p = AdaptivePoll(max_us)
    p._wait = lambda fd, window_ns: 1 if catches[0] else 0  # type: ignore[assignment]
    shut_run = 0  # waits in a row that found the window at 0 and did not poll
    for waited, catch in waits:
        catches[0] = catch
        shut, polls = p.window_ns == 0, p.polls
        caught = p.wait(0)
        if not shut:
            shut_run = 0
        elif p.polls > polls:
            assert PROBE_FIRST - 1 <= shut_run <= PROBE_MAX - 1
            shut_run = 0
        else:
            shut_run += 1
            assert shut_run <= PROBE_MAX - 1
        p.learn(min(waited, p.max_ns) if caught else waited, caught)
        w = p.window_ns
        assert w == 0 or min(GROW_START_NS, p.max_ns) <= w <= p.max_ns


def test_a_frame_socket_polls_frames_that_come_soon_and_sleeps_after_a_gap(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """The first frame opens the window; the next ones are caught by the poll; a frame that
    comes long after shrinks it; a reader with no window never polls."""
    from hicache import fast_wire as w

    a, b = pair
    frames = w.FrameSocket(a, 200)
    p = frames.poll
    sent = 0

    def one() -> None:
        nonlocal sent
        b.sendall(w.REPLY.pack(3, sent, w.OK) + b"abc")
        assert frames.read(w.REPLY) == ((3, sent, w.OK), b"abc")
        sent += 1

    # the first frame opens the window; on a loaded machine, the first whose wait the
    # scheduler did not stretch past the largest window (such a wait leaves it shut)
    while not p.window_ns:
        assert sent < PROBE_FIRST - 1, "no wait opened the window"
        one()
    assert p.polls == 0
    for _ in range(5):
        one()
    assert p.window_ns == GROW_START_NS and (p.polls, p.caught) == (5, 5)
    threading.Timer(0.05, lambda: b.sendall(w.REPLY.pack(0, 9, w.OK))).start()
    assert frames.read(w.REPLY) == ((0, 9, w.OK), b"")
    assert p.window_ns == 0 and (p.polls, p.caught) == (6, 5)
    assert GROW_START_NS <= p.polled_ns < 50_000_000  # five quick catches and one window
    still = w.FrameSocket(a, 0)
    for i in range(3):
        b.sendall(w.REPLY.pack(0, i, w.OK))
        assert still.read(w.REPLY)[0][1] == i
    assert (still.poll.polls, still.poll.window_ns) == (0, 0)
