"""The docs name the tree as it is: every module of the daemon and the Python clients appears
in docs/architecture.md's layer tree, and every subpackage of ``hicached`` in the package's own
docstring (a module added without its line, or a package described as it once was, fails)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import hicached
from tests.daemon_proc import REPO

ARCHITECTURE = (REPO / "docs" / "architecture.md").read_text()


def tracked(pattern: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", pattern], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    return [Path(p) for p in out.split()]


def test_every_module_has_its_line_in_the_architecture() -> None:
    modules = [p for p in tracked("daemon/hicached/*.py") + tracked("clients/python/*.py")
               if p.name != "__init__.py" and "_pb2" not in p.name]
    assert len(modules) > 100
    missing = [str(p) for p in modules if p.name not in ARCHITECTURE]
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_the_package_docstring_names_every_subpackage() -> None:
    root = REPO / "daemon" / "hicached"
    subpackages = sorted(p.parent.name for p in root.glob("*/__init__.py"))
    assert "service" in subpackages and "frontends" in subpackages
    doc = hicached.__doc__ or ""
    missing = [s for s in subpackages if f"``{s}``" not in doc]
    assert not missing, f"hicached's docstring does not name: {missing}"
