"""Per-call counts without a lock on the call's path: each thread adds into its own rows, a
scrape sums them.

prometheus_client's counters and histograms take a lock per value on every ``inc`` and
``observe``: a data call that counts itself (its method and code, its duration, its bytes,
pages and duration per pool) pays 3-4 us for it, a few per cent of a 1-page call. Here a call's
thread finds its own row for a label tuple (one dict lookup) and adds to it in place; only
that thread writes the row, so nothing is lost and nothing is locked. A thread's table is
registered once; a scrape sums every table, and the tables of threads that ended are folded
into one retired table (they write no more) at each scrape and whenever a new thread
registers, so a daemon whose workers reconnect for weeks keeps one table per live thread,
scraped or not.

Primitives:

- ``Tally(width)``: ``row(key)`` (this thread's row: a list of ``width`` numbers to add to),
  ``totals()`` (key -> the rows of every thread, summed), ``forget(which)`` (keys no one
  counts again: a deleted pool's), ``live_tables``, ``keys``.
- ``HistogramColumns(bounds)``: the columns of a duration histogram in a row: ``observe(row, at,
  value)`` adds a sample into ``row[at:at + width]``, ``render(family, labels, values)``
  adds it, cumulative, to a ``HistogramMetricFamily``.
- ``add_into(into, rows)``: ``rows`` summed into ``into``, column by column (a new key's row
  copied).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from hicache.locks import lock

Row = list[float]
K = TypeVar("K", bound=Hashable)


class Tally(Generic[K]):
    def __init__(self, width: int) -> None:
        """``width``: the numbers in a row (what one key counts)."""
        self.width = width
        self._local = threading.local()
        self._lock = lock("tallies")  # the table list, a table's new rows, the retired rows
        self._tables: list[tuple[threading.Thread, dict[K, Row]]] = []
        self._retired: dict[K, Row] = {}

    def row(self, key: K) -> Row:
        """This thread's row for ``key``: add to its numbers in place (no other thread writes
        it)."""
        try:
            return self._local.rows[key]  # type: ignore[no-any-return]
        except (AttributeError, KeyError):
            return self._new_row(key)

    def _new_row(self, key: K) -> Row:
        rows: dict[K, Row] | None = getattr(self._local, "rows", None)
        with self._lock:
            if rows is None:
                self._fold_ended()
                rows = self._local.rows = {}
                self._tables.append((threading.current_thread(), rows))
            got = rows[key] = [0.0] * self.width
        return got

    @property
    def live_tables(self) -> int:
        """Tables kept per thread (those of threads that ended are folded at the next
        ``totals``)."""
        return len(self._tables)

    @property
    def keys(self) -> int:
        """Distinct keys kept, over every table."""
        with self._lock:
            return len({k for _, rows in self._tables for k in rows} | set(self._retired))

    def _fold_ended(self) -> None:
        """Fold the tables of threads that ended into the retired one (under the lock)."""
        live = []
        for thread, rows in self._tables:
            if thread.is_alive():
                live.append((thread, rows))
            else:  # it writes no more: fold it in once
                add_into(self._retired, rows)
        self._tables = live

    def totals(self) -> dict[K, Row]:
        """Every key's row summed over all threads (a copy)."""
        with self._lock:
            self._fold_ended()
            out = {key: list(row) for key, row in self._retired.items()}
            for _, rows in self._tables:
                add_into(out, rows)
        return out

    def forget(self, which: Callable[[K], bool]) -> None:
        """Drop every key ``which`` names from every table (what its thread adds to a row it
        still has in hand afterwards is lost: the key is counted no more)."""
        with self._lock:
            for rows in [r for _, r in self._tables] + [self._retired]:
                for key in [k for k in list(rows) if which(k)]:
                    rows.pop(key, None)


def add_into(into: dict[K, Row], rows: dict[K, Row]) -> None:
    """``rows`` summed into ``into``, column by column (a new key's row copied)."""
    for key, row in list(rows.items()):  # a table's new rows are added under the lock
        got = into.get(key)
        if got is None:
            into[key] = list(row)
        else:
            for i, v in enumerate(row):
                got[i] += v


class HistogramColumns:
    """A duration histogram's columns: count, sum, then one per bucket (the last one above
    every bound, ``+Inf``), as Prometheus buckets them (a sample falls in the first bucket
    whose bound is at or above it)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.width = 2 + len(self.bounds) + 1

    def observe(self, row: Row, at: int, value: float) -> None:
        row[at] += 1
        row[at + 1] += value
        row[at + 2 + bisect.bisect_left(self.bounds, value)] += 1

    def render(self, family: HistogramMetricFamily, labels: Sequence[str], row: Row,
               at: int) -> None:
        counts = row[at + 2:at + self.width]
        cumulative, buckets = 0.0, []
        for bound, n in zip((*(floatToGoString(b) for b in self.bounds), "+Inf"), counts,
                            strict=True):
            cumulative += n
            buckets.append((bound, cumulative))
        family.add_metric(list(labels), buckets, row[at + 1])

