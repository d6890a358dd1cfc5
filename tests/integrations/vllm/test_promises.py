"""The vLLM manager's promises over the engine kit's hold book: claims of a load in flight
outlive the request's end and a late answer."""

from __future__ import annotations

import threading
from typing import Any

from hicache_client.hold_book import HoldBook
from hicache_vllm.promises import Promises


class Recorder:
    def __init__(self) -> None:
        self.released: list[list[Any]] = []
        self.lock = threading.Lock()

    def __call__(self, keys: list[Any]) -> None:
        with self.lock:
            self.released.append(keys)


def test_a_late_answer_for_a_finished_request_keeps_the_claims_of_its_load_in_flight() -> None:
    """vLLM's promises: a request finished while its load runs and a lookup it asked is
    answered after that: the late answer's holds go (no one claims them), the load's stay
    until it completes."""
    rec = Recorder()
    book = HoldBook(60_000, rec)
    k1, k2, k3 = b"1" * 32, b"2" * 32, b"3" * 32
    promises = Promises(book, lambda keys: len(keys))  # every key held
    try:
        assert promises.answer("r", k1, lambda: [k1, k2]) is True
        assert promises.answer("r", k3) is None  # asked at the step's end
        promises.loading("r", [k1, k2])
        promises.finished("r")  # its load still runs
        promises.flush()  # the late answer: k3 held for no one
        assert book.settle()
        assert rec.released == [[k3]]
        assert book.claims("r") == {k1, k2}
        promises.loaded("r")
        assert book.settle()
        assert sorted(rec.released[1]) == [k1, k2]
    finally:
        book.close()
