"""The engine adapters' one hold book: freshness, claims counted per request, releases of
only what no request claims (never what a load consumed), on one thread, in order."""

from __future__ import annotations

import threading
import time
from typing import Any

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hicache_client.hold_book import FRESH_SHARE, HoldBook


class Recorder:
    def __init__(self) -> None:
        self.released: list[list[Any]] = []
        self.done = threading.Condition()

    def __call__(self, keys: list[Any]) -> None:
        with self.done:
            self.released.append(keys)
            self.done.notify_all()

    def wait(self, n: int) -> list[list[Any]]:
        with self.done:
            assert self.done.wait_for(lambda: len(self.released) >= n, 5)
            return list(self.released)


def test_an_answer_is_trusted_for_the_share_of_its_hold() -> None:
    book = HoldBook(1000, Recorder())
    try:
        assert book.window == FRESH_SHARE
        now = time.monotonic()
        assert book.fresh(now)
        assert not book.fresh(now - FRESH_SHARE - 0.01)
        assert not HoldBook(0, Recorder()).fresh(time.monotonic())  # no holds: never
    finally:
        book.close()


def test_a_key_goes_when_its_last_claim_ends_and_not_before() -> None:
    rec = Recorder()
    book = HoldBook(1000, rec)
    try:
        book.claim("a", ["k1", "k2"])
        book.claim("b", ["k2", "k3"])
        book.claim("a", ["k1"])  # claimed already: still one claim
        assert book.claimed == 3
        assert book.drop("a") == ["k1"]  # k2 is b's too
        assert book.drop("a") == []  # dropped twice: nothing more
        assert sorted(book.drop("b")) == ["k2", "k3"]
        assert [sorted(r) for r in rec.wait(2)] == [["k1"], ["k2", "k3"]]
        assert book.claimed == 0
    finally:
        book.close()


def test_keys_a_load_consumed_are_not_released() -> None:
    rec = Recorder()
    book = HoldBook(1000, rec)
    try:
        book.claim("a", ["k1", "k2", "k3"])
        assert book.drop("a", consumed={"k1", "k2"}) == ["k3"]
        assert rec.wait(1) == [["k3"]]
    finally:
        book.close()


def test_drop_all_keeps_the_claims_of_loads_in_flight_and_releases_nothing_itself() -> None:
    rec = Recorder()
    book = HoldBook(1000, rec)
    try:
        book.claim("loading", ["k1", "k2"])
        book.claim("idle", ["k2", "k3"])
        assert book.drop_all(lambda req: req == "loading") == ["k3"]
        assert book.claims("loading") == {"k1", "k2"} and book.claims("idle") == set()
        book.close()
        assert rec.released == []
    finally:
        book.close()


def test_releases_never_wait_on_the_callers_thread_and_keep_their_order() -> None:
    """The release thread is stopped inside a slow release while the caller goes on: claims
    and drops return at once, the releases queued behind it follow in order."""
    entered, go_on = threading.Event(), threading.Event()
    released: list[list[str]] = []

    def slow(keys: list[str]) -> None:
        entered.set()
        go_on.wait(5)
        released.append(keys)

    book = HoldBook(1000, slow)
    try:
        book.claim("a", ["k1"])
        book.drop("a")
        assert entered.wait(5)
        t0 = time.monotonic()
        for i in range(2, 5):
            book.claim(f"r{i}", [f"k{i}"])
            book.drop(f"r{i}")
        assert time.monotonic() - t0 < 0.5  # the caller never waited for the daemon
        go_on.set()
        book.close()
        assert released == [["k1"], ["k2"], ["k3"], ["k4"]]
    finally:
        go_on.set()
        book.close()


def test_a_failing_release_does_not_stop_the_next_and_other_hows_run_there_too() -> None:
    rec = Recorder()
    calls: list[str] = []

    def broken(keys: list[str]) -> None:
        calls.append(threading.current_thread().name)
        raise RuntimeError("daemon gone")

    book = HoldBook(1000, rec, name="holds-under-test")
    try:
        book.release(["x"], broken)
        book.release(["y"])
        assert rec.wait(1) == [["y"]]
        assert calls == ["holds-under-test"]
    finally:
        book.close()


def test_later_runs_on_the_release_thread_in_order_and_survives_a_failure() -> None:
    """``later`` (vLLM's touches) runs after what was queued before it, on the release
    thread; one that raises leaves the thread serving."""
    rec = Recorder()
    order: list[str] = []

    def boom() -> None:
        order.append(threading.current_thread().name)
        raise RuntimeError("daemon gone")

    book = HoldBook(1000, rec, name="holds-under-test")
    try:
        book.release(["a"], lambda keys: order.append("release"))
        book.later(boom)
        book.later(lambda: order.append("touch"))
        book.release(["b"])
        assert rec.wait(1) == [["b"]]
        assert order == ["release", "holds-under-test", "touch"]
    finally:
        book.close()


class BookModel(RuleBasedStateMachine):
    """Claims, drops and drop_all in any order against a multiset of claims: what is released
    is exactly what loses its last claim and was not consumed, once."""

    def __init__(self) -> None:
        super().__init__()
        self.rec = Recorder()
        self.book = HoldBook(1000, self.rec)
        self.model: dict[str, set[str]] = {}
        self.expected: list[str] = []

    def _claimed(self) -> set[str]:
        return {k for ks in self.model.values() for k in ks}

    @rule(req=st.sampled_from("abcd"), keys=st.lists(st.sampled_from("uvwxyz"), max_size=4))
    def claim(self, req: str, keys: list[str]) -> None:
        self.book.claim(req, keys)
        self.model.setdefault(req, set()).update(keys)

    @rule(req=st.sampled_from("abcd"), consumed=st.sets(st.sampled_from("uvwxyz")))
    def drop(self, req: str, consumed: set[str]) -> None:
        mine = self.model.pop(req, set())
        free = mine - self._claimed()
        got = self.book.drop(req, consumed)
        assert sorted(got) == sorted(free - consumed)
        self.expected.extend(got)

    @rule(keys=st.lists(st.sampled_from("uvwxyz"), max_size=4))
    def let_go(self, keys: list[str]) -> None:
        got = self.book.let_go(keys)
        assert sorted(got) == sorted(set(keys) - self._claimed())
        self.expected.extend(got)

    @rule(keep=st.sets(st.sampled_from("abcd")))
    def drop_all(self, keep: set[str]) -> None:
        before = self._claimed()
        self.model = {r: ks for r, ks in self.model.items() if r in keep}
        got = self.book.drop_all(keep.__contains__)
        assert sorted(got) == sorted(before - self._claimed())

    @invariant()
    def same_claims(self) -> None:
        assert self.book.claimed == len(self._claimed())
        for req in "abcd":
            assert self.book.claims(req) == self.model.get(req, set())

    def teardown(self) -> None:
        self.book.close()
        assert sorted(k for r in self.rec.released for k in r) == sorted(self.expected)


TestBookModel = BookModel.TestCase
TestBookModel.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
