"""The per-thread tallies behind the per-call metrics: exact sums over threads that come and
go, a scrape during writes, and histogram columns that render as prometheus_client's own."""

from __future__ import annotations

import threading

import hypothesis.strategies as st
from hypothesis import given, settings
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import HistogramMetricFamily

from hicached.server.metrics import DURATION_BUCKETS
from hicached.server.tallies import HistogramColumns, Tally


def _add(t: Tally[str], key: str, n: int, start: threading.Barrier | None = None) -> None:
    if start is not None:
        start.wait()
    for _ in range(n):
        row = t.row(key)
        row[0] += 1
        row[1] += 2


def test_rows_of_many_threads_sum_exactly() -> None:
    t: Tally[str] = Tally(2)
    start = threading.Barrier(8)
    threads = [threading.Thread(target=_add, args=(t, f"k{i % 3}", 20_000, start))
               for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    got = t.totals()
    assert got == {"k0": [60_000.0, 120_000.0], "k1": [60_000.0, 120_000.0],
                   "k2": [40_000.0, 80_000.0]}


def test_tables_of_threads_that_ended_fold_into_one_and_keep_their_counts() -> None:
    t: Tally[str] = Tally(2)
    for round_ in range(3):
        for _ in range(50):  # threads that come and go, as fast path connections do
            th = threading.Thread(target=_add, args=(t, "k", 10))
            th.start()
            th.join()
        assert t.totals() == {"k": [500.0 * (round_ + 1), 1000.0 * (round_ + 1)]}
        assert t.live_tables == 0
    _add(t, "k", 1)  # this thread's table stays while it lives
    assert t.totals()["k"] == [1501.0, 3002.0]
    assert t.live_tables == 1


def test_a_thread_that_ends_between_two_scrapes_is_counted_once() -> None:
    t: Tally[str] = Tally(2)
    wrote, go_on = threading.Event(), threading.Event()

    def writer() -> None:
        _add(t, "k", 5)
        wrote.set()
        go_on.wait(10)  # stopped between its writes and its end while a scrape reads
        _add(t, "k", 5)

    th = threading.Thread(target=writer)
    th.start()
    assert wrote.wait(10)
    assert t.totals() == {"k": [5.0, 10.0]}
    go_on.set()
    th.join()
    assert t.totals() == {"k": [10.0, 20.0]}  # folded once, not twice
    assert t.totals() == {"k": [10.0, 20.0]}


def test_scrapes_during_writes_only_ever_grow_and_end_exact() -> None:
    t: Tally[str] = Tally(2)
    stop = threading.Event()
    seen: list[float] = []

    def scrape() -> None:
        while not stop.is_set():
            seen.append(t.totals().get("k", [0.0, 0.0])[0])

    scraper = threading.Thread(target=scrape)
    scraper.start()
    writers = [threading.Thread(target=_add, args=(t, "k", 20_000)) for _ in range(4)]
    for th in writers:
        th.start()
    for th in writers:
        th.join()
    stop.set()
    scraper.join()
    assert seen == sorted(seen)
    assert t.totals()["k"] == [80_000.0, 160_000.0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(DURATION_BUCKETS),  # exactly on a bound
                          st.floats(0, 100, allow_nan=False)), max_size=40))
def test_histogram_columns_render_as_prometheus_client_does(values: list[float]) -> None:
    cols = HistogramColumns(DURATION_BUCKETS)
    row = [0.0] * (3 + cols.width)
    real = Histogram("d", "d", ["m"], buckets=DURATION_BUCKETS, registry=CollectorRegistry())
    child = real.labels("x")
    for v in values:
        cols.observe(row, 3, v)
        child.observe(v)
    ours = HistogramMetricFamily("d", "d", labels=["m"])
    cols.render(ours, ["x"], row, 3)
    want = {(s.name, tuple(sorted(s.labels.items()))): s.value
            for m in real.collect() for s in m.samples if not s.name.endswith("_created")}
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in ours.samples}
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert abs(got[k] - v) <= 1e-9 * max(1.0, abs(v)), k
    assert row[3] == len(values)


def test_threads_that_come_and_go_unscraped_keep_one_table_each_alive() -> None:
    """Nobody scrapes (metrics off): the tables of ended threads still fold, when the next
    thread registers, so their number stays at the threads alive."""
    t: Tally[str] = Tally(2)
    for _ in range(300):
        th = threading.Thread(target=_add, args=(t, "k", 1))
        th.start()
        th.join()
    assert t.live_tables <= 1
    assert t.totals() == {"k": [300.0, 600.0]}


def test_forgotten_keys_go_from_every_table() -> None:
    t: Tally[tuple[str, str]] = Tally(2)

    def add(key: tuple[str, str], n: int) -> None:
        for _ in range(n):
            row = t.row(key)
            row[0] += 1
            row[1] += 2

    th = threading.Thread(target=add, args=(("gone", "load"), 3))
    th.start()
    th.join()
    add(("gone", "backup"), 2)
    add(("kept", "backup"), 1)
    assert t.keys == 3
    t.forget(lambda key: key[0] == "gone")
    assert t.totals() == {("kept", "backup"): [1.0, 2.0]} and t.keys == 1
