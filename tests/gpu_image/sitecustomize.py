"""Makes this interpreter see only what the GPU machine's image holds (plus the carried wheels).

Put on ``PYTHONPATH`` by tests/test_gpu_check.py, so every process of a run (pytest, the
daemon, workers) loads it: ``HICACHE_IMAGE_BLOCKED`` names a file listing, one per line, the
real paths of installed files whose distribution is neither in the image nor carried; importing
one raises ``ModuleNotFoundError`` as it would there. Each refused import is appended to
``HICACHE_IMAGE_REFUSED`` (``module<TAB>path``): optional imports show up there too.
"""

from __future__ import annotations

import os
import sys
from importlib.machinery import ModuleSpec
from typing import Any


class ImageOnlyFinder:
    """Asks the other finders, then refuses a module that lives in a blocked file."""

    def __init__(self, blocked: frozenset[str], refused_log: str) -> None:
        self.blocked = blocked
        self.refused_log = refused_log

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec: ModuleSpec | None = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        origin = spec.origin
        if origin and os.path.realpath(origin) in self.blocked:
            if self.refused_log:
                with open(self.refused_log, "a") as f:
                    f.write(f"{name}\t{origin}\n")
            raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU image)",
                                      name=name)
        return spec


def _install() -> None:
    listing = os.environ.get("HICACHE_IMAGE_BLOCKED")
    if not listing:
        return
    with open(listing) as f:
        blocked = frozenset(line.rstrip("\n") for line in f if line.strip())
    sys.meta_path.insert(0, ImageOnlyFinder(blocked, os.environ.get("HICACHE_IMAGE_REFUSED", "")))


_install()
