"""``hicache-bench soak`` and ``hicache-bench torture`` as a user runs them (short), against
the daemon as installed: a node's mix leaves nothing growing after its warm-up, and a daemon
SIGKILLed under load keeps its crash contract (docs/operations.md, "What a crash keeps").
Their long runs (an hour's soak, 100 kills) are in benchmarks/RESULTS.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.reliability.figures import record


def bench(tmp_path: Path, *args: str, timeout: float = 300) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "hicache_bench", *args, "--json", "--check"],
                         capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert out.stdout.strip(), out.stderr[-3000:]
    got: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0, got
    return got


def test_a_short_soak_runs_flat_without_errors_or_wrong_bytes(tmp_path: Path) -> None:
    r = bench(tmp_path, "soak", "--duration", "30")
    assert r["errors"] == 0 and r["wrong_bytes"] == 0 and r["flat"], r
    assert r["sessions_opened"] > 200 and r["crashes"] > 0 and r["pools_cycled"] >= 2, r
    tables = r["tables"]
    assert isinstance(tables, dict) and {"sessions", "hold_owners", "tally_tables"} <= set(tables)
    assert tables["sessions_ending"][1] == 0 and tables["hold_owners"][1] <= 4, tables
    assert 0 < tables["event_keys"][1] <= tables["event_keys_max"][1], tables
    record("soak_short", sessions=r["sessions_opened"], calls=r["calls"],
           rss_mb_start=r["rss_mb_start"], rss_mb_end=r["rss_mb_end"])


def test_a_daemon_killed_again_and_again_keeps_its_crash_contract(tmp_path: Path) -> None:
    r = bench(tmp_path, "torture", "--loops", "4")
    assert r["kills"] == r["loops"] == 4, r
    assert r["wrong"] == 0 and r["promised_lost"] == 0 and r["removed_back"] == 0, r
    assert r["keys_verified"] > 100 and r["removed"] > 0 and r["stored"] > 500, r
    record("torture_short", loops=r["loops"], verified=r["keys_verified"],
           in_flight_served=r["in_flight_served"], in_flight_absent=r["in_flight_absent"])


def test_the_soak_judges_rings_by_their_size_and_other_tables_by_their_growth() -> None:
    """``flat``: a ring (the event log's keys) filling up to its size is flat, one past it
    is not; any other table that more than doubles (+8) is not; RSS, fds and threads by
    their margins."""
    from hicache_bench.soak import flat

    base: dict[str, Any] = {"rss_mb_start": 100.0, "rss_mb_end": 105.0, "fds_start": 40,
                            "fds_end": 42, "threads_start": 30, "threads_end": 30,
                            "tables": {"event_keys": [1000, 262144],
                                       "event_keys_max": [262144, 262144],
                                       "holds": [10, 20], "sessions": [4, 4]}}
    assert flat(base) == (True, [])
    for change, why in (({"event_keys": [1000, 262145]}, "ring event_keys"),
                        ({"holds": [10, 29]}, "table holds"),
                        ({"sessions": [0, 9]}, "table sessions")):
        r = {**base, "tables": {**base["tables"], **change}}
        ok, reasons = flat(r)
        assert not ok and reasons[0].startswith(why), reasons
    for key, value, why in (("rss_mb_end", 127.0, "RSS"), ("fds_end", 45, "fds"),
                            ("threads_end", 35, "threads")):
        ok, reasons = flat({**base, key: value})
        assert not ok and reasons[0].startswith(why), reasons
