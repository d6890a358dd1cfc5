"""Installing hicached: what `pip install` leaves behind, and whether each extra resolves.

- An install (``pip install .``, as the README tells SGLang and vLLM users) writes nothing into
  the checkout: its intermediate files (``build/``, ``*.egg-info``) go to a directory of the
  build's own (setup.py), and the native modules still come with it.
- Every extra of pyproject.toml resolves with pip's resolver in a fresh virtual environment
  (``pip install --dry-run --ignore-installed``): ``.[vllm]`` and ``.[sglang]`` bring the
  engine at a release hicached serves (``hicache.engines``: ``.[vllm]`` the newest, and an
  older one where it is asked for beside it), with everything that engine requires.
- The lists the tests install beside an engine's code (``--no-deps``, scripts/setup.sh) hold
  versions the engine's own requirements admit, so the tests run what a real install has.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

from hicache import engines
from hicache.errors import SpecInvalid
from tests.daemon_proc import REPO
from tests.installed import clean_copy

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
EXTRAS: dict[str, list[str]] = PROJECT["optional-dependencies"]
VLLM_TESTED = [x.tested for x in engines.lines("vllm")]
"""The vLLM releases the suite runs, oldest first."""


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_pip_install_leaves_the_checkout_as_it_was(tmp_path: Path) -> None:
    src = clean_copy(tmp_path / "src")
    before = _tree(src)
    site = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                          "--no-build-isolation", "--no-index", "--target", str(site),
                          str(src)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert _tree(src) == before, f"pip install wrote {sorted(_tree(src) - before)[:10]}"
    native = [p.name for p in site.rglob("*.so")]
    assert any(n.startswith("_copykernel") for n in native), native
    assert any(n.startswith("_poll") for n in native), native
    assert (site / "hicache_sglang" / "linker.py").is_file()
    assert (site / "hicache_vllm" / "spec.py").is_file()


def _requirement(line: str) -> tuple[str, str]:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    req = Requirement(line)
    pins = [s.version for s in req.specifier if s.operator == "=="]
    assert len(pins) == 1, f"{line}: an engine's test list pins one version"
    return canonicalize_name(req.name), pins[0]


def _engine_requirements(dist_info: Path) -> list[str]:
    lines = (dist_info / "METADATA").read_text().splitlines()
    return [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Requires-Dist:")]


TORCH = {"torch", "torchvision", "torchaudio"}
"""The tests run torch's CPU build (scripts/setup.sh); the engines pin their CUDA builds."""


def _seen(path: list[str]) -> dict[str, str]:
    """The version of each distribution an engine's process imports with ``path`` as its
    ``sys.path``: the first one found, as the import system finds it."""
    from importlib import metadata

    from packaging.utils import canonicalize_name

    out: dict[str, str] = {}
    for dist in metadata.distributions(path=path):
        out.setdefault(canonicalize_name(dist.metadata["Name"]), dist.version)
    return out


def _excluded(seen: dict[str, str], dist_info: Path) -> list[str]:
    """What an engine's process would import that the engine's own requirements (those that
    apply on this platform) exclude."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    bad = []
    for line in _engine_requirements(dist_info):
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in seen and name not in TORCH and not req.specifier.contains(
                seen[name], prereleases=True):
            bad.append(f"{name}=={seen[name]} (the engine requires {req})")
    return bad


def _dist_info(root: Path, name: str, version: str) -> Path:
    found = root / f"{name}-{version}.dist-info"
    if not found.is_dir():
        if os.environ.get("CI"):
            raise AssertionError(f"{found} is missing: scripts/setup.sh --test installs it")
        pytest.skip(f"{found} is missing (scripts/setup.sh --test)")
    return found


def _site_packages() -> list[str]:
    return [p for p in sys.path if p.endswith("site-packages")]


@pytest.mark.parametrize("version", VLLM_TESTED)
def test_vllm_runs_in_the_tests_on_versions_it_admits(version: str) -> None:
    """What the vLLM tests import beside each release's code (``.vllm-<release>/`` first,
    then the environment) is what a real ``pip install vllm==<release>`` could have
    installed."""
    root = REPO / f".vllm-{version}"
    seen = _seen([str(root), *_site_packages()])
    assert _excluded(seen, _dist_info(root, "vllm", version)) == []
    for name, pinned in map(_requirement, EXTRAS["vllm-cpu-test"]):
        assert seen.get(name) == pinned, f"{name}: {seen.get(name)} in the tests, {pinned} listed"


def test_sglang_runs_in_the_tests_on_versions_it_admits() -> None:
    """Likewise for SGLang, whose code and test list live in the environment."""
    (engine,) = EXTRAS["sglang"]
    _, version = _requirement(engine)
    site = _site_packages()
    seen = _seen(site)
    if "sglang" not in seen and not os.environ.get("CI"):
        pytest.skip("sglang is not installed (scripts/setup.sh --test)")
    found = [Path(p) / f"sglang-{version}.dist-info" for p in site]
    (dist_info,) = [d for d in found if d.is_dir()]
    assert _excluded(seen, dist_info) == []
    for name, pinned in map(_requirement, EXTRAS["sglang-cpu-test"]):
        assert seen.get(name) == pinned, f"{name}: {seen.get(name)} in the tests, {pinned} listed"


def test_the_engines_are_the_versions_the_tests_run() -> None:
    """The extras admit exactly the releases ``hicache.engines`` serves: every tested one,
    and no release of a line it does not list."""
    from packaging.requirements import Requirement

    assert EXTRAS["sglang"] == ["sglang==0.5.23"]
    assert [x.tested for x in engines.lines("sglang")] == ["0.5.23"]
    (line,) = EXTRAS["vllm"]
    spec = Requirement(line).specifier
    assert VLLM_TESTED == ["0.33.0", "0.34.0"]
    for version in [*VLLM_TESTED, "0.33.4", "0.34.2"]:
        assert spec.contains(version), version
    for version in ("0.32.9", "0.35.0", "1.0.0"):
        assert not spec.contains(version, prereleases=True), version
        with pytest.raises(SpecInvalid):
            engines.served("vllm", version)
    for engine in ("sglang", "vllm"):  # the engine itself never comes with a test list
        assert engine not in dict(map(_requirement, EXTRAS[f"{engine}-cpu-test"]))


RESOLVER_PIP = "pip==26.3"
"""The pip the extras resolve with: a current one, which reads a wheel's metadata from the
index (PEP 658 / 714) where the pip ``venv`` bundles downloads every wheel whole (the CUDA
build of torch among them): the same answer, 2-3x faster."""


@pytest.fixture(scope="module")
def resolver(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A new virtual environment with pip, and hicached's wheel built from a clean copy (its
    metadata is what ``pip install .`` reads; built once, not once per extra)."""
    root = tmp_path_factory.mktemp("resolver")
    venv.create(root / "venv", with_pip=True)
    python = root / "venv" / "bin" / "python"
    out = subprocess.run([str(python), "-m", "pip", "install", "-q", RESOLVER_PIP],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    src = clean_copy(root / "src")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                          "--no-build-isolation", "--no-index", "-w", str(root / "dist"),
                          str(src)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    (wheel,) = (root / "dist").glob("hicached-*.whl")
    return python, wheel


RESOLVES = [(extra, "") for extra in sorted(EXTRAS)] + [
    ("vllm", f"vllm=={v}") for v in VLLM_TESTED[:-1]]
"""Every extra as it is, and ``.[vllm]`` beside each older vLLM release served (a user who
stays on it)."""


@pytest.mark.slow
@pytest.mark.parametrize("extra, beside", RESOLVES,
                         ids=[f"{e}+{b}" if b else e for e, b in RESOLVES])
def test_every_extra_resolves_in_a_fresh_environment(resolver: tuple[Path, Path],
                                                     tmp_path: Path, extra: str,
                                                     beside: str) -> None:
    """pip's own resolver, in a new virtual environment, over the configured index: what a
    user's ``pip install ".[extra]"`` resolves (a dry run: nothing is installed); ``.[vllm]``
    to the newest vLLM served, and to an older one asked for beside it."""
    python, wheel = resolver
    report = tmp_path / "report.json"
    out = subprocess.run([str(python), "-m", "pip", "install", "-q", "--dry-run",
                          "--ignore-installed", "--report", str(report), f"{wheel}[{extra}]",
                          *([beside] if beside else [])],
                         capture_output=True, text=True, timeout=1500, cwd=tmp_path)
    assert out.returncode == 0, f".[{extra}] {beside} does not resolve:\n{out.stderr[-4000:]}"
    from packaging.utils import canonicalize_name

    chosen: dict[str, str] = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
                              for i in json.loads(report.read_text())["install"]}
    for line in [*EXTRAS[extra], *([beside] if beside else [])]:
        name, version = _requirement(line) if "==" in line else (line, "")
        if version:
            assert chosen.get(name) == version, (line, chosen.get(name))
    if extra == "vllm":  # a release served (which one: the next test)
        engines.served("vllm", chosen["vllm"])


MISSING = re.compile(r"No matching distribution found for ([A-Za-z0-9_.\-]+)==([^\s)]+)")


def _dry_run(python: Path, reqs: list[str], cwd: Path, links: Path
             ) -> tuple[int, str, dict[str, str]]:
    """pip's resolution of ``reqs`` (a dry run, the configured index and ``links``): exit
    status, stderr, and each distribution chosen with its version."""
    from packaging.utils import canonicalize_name

    report = cwd / "report.json"
    report.unlink(missing_ok=True)
    out = subprocess.run([str(python), "-m", "pip", "install", "-q", "--dry-run",
                          "--ignore-installed", "--find-links", str(links), "--report",
                          str(report), *reqs], capture_output=True, text=True, timeout=1500,
                         cwd=cwd)
    chosen: dict[str, str] = (
        {str(canonicalize_name(i["metadata"]["name"])): str(i["metadata"]["version"])
         for i in json.loads(report.read_text())["install"]} if out.returncode == 0 else {})
    return out.returncode, out.stderr, chosen


def _stand_in(links: Path, name: str, version: str) -> None:
    """A metadata-only wheel of ``name`` ``version`` (no files, no requirements) in
    ``links``, for a resolution that needs a distribution the index lacks."""
    import zipfile

    dist = f"{re.sub(r'[-.]+', '_', name)}-{version}"
    info = f"{dist}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hicached-tests\n"
                              "Root-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(links / f"{dist}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


@pytest.mark.slow
def test_the_vllm_extra_takes_the_newest_vllm_served(resolver: tuple[Path, Path],
                                                     tmp_path: Path) -> None:
    """``.[vllm]`` resolves to the newest vLLM served, asked for by name beside it and on its
    own. Where the configured index lacks a distribution that vLLM itself pins (a mirror may:
    one this suite ran on had no flashinfer-python 0.7.3, which vLLM 0.34.0 requires, so that
    ``pip install vllm==0.34.0`` failed there without hicached too), the failure is checked
    to be vLLM's own (vLLM alone fails alike), and a metadata-only wheel of that name and
    version stands in for it, for the resolution only (a dry run: nothing is installed)."""
    python, wheel = resolver
    newest = VLLM_TESTED[-1]
    links = tmp_path / "links"
    links.mkdir()
    stood_in: list[str] = []
    for _ in range(4):
        rc, err, chosen = _dry_run(python, [f"{wheel}[vllm]", f"vllm=={newest}"], tmp_path,
                                   links)
        if rc == 0:
            break
        missing = MISSING.search(err)
        assert missing, f".[vllm] vllm=={newest} does not resolve:\n{err[-4000:]}"
        alone, alone_err, _ = _dry_run(python, [f"vllm=={newest}"], tmp_path, links)
        assert alone != 0 and missing.group(0) in alone_err, (
            f"vLLM {newest} alone resolves; with hicached it does not:\n{err[-4000:]}")
        _stand_in(links, missing.group(1), missing.group(2))
        stood_in.append(missing.group(0))
    assert chosen.get("vllm") == newest, (chosen.get("vllm"), stood_in)
    print(f"vLLM {newest} resolves beside hicached; the index lacked, and a metadata-only "
          f"wheel stood in for: {', '.join(stood_in) or 'nothing'}")
    rc, err, chosen = _dry_run(python, [f"{wheel}[vllm]"], tmp_path, links)
    assert rc == 0, err[-4000:]
    assert chosen.get("vllm") == newest, (chosen.get("vllm"), stood_in)
