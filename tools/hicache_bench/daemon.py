"""A daemon process for the benchmark tools: ``start_daemon(workdir, shm_dir, budget,
metrics_listen, *flags) -> (process, target)``, serving once it returns (``hicache-bench``,
its ``trace`` command and benchmarks/ start theirs here).
"""

from __future__ import annotations

import os
import subprocess
import sys

from hicache_client.client import HiCacheClient


def start_daemon(workdir: str, shm_dir: str, budget: str, metrics_listen: str = "",
                 *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    """A daemon process on a socket in ``workdir``, serving once this returns; ``extra``:
    more flags."""
    sock = os.path.join(workdir, "bench.sock")
    proc = subprocess.Popen([sys.executable, "-m", "hicached", "serve", "--listen",
                             f"unix:{sock}", "--shm-dir", shm_dir, "--metrics-listen",
                             metrics_listen, "--memory-budget", budget, "--reserve", "0",
                             "--state-dir", "", "--log-level", "WARNING", *extra],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    c = HiCacheClient(f"unix:{sock}", reconnect_seconds=30)
    c.ping()
    c.close()
    return proc, f"unix:{sock}"
