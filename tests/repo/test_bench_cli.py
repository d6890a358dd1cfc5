"""``hicache-bench`` leaves nothing behind: its temporary directory and its /dev/shm buffer
directory go after a run and after a Ctrl-C in the middle of one; its progress line is the only
thing it writes to stderr."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon_proc import REPO


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """The bench's TMPDIR, short: its daemon's socket and the sockets beside it must fit a
    Unix socket's 107 bytes, which a test's own directory under a parallel run may not."""
    d = Path(tempfile.mkdtemp(prefix="hb-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def ours_in_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("hicache-bench-")}


def bench(tmp: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "hicache_bench", "--memory-budget", "1GiB",
                             "--workers", "1", "--page-size", "16", *args], cwd=REPO,
                            env=dict(os.environ, TMPDIR=str(tmp)), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=_interruptible)


def _interruptible() -> None:
    """Ctrl-C as a terminal's foreground job has it: a test run started in the background
    ignores SIGINT, and so would the bench it starts."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_run_cleans_up_and_prints_only_progress(tmp_path: Path) -> None:
    before = ours_in_shm()
    p = bench(tmp_path, "--seconds", "0.2", "--batch-pages", "1,2")
    out, err = p.communicate(timeout=240)
    assert p.returncode == 0, err
    assert "pages/s" in out
    lines = [x for x in err.replace("\r", "\n").splitlines() if x.strip()]
    assert lines and all(x.startswith("[") for x in lines), err
    assert os.listdir(tmp_path) == [] and ours_in_shm() == before


def test_ctrl_c_cleans_up(tmp_path: Path) -> None:
    before = ours_in_shm()
    p = bench(tmp_path, "--seconds", "30", "--batch-pages", "1")
    assert p.stderr is not None
    deadline = time.monotonic() + 120
    seen = ""
    while "batch 1 pages" not in seen:  # the progress line: the workers start
        assert time.monotonic() < deadline and p.poll() is None, "the bench never started"
        seen += p.stderr.read(1)
    time.sleep(2)
    os.killpg(p.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
    p.communicate(timeout=60)
    assert p.returncode != 0
    assert os.listdir(tmp_path) == [] and ours_in_shm() == before


def test_a_daemon_that_cannot_start_is_reported_at_once_with_its_own_words(
        tmp_path: Path) -> None:
    from hicache_bench.daemon import DaemonDidNotStart, start_daemon

    work = tmp_path / ("w" * (104 - len(str(tmp_path)) - len("//bench.sock")))
    work.mkdir()
    assert len(str(work / "bench.sock")) == 104  # its .fast socket would not fit
    started = time.monotonic()
    with pytest.raises(DaemonDidNotStart, match=r"exited with 2 .*over the 107"):
        start_daemon(str(work), str(tmp_path), "64MiB")
    assert time.monotonic() - started < 30
