"""``tiers.prefetch.Prefetcher``: the disk keeps a promise's keys until they are held in host
memory, or until the promise's deadline when the hold after the promotion took fewer (a Store
evicted a promoted key before it was held): the session's LoadKeys then promotes it again from
a disk that still has it. Driven with stand-in promote / hold calls and a hand-moved clock."""

from __future__ import annotations

import threading
import time

from hicached.cache.holds import Holder
from hicached.tiers.prefetch import Prefetcher


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def wait(condition, seconds: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_keys_held_after_the_promotion_are_released_below_at_once() -> None:
    released = threading.Event()
    p = Prefetcher(lambda keys: len(keys), lambda holder, keys: len(keys), "t", Clock())
    try:
        assert p.submit([b"a", b"b"], Holder(1, 30.0), released.set)
        assert released.wait(5) and p.done == 1 and p.deferred == 0
    finally:
        p.close()


def test_a_key_evicted_before_its_hold_stays_below_until_the_promise_ends() -> None:
    clock, released = Clock(), threading.Event()
    # the promotion lands both keys; a Store evicts the second before the hold: one is held
    p = Prefetcher(lambda keys: len(keys), lambda holder, keys: 1, "t", clock)
    try:
        assert p.submit([b"a", b"b"], Holder(1, 30.0), released.set)
        wait(lambda: p.done == 1)
        assert p.deferred == 1
        assert not released.wait(0.2)  # the disk still keeps b for the session's load
        clock.now += 29.0
        p.submit([], Holder(2, 0.0), lambda: None)  # wakes the thread: not yet due
        assert not released.wait(0.2)
        clock.now += 1.0
        p.submit([], Holder(2, 0.0), lambda: None)
        assert released.wait(5)  # the promise ended: released below
    finally:
        p.close()


def test_a_failed_promotion_keeps_its_keys_below_and_close_releases_what_is_due() -> None:
    released = threading.Event()

    def fail(keys):  # type: ignore[no-untyped-def]
        raise OSError("disk read failed")

    p = Prefetcher(fail, lambda holder, keys: 0, "t", Clock())
    assert p.submit([b"a"], Holder(1, 30.0), released.set)
    wait(lambda: p.deferred == 1)
    assert not released.is_set()
    p.close()  # the daemon stops keeping promises: every release runs
    assert released.is_set()
