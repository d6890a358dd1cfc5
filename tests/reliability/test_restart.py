"""The cache outlives the daemon: killed at random instants while four workers store.

Real processes throughout: a daemon whose pools live in a state directory on /dev/shm, four
workers (``tests.restart_worker_proc``) storing fresh keys continuously through sealed memfd
buffers and reconnecting whenever the daemon goes away. The daemon is killed (SIGKILL, and
SIGTERM in some rounds) at random instants and started again on the same socket and state
directory. After every restart: every key a worker got an acknowledgement for is found and its
bytes, loaded into zeroed rows, are exact; every key whose store was in flight at the kill is
either absent or exact, never wrong. Then a format-version change: the pool starts cold and
says so.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers
from tests.cache_worker_proc import content, key_of
from tests.daemon_proc import REPO, DaemonProc, start_daemon
from tests.reliability.figures import record

SPEC = PoolSpec("restart", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 1, 16), 16,
                size_tokens=16 * 131072)  # 2 KiB pages: 256 MiB holds every key of the test
WORKERS = 4
KILLS = 20
TERMS = 4
VERIFY = 64  # pages per verification load


class Ledger:
    """What the workers said: keys acknowledged, keys tried (in flight at some kill)."""

    def __init__(self, procs: list[subprocess.Popen[str]]) -> None:
        self.acked: set[int] = set()
        self.tried: set[int] = set()
        self.errors = 0
        self.fatal: list[str] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._read, args=(p,), daemon=True)
                         for p in procs]
        for t in self._threads:
            t.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            msg = json.loads(line)
            with self._lock:
                self.acked.update(msg.get("ack", ()))
                self.tried.update(msg.get("try", ()))
                self.errors += "error" in msg
                if "fatal" in msg:
                    self.fatal.append(msg["fatal"])

    def snapshot(self) -> tuple[set[int], set[int]]:
        with self._lock:
            return set(self.acked), self.tried - self.acked


class Checker:
    """Looks keys up and loads them into zeroed rows of its own sealed buffers."""

    def __init__(self, daemon: DaemonProc) -> None:
        self.client = HiCacheClient(daemon.target, reconnect_seconds=30)
        self.bufs = ShmDeviceBuffers.create(SPEC, VERIFY * SPEC.page_size, sealed=True)
        self.rows = [t.view(torch.uint8) for t in self.bufs.all_tensors()]
        self.session = self.client.open_session(SPEC.name, "checker", self.bufs.descriptors,
                                                fds=self.bufs.fds, lease_ms=5000)
        self.loaded = 0

    def found(self, numbers: list[int]) -> list[int]:
        out: list[int] = []
        for i in range(0, len(numbers), 1024):
            part = numbers[i:i + 1024]
            tiers = self.client.lookup(SPEC.name, [key_of(n) for n in part]).tiers
            out += [n for n, t in zip(part, tiers, strict=True) if t]
        return out

    def exact(self, numbers: list[int]) -> None:
        ps = SPEC.page_size
        for i in range(0, len(numbers), VERIFY):
            part = numbers[i:i + VERIFY]
            for r in self.rows:
                r.zero_()
            self.session.load_keys([key_of(n) for n in part], torch.arange(len(part) * ps))
            for slot, n in enumerate(part):
                for t, r in enumerate(self.rows):
                    got = r[slot * ps:(slot + 1) * ps]
                    assert torch.equal(got, content(key_of(n), t, tuple(got.shape))), \
                        f"key {n}: wrong bytes after a restart"
            self.loaded += len(part)

    def close(self) -> None:
        self.session.close()
        self.bufs.close()
        self.client.close()


@pytest.fixture
def state_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="hicache-restart-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _start(tmp: Path, state: Path, sock: str | None = None) -> DaemonProc:
    return start_daemon(tmp, "--state-dir", str(state), "--lease-seconds", "2", socket=sock)


def test_acknowledged_keys_survive_kills_at_random_instants(tmp_path: Path,
                                                           state_dir: Path) -> None:
    rng = random.Random(1234)
    d = _start(tmp_path, state_dir)
    with HiCacheClient(d.target) as c:
        c.create_pool(SPEC)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.restart_worker_proc", d.target,
                               SPEC.name, str(w + 1), "0.05"], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
             for w in range(WORKERS)]
    ledger = Ledger(procs)
    verified_old = 0
    in_flight_found = 0
    restart_s: list[float] = []
    checked: set[int] = set()
    try:
        signals = [signal.SIGKILL] * KILLS + [signal.SIGTERM] * TERMS
        rng.shuffle(signals)
        for sig in signals:
            time.sleep(rng.uniform(0.2, 0.9))  # workers store meanwhile
            assert d.stop(sig) in (0, -signal.SIGKILL), d.log()[-3000:]
            t0 = time.monotonic()
            d = _start(tmp_path, state_dir, d.socket)
            restart_s.append(time.monotonic() - t0)
            acked, unacked = ledger.snapshot()
            assert not ledger.fatal, ledger.fatal
            checker = Checker(d)
            try:
                missing = sorted(acked - set(checker.found(sorted(acked))))
                assert not missing, f"{len(missing)} acknowledged keys lost, first {missing[:5]}"
                fresh = sorted(acked - checked)
                old = rng.sample(sorted(checked), min(len(checked), 2 * VERIFY))
                checker.exact(fresh + old)  # every new acknowledged key, a sample of older
                verified_old += len(old)
                torn = checker.found(sorted(unacked))  # in flight at the kill: whole or gone
                checker.exact(torn)
                in_flight_found += len(torn)
                checked |= set(fresh)
            finally:
                checker.close()
        with HiCacheClient(d.target) as c:
            pool = c.get_pool(SPEC.name)
        assert pool.attach_outcome == "reattached"
        assert pool.generation == len(signals) + 1
        assert pool.keys >= len(checked)
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        d.stop(signal.SIGKILL)
    assert len(checked) > 1000, "the workers stored too little to prove anything"
    restart_s.sort()
    record("restart_kills", sigkill=KILLS, sigterm=TERMS, acknowledged_keys=len(checked),
           loaded_exact=len(checked) + verified_old, in_flight_found_exact=in_flight_found,
           worker_reconnects=ledger.errors, restart_p50_s=restart_s[len(restart_s) // 2])


DECLARED = """
[[pool]]
name = "declared"
kind = "MHA"
dtype = "bfloat16"
page_size = 16
layer_num = 2
head_num = 1
head_dim = 16
size_tokens = 1024
"""


def test_another_format_version_starts_cold_and_says_so(tmp_path: Path,
                                                        state_dir: Path) -> None:
    cfg = tmp_path / "declared.toml"
    cfg.write_text(DECLARED)
    extra = ("--state-dir", str(state_dir), "--config", str(cfg))
    d = start_daemon(tmp_path, *extra)
    try:
        with HiCacheClient(d.target) as c:
            spec = c.get_pool("declared").spec
            c.create_pool(SPEC)  # not declared: re-attached only from its saved state
            for name in ("declared", SPEC.name):
                with ShmDeviceBuffers.create(spec if name == "declared" else SPEC,
                                             2 * spec.page_size, sealed=True) as bufs:
                    s = c.open_session(name, "w", bufs.descriptors, fds=bufs.fds)
                    assert s.store([b"k1", b"k2"], torch.arange(2 * spec.page_size)).stored == 2
                    s.close()
        d.stop(signal.SIGKILL)
        for name in ("declared", SPEC.name):
            with open(state_dir / f"{name}.meta", "r+b") as f:
                f.seek(8)
                f.write((99).to_bytes(4, "little"))  # a format this daemon does not read
        d = start_daemon(tmp_path, *extra, socket=d.socket)
        with HiCacheClient(d.target) as c:
            pool = c.get_pool("declared")  # declared: starts cold, empty, in its own spec
            assert pool.attach_outcome == "cold_version" and pool.keys == 0
            assert c.lookup("declared", [b"k1", b"k2"]).hits == 0
            assert SPEC.name not in {p.spec.name for p in c.list_pools()}  # unreadable: gone
        log = d.log()
        assert "pool declared starts cold" in log and "format 99" in log
        assert f"saved state of pool {SPEC.name} is unusable (version: format 99" in log
        assert not (state_dir / f"{SPEC.name}.data").exists()
        metrics = _scrape(d)
        for name in ("declared", SPEC.name):
            assert f'hicache_pool_attach_total{{outcome="cold_version",pool="{name}"}} 1.0' \
                in metrics, name
    finally:
        d.stop(signal.SIGKILL)


def _scrape(d: DaemonProc) -> str:
    import re
    import urllib.request

    port = re.findall(r"metrics port (\d+)", d.log())[-1]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def test_drop_state_refuses_while_a_daemon_runs_and_empties_it_after(
        tmp_path: Path, state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hicache_client.cli import main as hicachectl

    d = _start(tmp_path, state_dir)
    try:
        with HiCacheClient(d.target) as c:
            c.create_pool(SPEC)
        assert hicachectl(["drop-state", "--state-dir", str(state_dir)]) == 1
        assert "uses" in capsys.readouterr().err
        assert d.stop() == 0  # a clean stop keeps the files
        assert (state_dir / f"{SPEC.name}.data").exists()
        assert hicachectl(["drop-state", "--state-dir", str(state_dir), "nope"]) == 1
        assert hicachectl(["--json", "drop-state", "--state-dir", str(state_dir)]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {
            "dropped": [SPEC.name]}
        d = _start(tmp_path, state_dir, d.socket)
        with HiCacheClient(d.target) as c:
            assert c.list_pools() == []
    finally:
        d.stop(signal.SIGKILL)


def test_one_daemon_per_state_directory(tmp_path: Path, state_dir: Path) -> None:
    (tmp_path / "a").mkdir()
    d = _start(tmp_path / "a", state_dir)
    try:
        (tmp_path / "b").mkdir()
        second = start_daemon(tmp_path / "b", "--state-dir", str(state_dir), wait=False)
        assert second.proc.wait(30) != 0
        assert f"uses the state directory {state_dir}" in second.log()
        assert d.proc.poll() is None  # the first one serves on
    finally:
        d.stop(signal.SIGKILL)
