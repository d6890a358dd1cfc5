"""What users install, run as they run it: hicached built from a clean copy of the checkout and
installed non-editable into environments of its own, never the checkout itself.

- The build (``tests.installed.BUILD``: the sdist, then the wheel from it, as the images build
  it): the wheel carries every module, stub and marker of every package under the source
  roots, byte for byte, and nothing else of ours, plus each native module setup.py builds;
  the sdist carries the C sources; a package added to the tree is in the next wheel unlisted.
- The image's install (a fresh environment, only the wheel and its dependencies, no torch):
  ``python -m hicached serve`` starts from it and answers, ``hicachectl status`` reads it, one
  Store / LoadKeys round trip through ``hicache_client`` lands the stored bytes in rows
  zeroed first, and every module of the daemon and the API package imports (the others
  import or miss only torch or an engine).
- The serve set-up (``scripts/setup.sh``'s ``setup_hicached`` on the clean copy, as
  ``bash scripts/serve.sh`` runs it): ``hicache-bench trace`` runs and its daemon column is
  the daemon's policy; ``hicache-bench compare`` and the throughput run, which need torch,
  say in one line what to install.
- An engine's environment (the test environment's engines, torch and their dependencies,
  without its hicached, then the README's ``pip install .`` from the clean copy): SGLang's
  external linker loads ``hicache_sglang.linker`` by the README's dotted path, vLLM's factories
  load ``hicache_vllm``'s spec and connector by the README's module paths, both from that
  environment's install, at the engine versions tested; every module of every package
  imports there.
- The images (``deploy/Containerfile*``) install what this module installs: the wheel that
  ``BUILD`` makes from a build context that is the clean copy (``.dockerignore``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.daemon_proc import start_daemon
from tests.installed import (
    BUILD,
    CARRIED_NAMES,
    CARRIED_SUFFIXES,
    NATIVE,
    REPO,
    SOURCE_ROOTS,
    Env,
    build,
    carried,
    clean_copy,
    packages,
    running_site,
)

pytestmark = pytest.mark.slow

ENGINE_INSTALL = ("pip", "install", ".")
"""The README's install line for an engine's environment, run in the clean copy."""

OURS = tuple(packages())
"""hicached's top-level packages, as setuptools finds them."""


@dataclass(frozen=True)
class Dists:
    src: Path
    """The clean copy the dists were built from."""
    sdist: Path
    wheel: Path


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Dists:
    root = tmp_path_factory.mktemp("dists")
    src = clean_copy(root / "src")
    sdist, wheel = build(src, root / "dist")
    return Dists(src, sdist, wheel)


@pytest.fixture(scope="module")
def wheel_env(dists: Dists, tmp_path_factory: pytest.TempPathFactory) -> Env:
    """A fresh environment with the wheel installed as the daemon's image installs it (at
    the versions tested: scripts/constraints.txt), nothing else."""
    env = Env.create(tmp_path_factory.mktemp("wheel-env") / "venv")
    done = env.run(["pip", "install", "-q", "-c", str(dists.src / "scripts/constraints.txt"),
                    str(dists.wheel)], cwd=dists.src, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return env


@pytest.fixture(scope="module")
def engine_env(dists: Dists, tmp_path_factory: pytest.TempPathFactory) -> Env:
    """An engine's environment: the test environment's packages (SGLang, torch, what they
    import) but none of hicached's, then hicached as the README installs it there."""
    env = Env.create(tmp_path_factory.mktemp("engine-env") / "venv")
    env.overlay([running_site()], keep_out=(*OURS, "hicached-", "hicached."))
    done = env.run([*ENGINE_INSTALL], cwd=dists.src, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return env


def _wheel_files(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as z:
        return {n: hashlib.sha256(z.read(n)).hexdigest() for n in z.namelist()
                if not n.endswith("/")}


def test_setuptools_finds_the_packages_nobody_lists_them() -> None:
    import tomllib

    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "packages" not in {k for k, v in tool.items() if isinstance(v, list)}
    assert tool["packages"]["find"] == {"where": list(SOURCE_ROOTS), "namespaces": False}
    assert "package-dir" not in tool


def test_the_wheel_carries_the_source_tree_and_nothing_else_of_ours(dists: Dists) -> None:
    files = _wheel_files(dists.wheel)
    want: dict[str, str] = {}
    for name in OURS:
        want.update(carried(dists.src / packages()[name].relative_to(REPO)))
    assert len(want) > 150 and "hicached/publish/kv_event_config.py" in want
    have = {n: h for n, h in files.items()
            if n.endswith((*CARRIED_SUFFIXES, *CARRIED_NAMES)) and ".dist-info/" not in n}
    assert "hicached/cuda/pages.cu" in want
    assert {n for n in want if n not in have} == set(), "missing from the wheel"
    assert {n for n in have if n not in want} == set(), "in the wheel, not in the source tree"
    assert [n for n in want if want[n] != have[n]] == []
    for module, _ in NATIVE:
        parts = module.split(".")
        pattern = re.compile(re.escape("/".join(parts)) + r"\.cpython-[^/]+\.so$")
        assert any(pattern.match(n) for n in files), f"{module} is not in the wheel"
    top = next(n for n in files if n.endswith(".dist-info/top_level.txt"))
    with zipfile.ZipFile(dists.wheel) as z:
        assert sorted(z.read(top).decode().split()) == sorted(OURS)
    entry = next(n for n in files if n.endswith(".dist-info/entry_points.txt"))
    with zipfile.ZipFile(dists.wheel) as z:
        scripts = z.read(entry).decode()
    for line in ("hicached = hicached.__main__:main", "hicachectl = hicache_client.cli:main",
                 "hicache-bench = hicache_bench.cli:main"):
        assert line in scripts


def test_the_sdist_carries_what_the_wheel_is_built_from(dists: Dists) -> None:
    import tarfile

    with tarfile.open(dists.sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    wanted = {"setup.py", "pyproject.toml", "README.md"}
    wanted |= {s for _, sources in NATIVE for s in sources}
    assert wanted - names == set()


def test_a_package_added_to_the_tree_is_in_the_next_wheel(tmp_path: Path) -> None:
    """Nobody lists packages: a new subpackage (the one a hand-kept list once left out)
    and a new top-level package under a source root are built into the wheel."""
    src = clean_copy(tmp_path / "src")
    for pkg in ("daemon/hicached/newsub", "tools/hicache_newtool"):
        (src / pkg).mkdir()
        (src / pkg / "__init__.py").write_text('"""added"""\n')
        (src / pkg / "mod.py").write_text("X = 1\n")
    out = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir",
                          str(tmp_path / "dist"), str(src)], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    files = _wheel_files(wheel)
    for name in ("hicached/newsub/__init__.py", "hicached/newsub/mod.py",
                 "hicache_newtool/__init__.py", "hicache_newtool/mod.py"):
        assert name in files


@pytest.fixture(scope="module")
def installed_daemon(wheel_env: Env, tmp_path_factory: pytest.TempPathFactory
                     ) -> Iterator[tuple[Env, str, int]]:
    """``python -m hicached serve`` of the wheel's environment, on a socket of its own."""
    work = tmp_path_factory.mktemp("installed-daemon")
    d = start_daemon(work, python=str(wheel_env.python), cwd=work)
    try:
        yield wheel_env, d.target, d.proc.pid
    finally:
        assert d.stop(signal.SIGTERM) == 0, d.log()[-3000:]


def test_the_installed_daemon_serves_from_its_own_environment(
        installed_daemon: tuple[Env, str, int], tmp_path: Path) -> None:
    env, target, pid = installed_daemon
    maps = Path(f"/proc/{pid}/maps").read_text()
    kernel = [ln.split()[-1] for ln in maps.splitlines() if "_copykernel" in ln]
    assert kernel and all(p.startswith(str(env.root)) for p in kernel), kernel
    assert "libtorch" not in maps
    status = env.run(["hicachectl", "--target", target, "--json", "status"], cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    got = json.loads(status.stdout)
    assert got["version"], got


ROUND_TRIP = r"""
import json, sys
import numpy as np
from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers

target, layout = sys.argv[1], Layout(sys.argv[2])
spec = PoolSpec(f"installed-{layout.value}", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 3, 2, 16),
                4, layout, size_tokens=64)
rng = np.random.default_rng(7)
with HiCacheClient(target) as c, ShmDeviceBuffers.create(spec, 32, sealed=True) as b:
    c.create_pool(spec)
    with c.open_session(spec.name, "installed", b.descriptors, fds=b.fds) as s:
        layers = [b.rows(d.member, d.role, d.layer) for d in b.descriptors]
        for rows in layers:
            rows[:] = rng.integers(0, 256, rows.shape, dtype=np.uint8)
        stored = [rows[:8].copy() for rows in layers]
        keys = [b"installed-0", b"installed-1"]
        assert s.store(keys, np.arange(8)).stored == 2
        for rows in layers:
            rows[16:24] = 0
        untouched = [rows[24:].copy() for rows in layers]
        s.load_keys(keys, np.arange(16, 24))
        wrong = [i for i, rows in enumerate(layers)
                 if not np.array_equal(rows[16:24], stored[i])
                 or not np.array_equal(rows[24:], untouched[i])]
        found = s.lookup(keys + [b"never"], 0)
    c.delete_pool(spec.name)
print(json.dumps({"buffers": len(layers), "wrong": wrong, "hit": int(found.hit_prefix),
                  "torch": "torch" in sys.modules}))
"""


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_store_and_load_through_the_installed_client_land_exact(
        installed_daemon: tuple[Env, str, int], tmp_path: Path, layout: str) -> None:
    env, target, _ = installed_daemon
    script = tmp_path / "round_trip.py"
    script.write_text(ROUND_TRIP)
    done = env.run([str(env.python), str(script), target, layout], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got == {"buffers": 6, "wrong": [], "hit": 2, "torch": False}


IMPORT_ALL = r"""
import importlib, json, pkgutil, sys
pre = sys.argv[2]
if pre:
    exec(pre)
out = {}
for top in sys.argv[1].split(","):
    pkg = importlib.import_module(top)
    names = [top] + [m.name for m in pkgutil.walk_packages(pkg.__path__, top + ".")
                     if not m.name.endswith(".__main__")]  # importing one runs its program
    for name in names:
        try:
            mod = importlib.import_module(name)
            out[name] = ["ok", getattr(mod, "__file__", "") or ""]
        except ModuleNotFoundError as exc:
            out[name] = ["missing", exc.name or ""]
        except Exception as exc:
            out[name] = ["error", f"{type(exc).__name__}: {exc}"[:300]]
print(json.dumps(out))
"""


def module_names() -> set[str]:
    """Every module of ours a wheel carries (not ``__main__``s), native ones included."""
    names = {module for module, _ in NATIVE}
    for src in packages().values():
        for path in carried(src):
            if path.endswith(".py") and not path.endswith("__main__.py"):
                names.add(path[:-3].replace("/", ".").removesuffix(".__init__"))
    return names


def _import_all(env: Env, cwd: Path, pre: str = "", **environ: str) -> dict[str, list[str]]:
    script = cwd / "import_all.py"
    script.write_text(IMPORT_ALL)
    done = env.run([str(env.python), str(script), ",".join(OURS), pre], cwd=cwd,
                   env=env.environ(**environ), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    got: dict[str, list[str]] = json.loads(done.stdout.splitlines()[-1])
    assert set(got) == module_names()
    return got


def test_every_module_imports_in_the_daemons_own_environment(wheel_env: Env,
                                                             tmp_path: Path) -> None:
    """No torch and no engine there: the daemon and the API package import whole; any other
    module either imports or misses only torch or its engine, never one of ours."""
    got = _import_all(wheel_env, tmp_path)
    assert {n: r for n, r in got.items() if r[0] == "ok"
            and not r[1].startswith(str(wheel_env.root))} == {}, "imported from elsewhere"
    for name, (how, what) in got.items():
        if name.split(".")[0] in ("hicached", "hicache"):
            assert how == "ok", (name, what)
        else:
            assert how == "ok" or (how == "missing" and what.split(".")[0]
                                   in ("torch", "sglang", "vllm")), (name, how, what)
    assert got["hicache_bench.trace"][0] == "ok" and got["hicache_bench.cli"][0] == "ok"


def test_every_module_imports_beside_the_engines(engine_env: Env, tmp_path: Path) -> None:
    from tests.vllm_runs import VLLM

    got = _import_all(engine_env, tmp_path,
                      "from tests.sglang_harness import install_stand_ins; install_stand_ins()",
                      PYTHONPATH=f"{VLLM}:{REPO}", VLLM_TARGET_DEVICE="cpu")
    bad = {n: r for n, r in got.items() if r[0] != "ok"}
    assert bad == {}
    assert {n: r[1] for n, r in got.items()
            if not r[1].startswith(str(engine_env.root))} == {}, "imported from elsewhere"


def test_the_sglang_linker_loads_by_the_readmes_dotted_path(engine_env: Env,
                                                          tmp_path: Path) -> None:
    """SGLang's own parser reads the README's ``sglang.launch_server`` line and its linker
    factory's way (import by ``linker_module_path``, a ``UnifiedCacheLinker`` subclass, not
    abstract) loads the class: from the engine environment's install of hicached."""
    import shlex

    readme = (REPO / "README.md").read_text()
    section = readme.split("## Use with SGLang", 1)[1]
    (block,) = re.findall(r"```bash\n(.*?)```", section.split("\n## ", 1)[0], re.S)
    argv = shlex.split(block.replace("\\\n", " "))
    argv = argv[argv.index("sglang.launch_server") + 1:]
    code = ("import json, sys, importlib, importlib.metadata as md\n"
            "from tests.sglang_harness import sglang_config_from_argv\n"
            "extra = sglang_config_from_argv(json.loads(sys.argv[1]))\n"
            "import hicache_sglang.linker as m\n"
            "print(json.dumps({'file': m.__file__, 'sglang': md.version('sglang'),"
            " 'hicached': md.distribution('hicached').locate_file('')}, default=str))")
    done = engine_env.run([str(engine_env.python), "-c", code, json.dumps(argv)],
                          cwd=tmp_path, env=engine_env.environ(PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["file"].startswith(str(engine_env.root)), got
    assert got["hicached"].startswith(str(engine_env.root)), got
    assert got["sglang"] == "0.5.23"


@pytest.mark.parametrize("vllm", ["0.33.0", "0.34.0"])
def test_the_vllm_spec_and_connector_load_by_the_readmes_module_paths(
        engine_env: Env, tmp_path: Path, vllm: str) -> None:
    """vLLM's own parser (each release served) reads the README's ``vllm serve`` line; its
    connector and offloading-spec factories load hicached's classes from the engine
    environment."""
    import shlex

    from tests.vllm_harness import model_dir
    from tests.vllm_runs import RELEASES, vllm_dir, vllm_env

    assert vllm in RELEASES

    readme = (REPO / "README.md").read_text()
    section = readme.split("## Use with vLLM", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, re.S)
    argv = shlex.split(block.replace("\\\n", " "))
    env = engine_env.environ(**{k: v for k, v in vllm_env(vllm).items()
                                if k in ("PYTHONPATH", "VLLM_TARGET_DEVICE", "HF_HUB_OFFLINE")})
    done = engine_env.run([str(engine_env.python), "-m", "tests.vllm_harness", "parse_serve",
                           json.dumps({"argv": argv, "model": str(model_dir(tmp_path))})],
                          cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    got = json.loads(line[len("RESULT "):])
    assert got["spec"] == "hicache_vllm.spec.HicachedOffloadingSpec"
    assert got["connector_class"] == "hicache_vllm.connector.HicachedOffloadingConnector"
    for key in ("spec_file", "connector_file"):
        assert got[key].startswith(str(engine_env.root)), got
    assert got["vllm"] == vllm and got["vllm_file"].startswith(str(vllm_dir(vllm))), got


@pytest.fixture(scope="module")
def serve_setup(dists: Dists) -> Env:
    """The clean copy's own ``.venv``, made by the set-up ``bash scripts/serve.sh`` runs
    before it serves (``setup_hicached``, no extras)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(["bash", "-c", ". scripts/setup.sh && setup_hicached"],
                          cwd=dists.src, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return Env(dists.src / ".venv")


def test_hicache_bench_trace_runs_after_the_serve_setup(serve_setup: Env,
                                                        tmp_path: Path) -> None:
    has_torch = serve_setup.run([str(serve_setup.python), "-c", "import torch"], cwd=tmp_path)
    assert has_torch.returncode != 0, "the serve set-up installs no torch"
    trace = tmp_path / "t.jsonl"
    requests = [[i % 7, 100 + i % 5, 1000 + i] for i in range(60)]
    trace.write_text("".join(json.dumps({"hash_ids": r}) + "\n" for r in requests))
    done = serve_setup.run(["hicache-bench", "trace", str(trace), "--capacity", "12,40",
                            "--memory-budget", "256MiB", "--json"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(ln) for ln in done.stdout.splitlines()]
    assert [r["blocks"] for r in rows] == [12, 40]
    for r in rows:
        assert r["daemon"] == pytest.approx(r["reuse"], abs=1e-12), r
    assert rows[1]["daemon"] > 0


@pytest.mark.parametrize("argv", [["compare", "HEAD"], ["--workers", "1"]])
def test_hicache_bench_says_in_one_line_what_a_torch_command_needs(
        serve_setup: Env, tmp_path: Path, argv: list[str]) -> None:
    done = serve_setup.run(["hicache-bench", *argv], cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert "torch" in line and "pip install" in line, line


def containerfile_stages(path: Path) -> list[tuple[str, list[str]]]:
    """(the ``FROM`` line, the instructions after it) per stage, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    stages: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append((line, []))
        else:
            stages[-1][1].append(line)
    return stages


CONTAINERFILES = sorted((REPO / "deploy").glob("Containerfile*"))


@pytest.mark.parametrize("path", CONTAINERFILES, ids=[p.name for p in CONTAINERFILES])
def test_each_image_installs_the_wheel_this_module_builds(path: Path) -> None:
    """A build stage copies the build context to /src and runs ``BUILD`` there; the image's
    own stage copies the wheel out of it and installs that wheel, and no other hicached."""
    stages = containerfile_stages(path)
    assert len(stages) == 2, "a build stage, then the image"
    (build_from, build_steps), (image_from, image_steps) = stages
    assert build_from.endswith(" AS build"), build_from
    base = build_from.split()[1]
    assert image_from.split()[1] == base, "the wheel is built on the image's own Python"
    line = " ".join(BUILD).format(dist="/dist", src="/src")
    assert "COPY . /src" in build_steps
    assert any(s.startswith("RUN ") and line in s for s in build_steps), line
    assert "COPY --from=build /dist /dist" in image_steps
    installs = [s for s in image_steps if "pip install" in s]
    assert installs and all("/dist/hicached-*.whl" in s for s in installs), installs
    assert not any(re.search(r"pip install[^&]*\s(\.|/src\S*)(\s|$)", s)
                   for s in build_steps + image_steps), "hicached installed from a tree"


def test_the_build_context_is_the_clean_copy() -> None:
    """What ``COPY . /src`` sends is what a clean clone has: .dockerignore (read by docker
    and podman alike) leaves out everything git ignores, and git's own directory."""
    ignored = {ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")}
    for ln in (REPO / ".gitignore").read_text().splitlines():
        if ln.strip() and not ln.startswith("#"):
            pattern = ln.strip().lstrip("/").rstrip("/")
            assert {pattern, f"**/{pattern}"} & ignored, f".dockerignore lacks {ln}"
    assert ".git" in ignored


def test_the_readme_installs_into_an_engine_as_this_module_does() -> None:
    readme = (REPO / "README.md").read_text()
    line = " ".join(ENGINE_INSTALL)
    for engine in ("## Use with SGLang", "## Use with vLLM"):
        section = readme.split(engine, 1)[1].split("\n## ", 1)[0]
        assert f"`{line}`" in section, f"{engine}: the install line is not `{line}`"
