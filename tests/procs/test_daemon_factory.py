"""The tests' daemon factory (``daemons`` / ``module_daemons`` in conftest): what it reports
when a daemon does not drain cleanly, and that it leaves alone what a test ended itself."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from tests.daemon_proc import DaemonProc, Daemons


def _stand_in(tmp_path: Path, exit_code: int, name: str) -> DaemonProc:
    """A process that ends with ``exit_code`` on SIGTERM, in the place of a daemon."""
    log = tmp_path / f"{name}.log"
    log.write_text(f"{name}: the last lines of its log\n")
    code = ("import signal, sys, time\n"
            f"signal.signal(signal.SIGTERM, lambda *a: sys.exit({exit_code}))\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    return DaemonProc(proc, str(tmp_path / f"{name}.sock"), str(tmp_path), log)


def test_a_daemon_that_does_not_drain_cleanly_is_reported_with_its_log(tmp_path: Path) -> None:
    ds = Daemons(tmp_path)
    clean, unclean = _stand_in(tmp_path, 0, "clean"), _stand_in(tmp_path, 3, "unclean")
    ds._started += [(clean, True), (unclean, True)]
    bad = ds.stop_all()
    assert len(bad) == 1 and "ended with 3" in bad[0] and "unclean: the last lines" in bad[0]
    assert clean.proc.returncode == 0 and unclean.proc.returncode == 3


def test_an_unchecked_daemon_is_killed_and_a_stopped_one_left_alone(tmp_path: Path) -> None:
    ds = Daemons(tmp_path)
    hung, ended = _stand_in(tmp_path, 3, "hung"), _stand_in(tmp_path, 3, "ended")
    ended.proc.send_signal(signal.SIGKILL)
    ended.proc.wait(10)
    ds._started += [(hung, False), (ended, True)]
    assert ds.stop_all() == []
    assert hung.proc.returncode == -signal.SIGKILL
