"""Figures the reliability suite prints at the end of the run (what was exercised).

``record(test, **values)`` writes them into the run's shared directory (``RUN_DIR_ENV``, set
by tests/conftest.py for every process of the run: pytest-xdist's workers too), one file per
process; ``collected()`` reads every process's."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

RUN_DIR_ENV = "HICACHE_TEST_RUN_DIR"


def record(test: str, **values: float) -> None:
    with (Path(os.environ[RUN_DIR_ENV]) / f"figures-{os.getpid()}.jsonl").open("a") as f:
        f.write(json.dumps({"test": test, "values": values}) + "\n")


def collected() -> dict[str, dict[str, float]]:
    """Every process's figures of this run."""
    found: dict[str, dict[str, float]] = defaultdict(dict)
    for path in sorted(Path(os.environ[RUN_DIR_ENV]).glob("figures-*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            found[row["test"]].update(row["values"])
    return found
