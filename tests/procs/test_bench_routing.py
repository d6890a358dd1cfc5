"""``benchmarks/bench_routing.py`` runs as a user runs it (``--quick``): two real daemons, Dynamo's
indexer following their pool streams, the same requests routed three ways. With arrivals
20 ms apart the router's view keeps up: it gets nearly what an exact view gets, and more than
round robin (whose multi-turn conversations land on the node without their last turn).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dynamo_indexer import unavailable

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "available")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_routing.py"


def test_routed_requests_hit_more_than_round_robin(tmp_path: Path) -> None:
    out = tmp_path / "routing.json"
    run = subprocess.run([sys.executable, str(BENCH), "--quick", "--gap-ms", "20",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    got = json.loads(out.read_text())["results"]
    router, rr, oracle = got["router"], got["round_robin"], got["oracle"]
    assert router["requests"] == rr["requests"] == oracle["requests"] > 50
    assert router["prompt_pages"] == rr["prompt_pages"]
    assert router["hit_rate"] > rr["hit_rate"] + 0.05, got
    assert router["hit_pages"] >= 0.95 * oracle["hit_pages"], got
    assert router["computed_tokens"] < rr["computed_tokens"]
    assert "router vs round robin" in run.stdout
