"""Start and stop real daemon processes for end-to-end tests."""

from __future__ import annotations

import atexit
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hicached.core.system import filesystem_of

REPO = Path(__file__).resolve().parent.parent

LEASE_S = 3
"""The test daemons' session lease (``--lease-seconds``): long enough that a worker the
scheduler stalls beside other test processes keeps its session. A test that counts on a
shorter one asks for it."""
REAPED_WITHIN_S = 4 * LEASE_S
"""How long a test waits for a dead or stopped worker's session to be reaped: its lease, the
reaper's period and a loaded machine."""


@dataclass
class DaemonProc:
    proc: subprocess.Popen[bytes]
    socket: str
    shm_dir: str
    log_path: Path

    @property
    def target(self) -> str:
        return f"unix:{self.socket}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        """Its Prometheus page (the port it logged: started with metrics on port 0)."""
        port = re.findall(r"metrics port (\d+)", self.log())[-1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def pause(self, timeout: float = 5.0) -> None:
        """SIGSTOP, and wait until every thread of the daemon is stopped (a signal takes
        effect when the process is next scheduled: a call may still be answered before)."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        tasks = Path(f"/proc/{self.proc.pid}/task")
        while not all(_state(t) in ("T", "t") for t in tasks.iterdir()):
            assert time.monotonic() < deadline, "the daemon did not stop"
            time.sleep(0.001)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def _state(task: Path) -> str:
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:  # the thread ended
        return "T"


def wait_serving(target: str, timeout: float = 30.0) -> None:
    """Until readiness (the API serves and the declared pools are built)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service="hicache.v1.HostCache"),
                               timeout=1)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemon at {target} did not start")
            time.sleep(0.1)


_MADE_STATE_DIRS: set[Path] = set()


def _remove_made_state_dirs() -> None:
    for d in _MADE_STATE_DIRS:
        shutil.rmtree(d, ignore_errors=True)


def state_dir_of(workdir: Path) -> Path:
    """Where a daemon on ``workdir`` keeps its pools: ``workdir/state`` when ``workdir`` is on
    a memory filesystem, else a directory of this run under /dev/shm (where the default
    ``state_dir`` is: pools in files on a disk filesystem cannot be pinned on a GPU host),
    removed when this process exits."""
    if filesystem_of(str(workdir)) in ("tmpfs", "hugetlbfs"):
        return workdir / "state"
    digest = hashlib.sha1(str(workdir.resolve()).encode()).hexdigest()[:16]
    state = Path("/dev/shm") / f"hicache-test-{os.getuid()}-{digest}"
    if not _MADE_STATE_DIRS:
        atexit.register(_remove_made_state_dirs)
    _MADE_STATE_DIRS.add(state)
    return state


def start_daemon(workdir: Path, *extra: str, socket: str | None = None,
                 wait: bool = True, prefix: Sequence[str] = (),
                 env: dict[str, str] | None = None, python: str = sys.executable,
                 cwd: Path = REPO) -> DaemonProc:
    """A daemon on ``workdir`` (its socket, shm and state directories), started through
    ``prefix`` if given (e.g. ``nsenter`` into a network namespace), with ``env`` added to
    this process's environment; ``python``: the interpreter (another environment's)."""
    shm = workdir / "shm"
    shm.mkdir(exist_ok=True)
    sock = socket or str(workdir / "hicached.sock")
    log_path = workdir / f"daemon-{time.monotonic_ns()}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    state = state_dir_of(workdir)  # pools outlive a daemon here; the next one finds them
    cmd = [*prefix, python, "-m", "hicached", "serve", "--listen", f"unix:{sock}",
           "--shm-dir", str(shm), "--state-dir", str(state), "--metrics-listen", "127.0.0.1:0",
           "--lease-seconds", str(LEASE_S),
           "--memory-budget", "2GiB", "--reserve", "0", "--grace-seconds", "5", *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    d = DaemonProc(proc, sock, str(shm), log_path)
    if wait:
        try:
            wait_serving(d.target)
        except TimeoutError:
            d.stop(signal.SIGKILL)
            raise AssertionError(f"daemon failed to start:\n{d.log()}") from None
    return d


class Daemons:
    """The daemons one test (or one module) starts, stopped and checked when it ends.

    ``start(*extra, workdir=None, checked=True, **kw)`` is ``start_daemon`` on ``workdir``
    (the fixture's directory by default). At the end each daemon still running is resumed (a
    test may have paused it) and sent SIGTERM: a ``checked`` one must drain and exit with
    status 0 within 20 s, or the test fails with the tail of its log; one started with
    ``checked=False`` (a test that leaves it mid-copy on purpose, hung by a seam) is killed.
    A daemon the test stopped or killed itself is left as it is."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._started: list[tuple[DaemonProc, bool]] = []

    def start(self, *extra: str, workdir: Path | None = None, checked: bool = True,
              **kw: object) -> DaemonProc:
        d = start_daemon(workdir or self.workdir, *extra, **kw)  # type: ignore[arg-type]
        self._started.append((d, checked))
        return d

    def stop_all(self) -> list[str]:
        """Stop every daemon still running; what went wrong, one line each."""
        bad = []
        for d, checked in self._started:
            if d.proc.poll() is not None:
                continue  # the test ended it
            d.resume()
            if not checked:
                d.stop(signal.SIGKILL)
                continue
            try:
                code = d.stop(signal.SIGTERM)
            except subprocess.TimeoutExpired:
                d.stop(signal.SIGKILL)
                code = None
            if code != 0:
                bad.append(f"daemon {d.socket} ended with {code} on SIGTERM; its log ends:\n"
                           f"{d.log()[-3000:]}")
        return bad
