"""Figures the reliability suite prints at the end of the run (what was exercised)."""

from __future__ import annotations

from collections import defaultdict

FIGURES: dict[str, dict[str, float]] = defaultdict(dict)


def record(test: str, **values: float) -> None:
    FIGURES[test].update(values)
