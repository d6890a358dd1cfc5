"""Figures the reliability suite prints at the end of the run (what was exercised).

``record(test, **values)`` keeps them in this process and, where the run has a shared
directory (``HICACHE_TEST_RUN_DIR``, set by tests/conftest.py for every process of the run:
pytest-xdist's workers too), writes them there; ``collected()`` reads every process's."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

FIGURES: dict[str, dict[str, float]] = defaultdict(dict)

RUN_DIR_ENV = "HICACHE_TEST_RUN_DIR"


def record(test: str, **values: float) -> None:
    FIGURES[test].update(values)
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir:
        with (Path(run_dir) / f"figures-{os.getpid()}.jsonl").open("a") as f:
            f.write(json.dumps({"test": test, "values": values}) + "\n")


def collected() -> dict[str, dict[str, float]]:
    """This process's figures and every other process's of the run."""
    found: dict[str, dict[str, float]] = defaultdict(dict)
    for test, values in FIGURES.items():
        found[test].update(values)
    run_dir = os.environ.get(RUN_DIR_ENV)
    for path in sorted(Path(run_dir).glob("figures-*.jsonl")) if run_dir else ():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            found[row["test"]].update(row["values"])
    return found
