"""The written lock order and its checker: every lock of the daemon, the workers' libraries
and the API package is made by name, the names are the ones docs/architecture.md lists in the
same order, and a take against the order is reported (once per pair, with where) without
changing what the lock does; a process started with ``HICACHED_CHECK_LOCK_ORDER`` checks its
locks from the import on."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hicache import locks

REPO = Path(__file__).resolve().parents[2]
SOURCES = [REPO / "daemon" / "hicached", *(REPO / "clients" / "python" / p for p in (
    "hicache", "hicache_client", "hicache_sglang", "hicache_vllm"))]


@pytest.fixture
def fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The checker on, its books and report this test's own (the suite's stay clean)."""
    report = tmp_path / "report.txt"
    monkeypatch.setattr(locks, "_checking", True)
    monkeypatch.setattr(locks, "_seen", {})
    monkeypatch.setattr(locks, "_report", report)
    return report


def test_a_take_in_order_is_quiet_and_one_against_it_is_reported_once(fresh: Path) -> None:
    outer, inner = locks.lock("pool_table"), locks.lock("pool_cache")
    assert isinstance(outer, locks.CheckedLock)
    with outer, inner:
        pass
    assert locks.inversions() == {}
    for _ in range(3):
        with inner, outer:
            pass
    got = locks.inversions()
    assert list(got) == [("pool_cache", "pool_table")]
    assert "took 'pool_table' while holding 'pool_cache'" in got["pool_cache", "pool_table"]
    assert "test_locks.py" in got["pool_cache", "pool_table"]  # where it happened
    assert fresh.read_text().count("took 'pool_table'") == 1


def test_two_locks_of_one_name_nested_is_an_inversion(fresh: Path) -> None:
    """Two sessions' locks, one inside the other: another thread may take them the other
    way round, and nothing orders two of a kind."""
    a, b = locks.lock("session"), locks.lock("session")
    with a, b:
        pass
    assert list(locks.inversions()) == [("session", "session")]


def test_a_try_take_is_not_ordered_and_the_lock_still_excludes(fresh: Path) -> None:
    outer, inner = locks.lock("pool_table"), locks.lock("pool_cache")
    with inner:
        assert outer.acquire(blocking=False)
        outer.release()
        assert not inner.acquire(blocking=False)  # still a lock
        assert not inner.acquire(timeout=0.01)
    assert ("pool_cache", "pool_table") not in locks.inversions()


def test_a_condition_waits_on_a_checked_lock_and_its_books_follow(fresh: Path) -> None:
    lk = locks.lock("budget")
    cond = locks.condition(lk)
    ready = []

    def notify() -> None:
        with cond:
            ready.append(1)
            cond.notify_all()

    with cond:
        threading.Thread(target=notify).start()
        assert cond.wait_for(lambda: ready, 5)
        assert locks._held() == [lk]  # type: ignore[comparison-overlap]
    assert locks._held() == []
    with pytest.raises(RuntimeError):
        cond.notify()  # not held: a condition still says so
    assert locks.inversions() == {}


def test_a_lock_released_by_another_thread_leaves_no_stale_hold(fresh: Path) -> None:
    lk = locks.lock("pool_cache")
    lk.acquire()
    t = threading.Thread(target=lk.release)
    t.start()
    t.join()
    with locks.lock("pool_table"):  # nothing held any more: in order
        pass
    assert locks.inversions() == {}


def test_an_unknown_name_is_refused_and_without_checking_a_lock_is_plain(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"not in hicache\.locks\.ORDER"):
        locks.lock("no-such-lock")
    monkeypatch.setattr(locks, "_checking", False)
    assert type(locks.lock("pool")) is type(threading.Lock())


def test_the_inversions_kept_are_bounded(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(locks, "MAX_INVERSIONS", 2)
    names = locks.ORDER[:4]
    for i in range(3, 0, -1):
        with locks.lock(names[i]), locks.lock(names[i - 1]):
            pass
    assert len(locks.inversions()) == 2


def _sources() -> list[Path]:
    return [p for root in SOURCES for p in root.rglob("*.py")
            if p != REPO / "clients" / "python" / "hicache" / "locks.py"
            and not p.name.endswith("_pb2_grpc.py")]


def test_every_lock_is_made_by_name() -> None:
    """No lock is made around the order: each one comes from ``locks.lock``."""
    made = re.compile(r"threading\.(Lock|RLock|Condition|Semaphore|BoundedSemaphore)\(")
    found = [f"{p.relative_to(REPO)}:{n}" for p in _sources()
             for n, line in enumerate(p.read_text().splitlines(), 1) if made.search(line)]
    assert not found, f"made outside hicache.locks: {found}"


def test_every_name_in_the_order_is_used_and_written_in_the_docs_in_that_order() -> None:
    used = {m for p in _sources()
            for m in re.findall(r"""(?:lock|condition)\("([a-z_.]+)"\)""", p.read_text())}
    assert used == set(locks.ORDER), (set(locks.ORDER) - used, used - set(locks.ORDER))
    doc = (REPO / "docs" / "architecture.md").read_text()
    section = doc.split("## Lock order", 1)[1].split("\n## ", 1)[0]
    written = re.findall(r"^\d+\. `([a-z_.]+)`", section, re.M)
    assert written == list(locks.ORDER)


def test_a_process_started_with_the_variable_checks_from_the_import_on(tmp_path: Path) -> None:
    """A worker or an engine server has no entry point of ours: importing the package with
    ``HICACHED_CHECK_LOCK_ORDER`` set turns the checker on, module-level locks included."""
    code = ("from hicache import locks, polling\n"
            "assert locks.checking()\n"
            "assert isinstance(polling._load_lock, locks.CheckedLock)\n"
            "a, b = locks.lock('log_limit'), locks.lock('link')\n"
            "with a, b: pass\n")
    env = {k: v for k, v in os.environ.items() if k != locks.ENV_CHECK_LOCK_ORDER}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**env, locks.ENV_CHECK_LOCK_ORDER: str(tmp_path)}, timeout=60)
    assert out.returncode == 0, out.stderr
    (report,) = tmp_path.glob("lock-order-*.txt")
    assert "took 'link' while holding 'log_limit'" in report.read_text()
    out = subprocess.run([sys.executable, "-c", "from hicache import locks\n"
                          "assert not locks.checking()"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
