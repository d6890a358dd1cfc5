"""Log lines rate-limited per reason: a flood writes one line per interval, and the next line
says how many were held back."""

from __future__ import annotations

import logging

import pytest

from hicache.log_limit import LimitedLog


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_writes_one_line_per_interval_per_reason(caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    clock = Clock()
    limited = LimitedLog(logging.getLogger("test.limited"), 10.0, clock)
    with caplog.at_level(logging.INFO, "test.limited"):
        written = [limited.warning("disk full: %s", i, key="ENOSPC") for i in range(1000)]
        assert limited.info("another reason", key="OTHER")  # reasons are apart
        assert written.count(True) == 1 and limited.suppressed("ENOSPC") == 999
        clock.now += 9.9
        assert not limited.warning("disk full: %s", "late", key="ENOSPC")
        clock.now += 0.2
        assert limited.warning("disk full: %s", "again", key="ENOSPC")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["disk full: 0", "another reason",
                     "disk full: again (1000 similar line(s) suppressed in the last 10 s)"]
    assert limited.suppressed("ENOSPC") == 0


def test_a_disabled_level_costs_nothing_and_counts_nothing() -> None:
    logger = logging.getLogger("test.limited.quiet")
    logger.setLevel(logging.ERROR)
    limited = LimitedLog(logger, 10.0, Clock())
    assert not limited.info("x", key="k") and limited.suppressed("k") == 0


def test_keys_that_come_and_go_stay_bounded() -> None:
    """Keys naming pools or peers that come and go: those with nothing held back and a last
    line over an interval old are forgotten once many are kept; a key with lines held back
    stays until it says how many."""
    from hicache.log_limit import KEEP

    clock = Clock()
    limited = LimitedLog(logging.getLogger("test.limited.keys"), 10.0, clock)
    limited.warning("x", key="busy")
    assert not limited.warning("x", key="busy")  # one held back
    for i in range(10 * KEEP):
        assert limited.warning("pool %s gone", i, key=f"pool-{i}")
        clock.now += 1.0
    assert limited.kept <= KEEP + 11
    assert limited.suppressed("busy") == 1
