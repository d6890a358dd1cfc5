"""vLLM engine processes for the end-to-end tests: each runs one scenario of
``tests/scenarios_vllm.py`` with one vLLM release's code (``.vllm-<release>/``, every release
``hicache.engines`` tests) and prints what it saw. Importing this module skips the importing
test module where vLLM's code is not there (and fails under CI).

Primitives: ``RELEASES`` (the vLLM releases the suite runs, newest first), ``NEWEST``,
``CORE`` (a parametrization over every release, for the core scenarios each one runs:
store, hit, load exact, hang, restart), ``VLLM`` (the newest's code), ``vllm_dir(release)``,
``BS`` (the engines' block size), ``CLEAN`` (a check of loaded rows that found nothing
wrong); ``vllm_env(release)``; ``engine(scenario, vllm=, **args)`` (the process),
``result(proc)``, ``results(procs)`` (every rank's); ``run(scenario, vllm=, **args)``: one
scenario to its end, in a process forked from that release's ``tests.vllm_zygote`` (vLLM
imported once per test process and release, not once per scenario); ``wait_file(path,
proc)``; ``reports_failures(release)``: whether that release takes a failed transfer
(``TransferResult.success = False``).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from hicache import engines
from tests.daemon_proc import REPO

RELEASES = [x.tested for x in reversed(engines.lines("vllm"))]
"""The vLLM releases the suite runs, newest first."""
NEWEST = RELEASES[0]


def vllm_dir(release: str) -> Path:
    """Where scripts/setup.sh --test puts that release's code."""
    return REPO / f".vllm-{release}"


VLLM = vllm_dir(NEWEST)
_missing = [r for r in RELEASES if not (vllm_dir(r) / ".complete").exists()]
if _missing:
    where = ", ".join(str(vllm_dir(r)) for r in _missing)
    if os.environ.get("CI"):
        raise RuntimeError(f"vLLM's code is not in {where}: scripts/setup.sh --test puts it there")
    pytest.skip(f"vLLM's code is not in {where} (scripts/setup.sh --test)",
                allow_module_level=True)

CORE = pytest.mark.parametrize("vllm", RELEASES, ids=[f"vllm-{r}" for r in RELEASES])
"""The core scenarios run on every release: a test taking ``vllm`` runs once per release."""

BS = 16
CLEAN = {"bad": [], "n_bad": 0}


def reports_failures(release: str) -> bool:
    """vLLM 0.34 on takes ``TransferResult.success = False`` (an asynchronous load failed:
    the request recomputed or failed; a store failed: dropped); 0.33 asserts success."""
    return engines.release(release) >= (0, 34)


def vllm_env(release: str = NEWEST) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=f"{vllm_dir(release)}:{REPO}", VLLM_TARGET_DEVICE="cpu",
                HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")


def engine(scenario: str, vllm: str = NEWEST, **args: Any) -> subprocess.Popen[str]:
    """A vLLM engine process (release ``vllm``) running
    ``tests.scenarios_vllm.<scenario>(**args)``."""
    return subprocess.Popen([sys.executable, "-m", "tests.vllm_harness", scenario,
                             json.dumps(args)], cwd=REPO, env=vllm_env(vllm), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


ENGINE_TIMEOUT_S = 240.0
"""How long a test waits for an engine process before it kills it."""


def result(proc: subprocess.Popen[str], timeout: float = ENGINE_TIMEOUT_S) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"engine still running after {timeout} s:\n{err[-8000:]}") from None
    return _parsed(proc.returncode, out, err)


def run(scenario: str, vllm: str = NEWEST, **args: Any) -> dict[str, Any]:
    """``tests.scenarios_vllm.<scenario>(**args)`` in an engine process of its own (vLLM
    release ``vllm``), forked from this test process's zygote of that release; what it
    returned (as ``result``)."""
    zygote = _zygotes.get(vllm)
    if zygote is None or zygote.proc.poll() is not None:
        zygote = _zygotes[vllm] = _Zygote(vllm)
    code, out, err = zygote.run(scenario, args, ENGINE_TIMEOUT_S)
    return _parsed(code, out, err)


def _parsed(code: int | None, out: str, err: str) -> dict[str, Any]:
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert code == 0 and lines, f"engine failed ({code}):\n{err[-6000:]}"
    got: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    got["stderr"] = err
    return got


class _Zygote:
    """This test process's ``tests.vllm_zygote`` of one release: started on first use,
    killed at exit."""

    def __init__(self, release: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="hicache-vllm-zygote-"))
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.vllm_zygote"], cwd=REPO,
                                     env=vllm_env(release), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE,
                                     stderr=open(self.dir / "zygote.err", "wb"))  # noqa: SIM115
        self._buf = b""
        self._runs = 0
        atexit.register(self.close)

    def run(self, scenario: str, args: dict[str, Any], timeout: float
            ) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) of ``scenario`` run in a forked child; killed after
        ``timeout`` seconds (an ``AssertionError`` with its stderr). Any failure here ends
        the zygote: the next run starts another."""
        self._runs += 1
        out, err = self.dir / f"{self._runs}.out", self.dir / f"{self._runs}.err"
        try:
            return self._run(scenario, args, timeout, out, err)
        except BaseException:  # a zygote out of step with its requests serves no other
            self.close()
            raise

    def _run(self, scenario: str, args: dict[str, Any], timeout: float, out: Path,
             err: Path) -> tuple[int, str, str]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"scenario": scenario, "args": args,
                                               "out": str(out), "err": str(err)})
                                   + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            why = (self.dir / "zygote.err").read_text(errors="replace")
            raise AssertionError(f"the vLLM zygote ended:\n{why[-6000:]}") from None
        pid = int(self._line("PID", 300).split()[1])  # (the first waits for the import)
        code: int | None
        try:
            code = int(self._line(f"EXIT {pid}", timeout).split()[2])
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._line(f"EXIT {pid}", 30)
            code = None
        texts = [p.read_text(errors="replace") if p.exists() else "" for p in (out, err)]
        for p in (out, err):
            p.unlink(missing_ok=True)
        if code is None:
            raise AssertionError(f"engine still running after {timeout} s:\n{texts[1][-8000:]}")
        if code and not texts[1]:  # it failed before it had a stderr of its own
            texts[1] = (self.dir / "zygote.err").read_text(errors="replace")
        return code, texts[0], texts[1]

    def _line(self, word: str, timeout: float) -> str:
        """The zygote's next line starting with ``word`` (others, a module's print at
        import, are skipped)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        # poll, not select: a test process may hold more than FD_SETSIZE (1,024) files
        waiting = select.poll()
        waiting.register(fd, select.POLLIN)
        end = time.monotonic() + timeout
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                if line.startswith(word.encode() + b" "):
                    return line.decode()
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(word)
            if not waiting.poll(left * 1000):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                why = (self.dir / "zygote.err").read_text(errors="replace")
                raise AssertionError(f"the vLLM zygote ended:\n{why[-6000:]}")
            self._buf += chunk

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_zygotes: dict[str, _Zygote] = {}


def results(procs: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    """Every rank's result; a rank that failed or hung ends its peers too (they would wait on
    it for gloo's own timeout)."""
    try:
        return [result(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def wait_file(path: Path, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    """Wait for a file the engine writes when it reaches a point of its scenario (the
    engine must still be running)."""
    end = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"engine ended early:\n{proc.communicate()[1][-6000:]}"
        assert time.monotonic() < end, f"{path.name} never came"
        time.sleep(0.05)
