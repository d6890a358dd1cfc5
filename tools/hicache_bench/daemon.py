"""A daemon process for the benchmark tools: ``start_daemon(workdir, shm_dir, budget,
metrics_listen, *flags) -> (process, target)``, serving once it returns (``hicache-bench``,
its ``trace`` command and benchmarks/ start theirs here); ``DaemonDidNotStart`` when it exits
first (its last words in the message) or does not answer within ``START_SECONDS``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from hicache.errors import HiCacheError
from hicache_client.client import HiCacheClient

START_SECONDS = 60.0
"""How long a daemon may take to answer (its imports on a busy machine take seconds)."""


class DaemonDidNotStart(RuntimeError):
    """The benchmark's daemon exited or never answered."""


def start_daemon(workdir: str, shm_dir: str, budget: str, metrics_listen: str = "",
                 *extra: str, state_dir: str = "") -> tuple[subprocess.Popen[bytes], str]:
    """A daemon process on a socket in ``workdir``, serving once this returns; ``extra``:
    more flags; ``state_dir``: where its pools outlive it ('' = nowhere). Its stderr goes to
    ``workdir/daemon.log``."""
    sock = os.path.join(workdir, "bench.sock")
    log_path = os.path.join(workdir, "daemon.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hicached", "serve", "--listen",
                                 f"unix:{sock}", "--shm-dir", shm_dir, "--metrics-listen",
                                 metrics_listen, "--memory-budget", budget, "--reserve", "0",
                                 "--state-dir", state_dir, "--log-level", "WARNING", *extra],
                                stdout=subprocess.DEVNULL, stderr=log)
    target = f"unix:{sock}"
    deadline = time.monotonic() + START_SECONDS
    while True:
        if proc.poll() is not None:
            with open(log_path, "rb") as f:
                said = f.read()[-2000:].decode(errors="replace").strip()
            raise DaemonDidNotStart(f"the daemon exited with {proc.returncode} before it "
                                    f"served: {said or '(it said nothing)'}")
        if os.path.exists(sock):  # bound: it answers once its server runs
            try:
                with HiCacheClient(target, timeout=5, reconnect_seconds=0.5) as c:
                    c.ping()
                return proc, target
            except HiCacheError:
                pass
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise DaemonDidNotStart(f"the daemon did not answer on {sock} within "
                                    f"{START_SECONDS:.0f} s")
        time.sleep(0.05)
