"""README.md works as written: its worker example runs unchanged against a daemon started with
no flags but where it keeps its files (its default socket found through ``XDG_RUNTIME_DIR``,
as the example's ``HiCacheClient()`` finds it), quickly and in little memory, and prints the
refusal it shows; ``hicached --help`` lists the commands; the hicachectl list is complete."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.daemon_proc import REPO, start_daemon

PEAK = ("import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__'); "
        "print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')), "
        "file=sys.stderr)")


def worker_example() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## A worker"):]
    start = section.index("```python") + len("```python")
    return section[start:section.index("```", start)]


@pytest.mark.alone  # its time is bounded: beside three test processes it measures them
def test_the_worker_example_runs_unchanged(tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    (runtime / "hicached").mkdir(parents=True, mode=0o700)
    runtime.chmod(0o700)
    d = start_daemon(tmp_path, socket=str(runtime / "hicached" / "hicached.sock"))
    try:
        script = tmp_path / "example.py"
        script.write_text(worker_example())
        env = {"PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": str(runtime), "HOME": str(tmp_path)}
        t0 = time.monotonic()
        # the script runs as it is; then its interpreter reports its own peak (VmHWM: this
        # process image's, where ru_maxrss would carry over the forking test process's)
        p = subprocess.run([sys.executable, "-c", PEAK, str(script)], capture_output=True,
                           text=True, timeout=60, cwd=tmp_path, env=env)
        took = time.monotonic() - t0
        out, err = p.stdout, p.stderr
        assert p.returncode == 0, out + err
        rss_mib = int(err.strip().splitlines()[-1].split()[1]) / 1024
        assert out.startswith("INDICES_NOT_PAGE_ALIGNED"), out
        print(f"README example: {took:.2f} s, max RSS {rss_mib:.0f} MiB")
        # 2.7-3.7 s measured on a quiet 2-vCPU machine (the target: < 5 s); 5.2 s once
        # right behind tests whose processes were still exiting, 8.1 s once beside three test
        # processes (it runs alone since): the bound leaves a slower machine room
        assert took < 8, f"the README example took {took:.1f} s"
        assert rss_mib < 1024, f"the README example used {rss_mib:.0f} MiB"
        # its pages went back: the pool holds no raw pages afterwards, and a second run works
        r2 = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=60, cwd=tmp_path, env=env)
        assert r2.returncode == 0, r2.stderr
        from hicache_client import HiCacheClient

        with HiCacheClient(d.target) as c:
            assert c.get_pool("readme-llama-8b-tp0").raw_pages == 0
    finally:
        d.stop(signal.SIGTERM)


def test_hicached_help_lists_its_commands() -> None:
    r = subprocess.run([sys.executable, "-m", "hicached", "--help"], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0 and "serve" in r.stdout and "hicachectl" in r.stdout, r.stdout


def test_the_readme_and_operations_name_every_hicachectl_command() -> None:
    from hicache_client.cli import parser

    verbs = set(parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr, arg-type]
    readme = (REPO / "README.md").read_text()
    ops = (REPO / "docs" / "operations.md").read_text()
    table = set(re.findall(r"^\| `([a-z-]+)", ops[ops.index("| verb |"):], re.M))
    assert verbs - table == set(), "docs/operations.md misses"
    assert {v for v in verbs if f"`{v}`" not in readme} == set(), "README.md misses"


def _slugs(markdown: str) -> set[str]:
    """GitHub's anchors of a file's headings (outside code blocks)."""
    out, fenced = set(), False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_every_link_of_the_readme_leads_somewhere() -> None:
    """The first screen's table points into docs/ and the benchmarks: each file it names
    exists and each anchor is a heading there."""
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert len(links) >= 20
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        target = REPO / path if path else REPO / "README.md"
        assert target.exists(), f"README.md links to {path}, which is not there"
        if anchor:
            assert anchor in _slugs(target.read_text()), f"{link}: no such heading"
    head = readme[:readme.index("## Fresh-machine commands")]
    assert "bash scripts/serve.sh" in head and "bash scripts/test.sh" in head
    assert len(head.splitlines()) <= 40, "the first screen stays a screen"


def test_the_feature_table_has_one_short_line_per_row() -> None:
    """What each part is and where to read: figures and caveats live in RESULTS.md."""
    readme = (REPO / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| ")][2:]
    assert len(rows) >= 10
    for row in rows:
        what = row.split(" | ")[1]
        assert len(what) <= 100, f"{row.split(' | ')[0]}: {len(what)} characters"
