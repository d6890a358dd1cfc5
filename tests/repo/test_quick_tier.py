"""``bash scripts/test.sh --quick`` names tests that exist: each end-to-end test of its list
is collected, one per front end and per engine."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _quick_e2e() -> list[str]:
    script = (REPO / "scripts" / "test.sh").read_text()
    block = script.split("QUICK_E2E=(", 1)[1].split("\n)", 1)[0]
    return re.findall(r'^\s*"([^"]+)"', block, re.M)


def test_the_quick_tier_names_one_existing_test_per_front_end_and_engine() -> None:
    ids = _quick_e2e()
    assert len(ids) == 4
    assert {i.split("::")[0].split("/")[1] for i in ids} == {"procs", "integrations"}
    assert any("/sglang/" in i for i in ids) and any("/vllm/" in i for i in ids)
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:cacheprovider", *ids], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    collected = [line for line in r.stdout.splitlines() if "::" in line]
    for i in ids:
        assert any(c.startswith(i) for c in collected), f"{i} collects nothing"
    fast_and_grpc = [c for c in collected if "test_holds_e2e" in c]
    assert {c.rsplit("[", 1)[-1] for c in fast_and_grpc} == {"fast]", "grpc]"}


def test_the_files_the_suite_starts_first_exist() -> None:
    from tests.conftest import LONGEST_FILES

    assert LONGEST_FILES and all((REPO / f).is_file() for f in LONGEST_FILES), LONGEST_FILES
