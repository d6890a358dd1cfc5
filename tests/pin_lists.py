"""The repository's version lists as tests read them: scripts/constraints.txt and the GPU
check's scripts/gpu/{wheels,image-packages}.txt, one ``name==version  # comment`` per line.

Primitives: ``norm(name)`` (a distribution name as PEP 503 normalises it);
``listing(path)`` (name -> (pinned version or None, the line's comment), each name once);
``GPU`` (scripts/gpu); ``WHEELS`` (the GPU check's carried wheels); ``IMAGE`` (the packages the
GPU machine's image holds).
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.daemon_proc import REPO

GPU = REPO / "scripts" / "gpu"


def norm(name: str) -> str:
    """A distribution name normalised (PEP 503): lower case, runs of ``-_.`` one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def listing(path: Path) -> dict[str, tuple[str | None, str]]:
    """name -> (pinned version or None, the line's comment); a name listed twice fails."""
    out: dict[str, tuple[str | None, str]] = {}
    for raw in path.read_text().splitlines():
        line, _, comment = raw.partition("#")
        line = line.strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        assert norm(name) not in out, f"{path.name}: {name} listed twice"
        out[norm(name)] = (version or None, comment.strip())
    return out


IMAGE = listing(GPU / "image-packages.txt")
WHEELS = listing(GPU / "wheels.txt")
