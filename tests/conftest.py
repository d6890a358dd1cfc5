from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, settings

from tests.daemon_proc import Daemons
from tests.reliability.figures import RUN_DIR_ENV

if TYPE_CHECKING:
    from tests.mooncake_env import Netns

pytest_plugins = ["tests.cuda_fixtures"]

settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "dev", max_examples=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


RUN_DIR = Path(os.environ.get(RUN_DIR_ENV) or tempfile.mkdtemp(prefix="hicache-test-run-"))
"""What every process of this run shares (pytest-xdist's workers inherit it from the process
that starts them): the lock-order reports of its processes and daemons, and the reliability
figures."""
os.environ[RUN_DIR_ENV] = str(RUN_DIR)


def pytest_configure(config: pytest.Config) -> None:
    """The tests run what is installed (non-editable, as users have it: scripts/setup.sh),
    so they refuse to run an install that is not this checkout: an edit not yet installed
    would pass or fail unseen. Every daemon lock, in this process and in every daemon the
    tests start, is checked against ``hicache.locks.ORDER``: the run fails on an
    inversion (``pytest_sessionfinish``)."""
    from hicache import locks
    from tests.installed import drift

    locks.check_order(RUN_DIR)
    os.environ[locks.ENV_CHECK_LOCK_ORDER] = str(RUN_DIR)

    stale = drift()
    if stale:
        shown = "; ".join(stale[:5]) + (f"; and {len(stale) - 5} more" if len(stale) > 5 else "")
        raise pytest.UsageError(
            f"the hicached installed here is not this checkout ({shown}): reinstall it "
            "(bash scripts/test.sh does; or pip install . in this environment)")


LONGEST_FILES = (
    "tests/reliability/test_leaks.py",
    "tests/procs/test_mooncake_e2e.py",
    "tests/integrations/vllm/test_vllm_offloading.py",
    "tests/repo/test_packaging.py",
    "tests/install/test_installed.py",
    "tests/integrations/sglang/test_sglang_linker.py",
    "tests/reliability/test_restart.py",
    "tests/reliability/test_soak_torture.py",
    "tests/integrations/vllm/test_vllm_failures.py",
    "tests/repo/test_gpu_check.py",
    "tests/repo/test_bench_compare.py",
)
"""Test files that take most of a minute or more here, longest first: they start first, so a
parallel run (scripts/test.sh) does not end on one of them alone. Only the order changes."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def lock_order_inversions() -> list[str]:
    """Every inversion this run's processes wrote, one text each."""
    found = []
    for report in sorted(RUN_DIR.glob("lock-order-*.txt")):
        pid = report.stem.rsplit("-", 1)[-1]
        found += [f"process {pid}: {text.strip()}"
                  for text in report.read_text(errors="replace").split("\f") if text.strip()]
    return found


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if lock_order_inversions() and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    from tests.reliability.figures import collected

    inversions = lock_order_inversions()
    if inversions:
        terminalreporter.section("lock order inversions (docs/architecture.md, Lock order)",
                                 red=True)
        for text in inversions[:20]:
            terminalreporter.write_line(text)
        terminalreporter.write_line(f"{len(inversions)} inversion(s): the run fails")

    figures = collected()
    if not figures:
        return
    terminalreporter.section("reliability figures")
    for test, values in sorted(figures.items()):
        shown = ", ".join(f"{k}={v:,.0f}" if float(v).is_integer() else f"{k}={v:,.2f}"
                          for k, v in values.items())
        terminalreporter.write_line(f"{test}: {shown}")


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Daemons]:
    """Real daemons for one test: ``daemons.start(...)``; each is stopped, and its clean
    drain checked, when the test ends (``tests.daemon_proc.Daemons``)."""
    started = Daemons(tmp_path)
    yield started
    bad = started.stop_all()
    assert not bad, "\n".join(bad)


@pytest.fixture(scope="module")
def module_daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    """``daemons`` for a whole module (tests that share one daemon's state)."""
    started = Daemons(tmp_path_factory.mktemp("daemons"))
    yield started
    bad = started.stop_all()
    assert not bad, "\n".join(bad)


@pytest.fixture(scope="module")
def netns() -> Iterator[Netns]:
    """A private network namespace for a module's servers that bind every address (Dynamo's
    indexer): ``tests.mooncake_env.Netns``."""
    from tests.mooncake_env import Netns

    ns = Netns()
    yield ns
    ns.close()
