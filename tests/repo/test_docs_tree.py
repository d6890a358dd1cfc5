"""The docs name the tree as it is: every module of the daemon, the Python clients and the tools
appears at its own path in docs/architecture.md's layer tree, every subpackage of ``hicached``
in the package's own docstring, and every module of a package in that package's docstring (a
module added without its line, or a package described as it once was, fails)."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import hicached
from tests.daemon_proc import REPO

ARCHITECTURE = (REPO / "docs" / "architecture.md").read_text()


def tracked(pattern: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", pattern], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    return [Path(p) for p in out.split()]


def architecture_paths() -> set[str]:
    """The files of architecture.md's tree (its first code block), by their full path: a name's
    indentation says which folder above it holds it."""
    tree = ARCHITECTURE.split("```")[1]
    folders: list[tuple[int, str]] = []
    paths: set[str] = set()
    for line in tree.splitlines():
        m = re.match(r"^( *)([\w./-]+?)(/?)(?:\s{2,}|$)", line)
        if not m or not m.group(2):
            continue
        depth = len(m.group(1))
        while folders and folders[-1][0] >= depth:
            folders.pop()
        path = f"{folders[-1][1]}/{m.group(2)}" if folders else m.group(2)
        if m.group(3):
            folders.append((depth, path))
        else:
            paths.add(path)
    return paths


def test_every_module_has_its_line_in_the_architecture() -> None:
    modules = [p for p in tracked("daemon/hicached/*.py") + tracked("clients/python/*.py")
               + tracked("tools/*.py") if p.name != "__init__.py" and "_pb2" not in p.name]
    assert len(modules) > 100
    named = architecture_paths()
    missing = [str(p) for p in modules if str(p) not in named]
    assert not missing, f"docs/architecture.md does not name at their paths: {missing}"


def packages() -> list[Path]:
    return [p.parent for p in tracked("daemon/hicached/*__init__.py")
            + tracked("clients/python/*__init__.py") + tracked("tools/*__init__.py")
            if "v1" not in p.parts]


def test_each_packages_docstring_names_its_modules() -> None:
    """``name`` or ``package.name`` for each module of the package (not its ``__main__``)."""
    missing = []
    for pkg in packages():
        doc = ast.get_docstring(ast.parse((REPO / pkg / "__init__.py").read_text())) or ""
        for mod in sorted(p.stem for p in (REPO / pkg).glob("*.py")):
            if mod.startswith("__"):
                continue
            if f"``{mod}``" not in doc and f"``{pkg.name}.{mod}``" not in doc:
                missing.append(f"{pkg}/{mod}.py")
    assert not missing, f"a package's docstring does not name its modules: {missing}"


def test_the_package_docstring_names_every_subpackage() -> None:
    root = REPO / "daemon" / "hicached"
    subpackages = sorted(p.parent.name for p in root.glob("*/__init__.py"))
    assert "service" in subpackages and "frontends" in subpackages
    doc = hicached.__doc__ or ""
    missing = [s for s in subpackages if f"``{s}``" not in doc]
    assert not missing, f"hicached's docstring does not name: {missing}"
