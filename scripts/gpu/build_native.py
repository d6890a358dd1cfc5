"""Builds the native modules (setup.py's ``NATIVE``) with the C compiler alone, for the Python
that runs this script: no setuptools, no build isolation, nothing fetched. The GPU check uses it
on a machine without a package registry; its dry run uses it with Python 3.12 here.

Usage: python build_native.py [--dest DIR]   (default: next to the sources, as an in-place
build would put them). Each module is then loaded once to prove it imports; prints one line per
module and exits non-zero if any failed.
"""

from __future__ import annotations

import argparse
import ast
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = {"hicached": "daemon/hicached", "hicache": "clients/python/hicache"}


def native_table() -> list[tuple[str, list[str], list[str], list[str], list[str]]]:
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "NATIVE":
            return list(ast.literal_eval(node.value))
    raise SystemExit("setup.py has no NATIVE table")


def target_path(module: str, dest: Path | None) -> Path:
    top, *rest = module.split(".")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    rel = Path(*rest[:-1], rest[-1] + suffix)
    return (dest / top / rel) if dest else (REPO / PACKAGE_DIRS[top] / rel)


def build(module: str, sources: list[str], cflags: list[str], ldflags: list[str],
          out: Path) -> None:
    # the compiler Python was built with, if this host has it (a relocated build names one
    # that only existed where it was built), else the host's own
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")[:1]
    if not shutil.which(cc[0]):
        cc = ["cc"]
    include = sysconfig.get_paths()["include"]
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [*cc, "-shared", "-fPIC", f"-I{include}", *cflags,
           *(str(REPO / s) for s in sources), "-o", str(out), *ldflags]
    subprocess.run(cmd, check=True)


def load(module: str, path: Path) -> None:
    loader = importlib.machinery.ExtensionFileLoader(module, str(path))
    spec = importlib.util.spec_from_file_location(module, path, loader=loader)
    assert spec is not None
    loader.exec_module(importlib.util.module_from_spec(spec))  # type: ignore[arg-type]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", type=Path, default=None)
    args = p.parse_args()
    failed = 0
    for module, sources, _headers, cflags, ldflags in native_table():
        out = target_path(module, args.dest)
        t0 = time.monotonic()
        try:
            build(module, sources, cflags, ldflags, out)
            load(module, out)
        except (subprocess.CalledProcessError, ImportError, OSError) as exc:
            failed += 1
            print(f"FAILED {module}: {exc}")
            continue
        print(f"built {module} for Python {sys.version.split()[0]} in "
              f"{time.monotonic() - t0:.1f} s: {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
