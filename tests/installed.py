"""hicached as users get it: built from a clean copy of the checkout, installed non-editable
into environments of its own; and whether the test environment's install is the checkout.

Primitives:

- ``SOURCE_ROOTS``: the directories whose packages hicached ships (pyproject.toml has
  setuptools find them there); ``packages()``: each top-level package and its source
  directory; ``NATIVE``: the native modules setup.py builds.
- ``carried(pkg_dir)``: {path in the package: sha256} of the files a wheel carries from a
  package directory (modules, stubs, ``py.typed``), as the source tree has them.
- ``clean_copy(dest)``: the checkout as a fresh clone has it (tracked files and untracked ones
  git does not ignore), copied to ``dest``.
- ``BUILD``: the command that builds the sdist and, from it, the wheel; the images run the
  same (``deploy/Containerfile*``); ``build(src, out)`` runs it: (sdist, wheel).
- ``Env``: a fresh virtual environment (``Env.create(path)``), its ``python``, ``bin(name)``,
  ``site`` and ``run(...)``; ``Env.overlay(site_dirs)`` makes another environment's packages
  importable after its own, but for hicached's (an engine's environment without setting the
  engine up again).
- ``drift()``: where the hicached packages this interpreter imports differ from the
  checkout's sources (a stale non-editable install); empty when they are the same or are the
  checkout itself.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCE_ROOTS = ("daemon", "clients/python", "tools")


def _native() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """setup.py's ``NATIVE`` (read as a literal: setup.py is not importable): (module, its
    C sources and headers)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "NATIVE":
            entries = ast.literal_eval(node.value)
            return tuple((name, (*sources, *headers))
                         for name, sources, headers, _, _ in entries)
    raise AssertionError("setup.py has no NATIVE")


NATIVE = _native()
CARRIED_SUFFIXES = (".py", ".pyi", ".cu")
CARRIED_NAMES = ("py.typed",)


def packages() -> dict[str, Path]:
    """Top-level package -> its directory in the checkout (every directory with an
    ``__init__.py`` right under a source root)."""
    out: dict[str, Path] = {}
    for root in SOURCE_ROOTS:
        for init in sorted((REPO / root).glob("*/__init__.py")):
            assert init.parent.name not in out, f"{init.parent.name} is in two source roots"
            out[init.parent.name] = init.parent
    return out


def carried(pkg_dir: Path) -> dict[str, str]:
    """{path relative to the package's parent: sha256} of the files a wheel carries from
    ``pkg_dir`` and its subpackages (directories with an ``__init__.py``)."""
    out: dict[str, str] = {}
    for path in sorted(pkg_dir.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        if not (path.suffix in CARRIED_SUFFIXES or path.name in CARRIED_NAMES):
            continue
        if not all((d / "__init__.py").is_file()
                   for d in [path.parent, *path.parent.parents]
                   if d == pkg_dir or pkg_dir in d.parents):
            continue  # a directory that is no package (csrc/) is not carried
        out[str(path.relative_to(pkg_dir.parent))] = hashlib.sha256(path.read_bytes()
                                                                    ).hexdigest()
    return out


def clean_copy(dest: Path) -> Path:
    """The checkout's tracked and not-ignored files, as they are now, copied to ``dest``."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():  # a deleted file not yet staged is listed, but gone
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


BUILD = ("python", "-m", "build", "--outdir", "{dist}", "{src}")
"""The sdist, then the wheel built from the sdist (``build``'s default: what the sdist lacks,
the wheel lacks too), in isolated build environments. ``deploy/Containerfile*`` run this line
with /dist and /src."""


def build(src: Path, out: Path) -> tuple[Path, Path]:
    """``BUILD`` over ``src`` into ``out``: (the sdist, the wheel)."""
    argv = [sys.executable if a == "python" else a.format(dist=out, src=src) for a in BUILD]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=src.parent)
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stdout[-3000:]}" \
                                 f"\n{done.stderr[-3000:]}"
    (sdist,) = out.glob("hicached-*.tar.gz")
    (wheel,) = out.glob("hicached-*.whl")
    return sdist, wheel


def _site_of(python: Path) -> Path:
    got = subprocess.run([str(python), "-c", "import sysconfig; "
                          "print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(got.stdout.strip())


@dataclass(frozen=True)
class Env:
    root: Path

    @classmethod
    def create(cls, root: Path) -> Env:
        """A new virtual environment with pip and nothing else (no system packages)."""
        venv.create(root, with_pip=True, symlinks=True)
        return cls(root)

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def bin(self, name: str) -> Path:
        return self.root / "bin" / name

    @property
    def site(self) -> Path:
        return _site_of(self.python)

    def environ(self, **extra: str) -> dict[str, str]:
        """This process's environment without what would reach past the environment: no
        ``PYTHONPATH`` unless given, the environment's bin first on ``PATH``."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env["PATH"] = f"{self.root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(self.root)
        env.update(extra)
        return env

    def run(self, argv: list[str], *, cwd: Path, timeout: float = 600, env: dict[str, str]
            | None = None) -> subprocess.CompletedProcess[str]:
        """``argv`` (its first word a command of this environment's bin, or a path) run in
        ``cwd`` with this environment's ``environ()`` (or ``env``)."""
        exe = argv[0] if os.sep in argv[0] else str(self.bin(argv[0]))
        return subprocess.run([exe, *argv[1:]], cwd=cwd, env=env or self.environ(),
                              capture_output=True, text=True, timeout=timeout)

    def overlay(self, site_dirs: list[Path], keep_out: tuple[str, ...]) -> Path:
        """Make every entry of ``site_dirs`` importable after this environment's own
        packages, but those whose name starts with one of ``keep_out`` (and any editable
        install's hooks): a directory of links, named by a ``.pth`` file. ``.pth`` files of
        the linked directories are not run, so nothing of theirs comes before this
        environment's packages. Returns the directory."""
        links = self.root / "overlay"
        links.mkdir()
        for site in site_dirs:
            for entry in sorted(site.iterdir()):
                name = entry.name
                if (name.startswith(keep_out) or name.startswith("__editable__")
                        or name.endswith(".pth") or (links / name).exists()):
                    continue
                (links / name).symlink_to(entry)
        (self.site / "zz-overlay.pth").write_text(f"{links}\n")
        return links


def running_site() -> Path:
    """The site-packages directory of the environment the tests run in."""
    return Path(sysconfig.get_paths()["purelib"])


def drift() -> list[str]:
    """Where the hicached packages this interpreter finds differ from the checkout: each
    package installed elsewhere than its source directory is compared file by file with it
    (modules, stubs, ``py.typed``), and its native modules must be newer than their C
    sources. One line per difference; empty when the install is the checkout's."""
    out: list[str] = []
    for name, src in packages().items():
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            out.append(f"{name} is not installed")
            continue
        where = Path(next(iter(spec.submodule_search_locations))).resolve()
        if where == src.resolve():
            continue  # the checkout itself (an editable install, or PYTHONPATH)
        want, have = carried(src), carried(where)
        for path in sorted(want.keys() | have.keys()):
            if path not in have:
                out.append(f"{path}: in the checkout, not installed")
            elif path not in want:
                out.append(f"{path}: installed, not in the checkout")
            elif want[path] != have[path]:
                out.append(f"{path}: differs from the checkout")
        for module, sources in NATIVE:
            if module.split(".")[0] != name:
                continue
            parts = module.split(".")
            built = sorted(where.joinpath(*parts[1:-1]).glob(f"{parts[-1]}.*.so"))
            newest = max((REPO / s).stat().st_mtime for s in sources)
            if built and built[0].stat().st_mtime < newest:
                out.append(f"{module}: its C sources changed after it was built")
    return out
