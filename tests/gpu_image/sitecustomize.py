"""Makes this interpreter see only what the GPU machine's image holds (plus the carried wheels).

Put on ``PYTHONPATH`` by tests/repo/test_gpu_check.py, so every process of a run (pytest, the
daemon, workers) loads it: ``HICACHE_IMAGE_BLOCKED`` names a file listing, one per line, the
real paths of installed files whose distribution is neither in the image nor carried, and
(``dist:<name>``) those distributions; importing one raises ``ModuleNotFoundError`` as it would
there, and availability probes (``importlib.util.find_spec``, ``importlib.metadata``'s
``distribution`` / ``version``, as transformers' ``is_*_available`` use) find nothing, as
there. Each refused import is appended to ``HICACHE_IMAGE_REFUSED`` (``module<TAB>path``):
optional imports show up there too.
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


def _hide(names: frozenset[str]) -> None:
    """Probes find nothing blocked, as where it is not installed: ``importlib.util.find_spec``
    answers None (the finder's refusal is for imports), ``importlib.metadata.distribution``
    (and so ``version``) raises ``PackageNotFoundError``."""
    import importlib.metadata as md
    import importlib.util
    import re

    probe = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> ModuleSpec | None:
        try:
            return probe(name, package)
        except ModuleNotFoundError as exc:
            if "(not on the GPU image)" in str(exc):
                return None
            raise

    importlib.util.find_spec = find_spec

    found = md.distribution

    def distribution(name: str) -> md.Distribution:
        if re.sub(r"[-_.]+", "-", name).lower() in names:
            raise md.PackageNotFoundError(name)
        return found(name)

    md.distribution = distribution  # type: ignore[assignment]


def _install() -> None:
    listing = os.environ.get("HICACHE_IMAGE_BLOCKED")
    if not listing:
        return
    with open(listing) as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
    names = frozenset(ln[len("dist:"):] for ln in lines if ln.startswith("dist:"))
    blocked = frozenset(ln for ln in lines if not ln.startswith("dist:"))
    _hide(names)
    sys.meta_path.insert(0, ImageOnlyFinder(blocked, os.environ.get("HICACHE_IMAGE_REFUSED", "")))


_install()
