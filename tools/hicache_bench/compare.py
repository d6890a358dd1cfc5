"""``hicache-bench compare BASE``: the data calls' latency of a base revision and this tree, side
by side in one run.

BASE (any git revision) is checked out in a temporary worktree beside the checkout, the head
(the working tree, or ``--head REV``) copied or checked out beside it, and the native modules
of each built there (the checkout itself is never written to); both trees then run the same
latency run (``latency.py``, this tree's copy, under each tree's own Python path: the same
interpreter and installed dependencies, each tree's sources and native modules), interleaved:
every round runs each path once per tree, a fresh daemon each time, the tree that goes first
alternating by round. The worktrees and every temporary file are removed at the end, also on
failure, Ctrl-C or SIGTERM (each run is a process group of its own, killed whole when
interrupted).

Primitives:

- ``Tree``: a source tree to measure (``path``, ``label``, ``env()``: its Python path).
- ``checkout(repo, rev, where)``: a detached worktree of ``rev`` with its native modules
  built in place; ``working_tree(repo, where)``: a copy of the working tree, built likewise;
  ``remove(repo, tree)`` takes either away.
- ``measure(trees, rounds, calls, paths, ops, pages, runner)``: the interleaved runs; samples
  per (path, op) and tree, one list of call latencies per round.
- ``summarize(samples, base, head)``: per path and op the two medians (of every call of every
  round), each one's spread (half the range of its per-round medians, in percent of the
  median), the ratio head / base and its 90 % interval (``ratio_interval``): ``Row``.
- ``ratio_interval(base_rounds, head_rounds)``: over rounds, the unit that varies (each round
  is a fresh daemon process, and a process settles in its own regime: where its threads run,
  which poll window it ends in), paired as they ran (a round runs both trees back to back,
  so what drifts with time cancels): Student's t interval of the mean log ratio of the
  round medians. An interval that holds 1 says the two trees are not told apart by this
  run; ``verdict`` names it.
- ``main(argv)``: ``hicache-bench compare BASE [--rounds N] [--calls N] [--json]
  [--paths ...] [--ops ...] [--pages ...] [--head REV] [--repo DIR] [--max-ratio R]``;
  ``--json`` prints one object per line (keys ``path``, ``op``, ``base_us``, ``head_us``,
  ``ratio``, and ``page``, ``base_spread_pct``, ``head_spread_pct``, ``base``, ``head``).
  Exit status 1 when ``--max-ratio`` is given and a ratio exceeds it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from hicache_bench import latency as bench_latency


@dataclass(frozen=True)
class Tree:
    path: Path
    """The tree's root (``daemon/``, ``clients/python/``, ``tools/`` under it)."""
    label: str
    """What the report calls it: a short commit id, or ``working tree``."""

    def env(self) -> dict[str, str]:
        """This process's environment with the tree's packages first on the Python path (and
        nothing of another tree's)."""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = os.pathsep.join(str(self.path / p)
                                            for p in ("daemon", "clients/python", "tools", "."))
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        return env


@dataclass(frozen=True)
class Row:
    path: str
    op: str
    """``<op>@<page>``, e.g. ``store_64@large``."""
    page: str
    base_us: float
    head_us: float
    ratio: float
    """head / base of the medians: above 1 the head is slower."""
    base_spread_pct: float
    head_spread_pct: float
    ratio_lo: float = 0.0
    """The low end of the ratio's 90 % interval (``ratio_interval``)."""
    ratio_hi: float = 0.0
    """Its high end."""

    @property
    def verdict(self) -> str:
        """``slower`` / ``faster`` when the whole interval is above / below 1, else ``even``
        (what this run cannot tell apart)."""
        return "slower" if self.ratio_lo > 1 else "faster" if self.ratio_hi < 1 else "even"


_T90 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782,
        1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711,
        1.708, 1.706, 1.703, 1.701, 1.699, 1.697)
"""Student's t for a two-sided 90 % interval, by degrees of freedom 1-30 (1.645 beyond)."""


def ratio_interval(base_rounds: list[list[float]], head_rounds: list[list[float]]
                   ) -> tuple[float, float]:
    """The 90 % interval of head/base from the rounds paired as they ran (round r of each
    tree ran back to back): the mean of log(head median / base median) over rounds, plus or
    minus Student's t times its standard error. One round: no interval (0, inf)."""
    n = min(len(base_rounds), len(head_rounds))
    if n < 2:
        return 0.0, float("inf")
    d = np.array([np.log(np.median(h) / np.median(b))
                  for b, h in zip(base_rounds[:n], head_rounds[:n], strict=True)])
    half = (_T90[n - 2] if n - 1 <= len(_T90) else 1.645) * d.std(ddof=1) / np.sqrt(n)
    return float(np.exp(d.mean() - half)), float(np.exp(d.mean() + half))


def _git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {out.stderr.strip()[:500]}")
    return out.stdout.strip()


def checkout(repo: Path, rev: str, where: Path) -> Tree:
    """A detached worktree of ``rev`` at ``where``, its native modules built in place."""
    commit = _git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}")
    _git(repo, "worktree", "add", "--detach", "--force", str(where), commit)
    return _built(Tree(where, commit[:9]), rev)


def working_tree(repo: Path, where: Path) -> Tree:
    """A copy of ``repo``'s working tree at ``where`` (its tracked files and the untracked
    ones git does not ignore, as they are now), its native modules built in place: the
    checkout itself is never written to."""
    names = _git(repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    for name in filter(None, names.split("\0")):
        src = repo / name
        if src.is_file():  # a deleted, not yet staged file is listed but gone
            (where / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, where / name)
    return _built(Tree(where, "working tree"), "the working tree")


def _built(tree: Tree, what: str) -> Tree:
    build = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                           cwd=tree.path, env=tree.env(), capture_output=True, text=True)
    if build.returncode != 0:
        raise RuntimeError(f"building {what}'s native modules failed:\n{build.stderr[-2000:]}")
    return tree


def remove(repo: Path, tree: Tree) -> None:
    subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree.path)],
                   capture_output=True)
    shutil.rmtree(tree.path, ignore_errors=True)
    subprocess.run(["git", "-C", str(repo), "worktree", "prune"], capture_output=True)


def check_native(tree: Tree) -> None:
    """Both native modules load from ``tree``: without them a tree would be measured on its
    slow fallbacks."""
    poll = (tree.path / "clients/python/hicache/csrc/poll.c").exists()  # a tree before it
    code = ("import hicached.copy._copykernel, hicached, sys; "
            + ("import hicache._poll; " if poll else "")
            + "sys.exit(0 if hicached.__file__.startswith(sys.argv[1]) else 3)")
    got = subprocess.run([sys.executable, "-c", code, str(tree.path)], env=tree.env(),
                         capture_output=True, text=True)
    if got.returncode != 0:
        raise RuntimeError(f"{tree.label} ({tree.path}): its native modules do not load, or "
                           f"its packages are not the ones imported: {got.stderr.strip()[-500:]}")


Samples = dict[tuple[str, str], dict[str, list[list[float]]]]
"""(path, "<page>/<op>") -> tree label -> one list of call seconds per round."""


def _run_one(cmd: list[str], tree: Tree, work: Path, shm_root: Path) -> tuple[int, str, str]:
    """One latency run in a process group of its own: interrupted, the whole group (the run
    and its daemon) is killed, so nothing outlives ``compare``."""
    # what it makes (its socket, its daemon's files) goes under ``shm_root``: a short path
    # (sockets allow 107 bytes), and what a killed run leaves goes with it
    env = {**tree.env(), "TMPDIR": str(shm_root)}
    proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=900)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return proc.returncode, out, err


def measure(trees: Sequence[Tree], rounds: int, calls: int, paths: Sequence[str],
            ops: Sequence[str], pages: Sequence[str], runner: Path, work: Path,
            shm_root: Path, progress: bool = True) -> Samples:
    samples: Samples = {}
    total, done = rounds * len(paths) * len(trees), 0
    for r in range(rounds):
        for path in paths:
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for tree in order:
                cmd = [sys.executable, str(runner), "--path", path, "--calls", str(calls),
                       "--ops", ",".join(ops), "--pages", ",".join(pages),
                       "--shm-root", str(shm_root)]
                rc, out, err = _run_one(cmd, tree, work, shm_root)
                if rc != 0:
                    raise RuntimeError(f"the {path} run of {tree.label} failed:\n{err[-2000:]}")
                for key, xs in json.loads(out.strip().splitlines()[-1]).items():
                    samples.setdefault((path, key), {}).setdefault(tree.label, []).append(xs)
                done += 1
                if progress:
                    print(f"\r  round {r + 1}/{rounds}: {done}/{total} runs", end="",
                          file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return samples


def _spread_pct(per_round: list[list[float]], median: float) -> float:
    medians = [statistics.median(xs) for xs in per_round]
    return 100 * (max(medians) - min(medians)) / 2 / median if median else 0.0


def summarize(samples: Samples, base: str, head: str) -> list[Row]:
    rows = []
    for (path, key), by_tree in samples.items():
        page, op = key.split("/", 1)
        b = statistics.median(x for xs in by_tree[base] for x in xs)
        h = statistics.median(x for xs in by_tree[head] for x in xs)
        lo, hi = ratio_interval(by_tree[base], by_tree[head])
        rows.append(Row(path, f"{op}@{page}", page, b * 1e6, h * 1e6, h / b,
                        _spread_pct(by_tree[base], b), _spread_pct(by_tree[head], h), lo, hi))
    return rows


def _print_table(rows: list[Row], base: str, head: str, rounds: int, calls: int) -> None:
    print(f"p50 per call (us) over {rounds} round(s) x {calls} calls, a fresh daemon per run; "
          f"base {base}, head {head}; +-: half the range of the per-round medians; "
          f"interval: 90 % of the ratio, rounds paired")
    print(f"{'path':<12} {'op':<18} {'base':>9} {'':>6} {'head':>9} {'':>6} {'head/base':>9}"
          f"  {'interval':<11}  verdict")
    for r in rows:
        print(f"{r.path:<12} {r.op:<18} {r.base_us:>9.0f} {r.base_spread_pct:>5.0f}% "
              f"{r.head_us:>9.0f} {r.head_spread_pct:>5.0f}% {r.ratio:>9.2f}"
              f"  {r.ratio_lo:.2f}-{r.ratio_hi:.2f}  {r.verdict}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hicache-bench compare",
                                 description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("base", help="the git revision to compare with (e.g. the last landed "
                                 "commit, origin/main, e694450)")
    ap.add_argument("--head", help="a revision to measure instead of the working tree")
    ap.add_argument("--repo", type=Path, default=Path.cwd(),
                    help="the git checkout (default: the one the current directory is in)")
    ap.add_argument("--rounds", type=int, default=6, help="runs per path and tree")
    ap.add_argument("--calls", type=int, default=200, help="timed calls per op in each run")
    ap.add_argument("--paths", default=",".join(bench_latency.PATHS))
    ap.add_argument("--ops", default=",".join(bench_latency.OPS))
    ap.add_argument("--pages", default=",".join(bench_latency.PAGES))
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument("--max-ratio", type=float,
                    help="exit with status 1 when any head/base ratio exceeds this")
    args = ap.parse_args(argv)
    paths, ops, pages = args.paths.split(","), args.ops.split(","), args.pages.split(",")
    if (set(paths) - set(bench_latency.PATHS) or set(ops) - set(bench_latency.OPS)
            or set(pages) - set(bench_latency.PAGES) or args.rounds < 1 or args.calls < 1):
        ap.error(f"--paths from {bench_latency.PATHS}, --ops from {bench_latency.OPS}, "
                 f"--pages from {tuple(bench_latency.PAGES)}; --rounds, --calls >= 1")
    try:
        return _compare(args, paths, ops, pages)
    except RuntimeError as exc:
        print(f"hicache-bench compare: {exc}", file=sys.stderr)
        return 2


def _compare(args: argparse.Namespace, paths: list[str], ops: list[str], pages: list[str]
             ) -> int:
    repo = Path(_git(args.repo, "rev-parse", "--show-toplevel"))
    # SIGTERM ends it as Ctrl-C does: through the clean-up below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    work = Path(tempfile.mkdtemp(prefix="hicache-compare-"))
    shm_root = Path(tempfile.mkdtemp(prefix="hicache-compare-", dir="/dev/shm"))
    made: list[Tree] = []
    try:
        runner = work / "bench_latency.py"  # this tree's runner, for both
        shutil.copyfile(bench_latency.__file__, runner)
        print(f"building {args.base} in {work / 'base'}", file=sys.stderr)
        base = checkout(repo, args.base, work / "base")
        made.append(base)
        if args.head:
            head = checkout(repo, args.head, work / "head")
        else:
            print(f"building the working tree in {work / 'head'}", file=sys.stderr)
            head = working_tree(repo, work / "head")
        made.append(head)
        for t in (base, head):
            check_native(t)
        samples = measure([base, head], args.rounds, args.calls, paths, ops, pages, runner,
                          work, shm_root)
    finally:
        for t in made:
            remove(repo, t)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm_root, ignore_errors=True)
    rows = summarize(samples, base.label, head.label)
    if args.json:
        for r in rows:
            print(json.dumps({**asdict(r), "verdict": r.verdict, "base": base.label,
                              "head": head.label}))
    else:
        _print_table(rows, base.label, head.label, args.rounds, args.calls)
    if args.max_ratio is not None:
        over = [r for r in rows if r.ratio > args.max_ratio]
        for r in over:
            print(f"{r.path} {r.op}: head/base {r.ratio:.2f} > {args.max_ratio}",
                  file=sys.stderr)
        return 1 if over else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
