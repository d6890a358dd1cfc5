"""vLLM engine processes for the end-to-end tests: each runs one scenario of
``tests/scenarios_vllm.py`` with vLLM's code from ``.vllm-0.33.0`` and prints what it saw.
Importing this module skips the importing test module where vLLM's code is not there (and
fails under CI).

Primitives: ``VLLM`` (vLLM's code), ``BS`` (the engines' block size), ``CLEAN`` (a check of
loaded rows that found nothing wrong); ``vllm_env()``; ``engine(scenario, **args)`` (the
process), ``result(proc)``, ``run(scenario, **args)``, ``results(procs)`` (every rank's);
``wait_file(path, proc)``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_proc import REPO

VLLM = Path(os.environ.get("HICACHED_VLLM_DIR", REPO / ".vllm-0.33.0"))
if not (VLLM / ".complete").exists():
    if os.environ.get("CI"):
        raise RuntimeError(f"vLLM's code is not in {VLLM}: scripts/setup.sh --test puts it there")
    pytest.skip(f"vLLM's code is not in {VLLM} (scripts/setup.sh --test)", allow_module_level=True)

BS = 16
CLEAN = {"bad": [], "n_bad": 0}


def vllm_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=f"{VLLM}:{REPO}", VLLM_TARGET_DEVICE="cpu",
                HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")


def engine(scenario: str, **args: Any) -> subprocess.Popen[str]:
    """A vLLM engine process running ``tests.scenarios_vllm.<scenario>(**args)``."""
    return subprocess.Popen([sys.executable, "-m", "tests.vllm_harness", scenario,
                             json.dumps(args)], cwd=REPO, env=vllm_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def result(proc: subprocess.Popen[str], timeout: float = 240) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"engine still running after {timeout} s:\n{err[-8000:]}") from None
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"engine failed ({proc.returncode}):\n{err[-6000:]}"
    got: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    got["stderr"] = err
    return got


def run(scenario: str, **args: Any) -> dict[str, Any]:
    return result(engine(scenario, **args))


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
