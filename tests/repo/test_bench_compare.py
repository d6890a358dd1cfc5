"""``hicache-bench compare``: it finds a slowdown planted in a stand-in revision, reports it in
its table, its JSON and its exit status, refuses a revision that is not one, and leaves nothing
behind (worktrees, temporary directories, /dev/shm)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hicache_bench.compare import ratio_interval, summarize
from tests.daemon_proc import REPO

SLOW_LOOKUP = '''

# planted by tests/repo/test_bench_compare.py: every Lookup takes 3 ms more
import time as _planted_time

_planted_lookup = Daemon.lookup


def _slow_lookup(self, *args, **kwargs):  # type: ignore[no-untyped-def]
    _planted_time.sleep(0.003)
    return _planted_lookup(self, *args, **kwargs)


Daemon.lookup = _slow_lookup  # type: ignore[method-assign]
'''


def ours_in_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("hicache-lat-")}


def compares_in_shm() -> set[str]:
    """What compare and its latency runs make under /dev/shm (other tests' daemons, which may
    run beside this one, have names of their own)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(("hicache-compare-", "hicache-lat-"))}


def daemon_pids() -> set[int]:
    got = subprocess.run(["pgrep", "-f", "hicached serve .*hicache-lat-"], capture_output=True,
                         text=True).stdout
    return {int(x) for x in got.split()}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """A clone of this checkout's HEAD and, on top of it, a commit whose Lookups are slow."""
    clone = tmp_path_factory.mktemp("compare") / "repo"
    subprocess.run(["git", "clone", "-q", "--shared", str(REPO), str(clone)], check=True)
    base = git(clone, "rev-parse", "HEAD")
    with open(clone / "daemon/hicached/service/daemon.py", "a") as f:
        f.write(SLOW_LOOKUP)
    git(clone, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "slow lookups")
    return clone, base, git(clone, "rev-parse", "HEAD")


def compare(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TMPDIR"] = str(tmp)
    return subprocess.run([sys.executable, "-m", "hicache_bench", "compare", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_summarize_takes_medians_of_every_call_and_half_ranges_of_round_medians() -> None:
    samples = {("fast", "small/load_1"): {"b": [[1e-4, 2e-4, 3e-4], [3e-4, 4e-4, 5e-4]],
                                          "h": [[2e-4, 2e-4], [6e-4, 6e-4]]}}
    [row] = summarize(samples, "b", "h")
    assert (row.path, row.op, row.page) == ("fast", "load_1@small", "small")
    assert row.base_us == pytest.approx(300.0) and row.head_us == pytest.approx(400.0)
    assert row.ratio == pytest.approx(4 / 3)
    # base: round medians 200 and 400 us, half the range 100 of 300; head: 200 and 600 of 400
    assert row.base_spread_pct == pytest.approx(100 / 3) and row.head_spread_pct == 50.0


def test_the_interval_tells_a_slowdown_from_rounds_that_disagree() -> None:
    """Rounds that each settle in their own regime (some fast, some slow, in both trees, the
    pair of a round alike as a drift would make them) give an interval that holds 1; the same
    rounds made 30 % slower in head give one above 1; one round gives no interval."""
    rng = np.random.default_rng(7)

    def rounds(scale: float) -> list[list[float]]:
        out = []
        for r in range(8):
            regime = 1.0 if r % 2 else 1.15  # a process that settled slow
            out.append(list(scale * regime * (1 + 0.05 * rng.standard_normal(200))))
        return out

    base, same, slower = rounds(1.0), rounds(1.0), rounds(1.3)
    lo, hi = ratio_interval(base, same)
    assert lo < 1 < hi
    lo, hi = ratio_interval(base, slower)
    assert 1 < lo < 1.3 < hi < 1.6, (lo, hi)
    assert ratio_interval(base[:1], slower[:1]) == (0.0, float("inf"))
    samples = {("fast", "small/load_1"): {"b": base, "h": slower}}
    [row] = summarize(samples, "b", "h")
    assert (row.ratio_lo, row.ratio_hi, row.verdict) == (lo, hi, "slower")
    [even] = summarize({("fast", "small/load_1"): {"b": base, "h": same}}, "b", "h")
    assert even.verdict == "even"
    [faster] = summarize({("fast", "small/load_1"): {"b": slower, "h": base}}, "b", "h")
    assert faster.verdict == "faster"


def test_a_planted_slowdown_is_found_and_nothing_is_left_behind(
        stand_in: tuple[Path, str, str], tmp_path: Path) -> None:
    clone, base, slow = stand_in
    shm_before = ours_in_shm()
    got = compare(tmp_path, base, "--head", slow, "--repo", str(clone), "--rounds", "2",
                  "--calls", "12", "--paths", "fast-nopoll", "--ops", "lookup_128,load_1",
                  "--pages", "small", "--json", "--max-ratio", "1.5")
    assert got.returncode == 1, got.stderr  # a ratio above --max-ratio
    rows = {r["op"]: r for r in map(json.loads, got.stdout.splitlines())}
    assert set(rows) == {"lookup_128@small", "load_1@small"}
    lookup, load = rows["lookup_128@small"], rows["load_1@small"]
    assert {"path", "op", "base_us", "head_us", "ratio"} <= set(lookup)
    assert lookup["path"] == "fast-nopoll" and lookup["head"] == slow[:9]
    assert lookup["head_us"] - lookup["base_us"] > 2500  # the planted 3 ms
    assert lookup["ratio"] > 3 and 0.5 < load["ratio"] < 1.5, rows
    assert "lookup_128@small: head/base" in got.stderr
    assert git(clone, "worktree", "list").count("\n") == 0  # the clone's own tree only
    assert os.listdir(tmp_path) == [] and ours_in_shm() == shm_before


def test_the_table_names_both_trees_and_the_same_tree_is_even(
        stand_in: tuple[Path, str, str], tmp_path: Path) -> None:
    clone, base, _slow = stand_in
    got = compare(tmp_path, base, "--head", base, "--repo", str(clone), "--rounds", "2",
                  "--calls", "12", "--paths", "fast", "--ops", "lookup_128", "--pages",
                  "small", "--max-ratio", "3")
    assert got.returncode == 0, got.stderr
    assert f"base {base[:9]}, head {base[:9]}" in got.stdout
    [line] = [x for x in got.stdout.splitlines() if x.startswith("fast ")]
    ratio, interval, verdict = line.split()[-3:]
    assert 1 / 3 < float(ratio) < 3 and verdict in ("even", "slower", "faster")
    lo, hi = map(float, interval.split("-"))
    assert lo <= float(ratio) <= hi
    assert os.listdir(tmp_path) == []


def test_a_revision_that_is_not_one_is_refused_cleanly(tmp_path: Path) -> None:
    got = compare(tmp_path, "no-such-revision-anywhere", "--rounds", "1")
    assert got.returncode == 2
    assert "no-such-revision-anywhere" in got.stderr and "Traceback" not in got.stderr
    assert len(got.stderr) < 2000
    assert os.listdir(tmp_path) == []
    assert "hicache-compare" not in git(REPO, "worktree", "list")


def test_sigterm_in_the_middle_leaves_nothing_behind(stand_in: tuple[Path, str, str],
                                                     tmp_path: Path) -> None:
    clone, base, slow = stand_in
    shm_before = compares_in_shm()
    before = daemon_pids()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TMPDIR"] = str(tmp_path)
    p = subprocess.Popen([sys.executable, "-m", "hicache_bench", "compare", base, "--head",
                          slow, "--repo", str(clone), "--rounds", "50", "--calls", "50",
                          "--paths", "fast-nopoll", "--pages", "small"], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stderr is not None
    seen = ""
    while "runs" not in seen:  # the first run is done: the next one is under way
        ch = p.stderr.read(1)
        assert ch, seen
        seen += ch
    deadline = time.monotonic() + 60
    while not daemon_pids() - before:  # its daemon is up
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM
    assert git(clone, "worktree", "list").count("\n") == 0
    assert os.listdir(tmp_path) == []
    assert compares_in_shm() == shm_before
    assert not daemon_pids() - before, "a daemon outlived compare"
