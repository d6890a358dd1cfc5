"""Paths a neighbour planted: refused, or started cold, and never followed.

Each planting step runs as user ``nobody`` (the tests need root to switch to it), in a
directory anyone may write in (sticky, as ``/tmp``), exactly as another local user could:

- the default socket directory made first by nobody (0777, its lock file a symlink to a
  victim file): the daemon refuses to start, names the path, and the victim is untouched;
- the state directory made first by nobody: the same;
- a lock file that is a symlink in the daemon's own directory: refused, the victim untouched;
- a saved pool's ``.meta`` / ``.data`` owned by nobody and writable by anyone: never
  re-attached (``cold_untrusted``, counted), its key not served;
- a process of nobody listening on a daemon's sockets: a client sends it no fd and no data
  (``DAEMON_UNTRUSTED``), unless told that user is its daemon;
- an access rule by group matches a worker through its supplementary groups as the kernel
  recorded them at connect time (``SO_PEERGROUPS``), not through ``/proc``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from hicache import fast_wire as w
from hicache.error_mapping import from_status_bytes
from hicache.errors import DaemonUntrusted
from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers
from hicache_client.fast_path import FastPath
from hicache_client.identity import request_token, trusted_uids
from hicached.server.app import create_server
from hicached.server.config import ServerConfig
from hicached.service.identity import AccessRule
from tests import prom
from tests.daemon_proc import REPO, start_daemon, state_dir_of

NOBODY = 65534
USERS_GID = 100
SPEC = PoolSpec("planted", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 1, 16), 4,
                size_tokens=4 * 16)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="planting as nobody needs root")


def as_nobody(fn: Callable[[], str], groups: tuple[int, ...] = ()) -> str:
    """``fn()`` in a forked child running as user nobody (with these supplementary groups):
    what it returns, or ``AssertionError`` with its exception. No exec: the interpreter's own
    files need not be readable by nobody."""
    r, wr = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become nobody, do the one thing, say what came of it
        code = 0
        try:
            os.close(r)
            os.setgroups(list(groups))
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = "ok:" + fn()
        except BaseException as exc:
            out, code = f"error:{type(exc).__name__}: {exc}", 1
        os.write(wr, out.encode())
        os._exit(code)
    os.close(wr)
    with os.fdopen(r, "rb") as f:
        said = f.read().decode()
    os.waitpid(pid, 0)
    assert said.startswith("ok:"), said
    return said[3:]


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every user may create files in (sticky, like /tmp)."""
    base = Path(tempfile.mkdtemp(prefix="hicache-shared-", dir="/tmp"))
    base.chmod(0o1777)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    v = tmp_path / "victim"
    v.write_text("precious\n")
    v.chmod(0o666)  # nobody may not delete it, but the daemon (root) could truncate it
    return v


def serve(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hicached", "serve",
                           "--metrics-listen", "", "--memory-budget", "64MiB",
                           "--reserve", "0", *args], env={**os.environ, **env}, cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def plant_dir(path: Path, victim: Path, lock: str) -> None:
    def plant() -> str:
        os.makedirs(path, exist_ok=True)
        os.chmod(path, 0o777)
        os.symlink(victim, path / lock)
        return ""

    as_nobody(plant)
    assert path.stat().st_uid == NOBODY


def test_a_default_socket_directory_made_first_by_another_user_is_refused(
        shared: Path, victim: Path, tmp_path: Path) -> None:
    runtime = shared / "run"
    plant_dir(runtime / "hicached", victim, "hicached.sock.lock")
    got = serve(["--state-dir", str(tmp_path / "state")], {"XDG_RUNTIME_DIR": str(runtime)})
    assert got.returncode == 2, got.stderr
    assert f"{runtime / 'hicached'}: is owned by uid {NOBODY}" in got.stderr
    assert victim.read_text() == "precious\n"
    assert not (runtime / "hicached" / "hicached.sock").exists()


def test_a_state_directory_made_first_by_another_user_is_refused(
        shared: Path, victim: Path, tmp_path: Path) -> None:
    state = shared / "state"
    plant_dir(state, victim, ".lock")
    got = serve(["--listen", f"unix:{tmp_path}/d.sock", "--state-dir", str(state)], {})
    assert got.returncode == 2, got.stderr
    assert f"{state}: is owned by uid {NOBODY}" in got.stderr
    assert victim.read_text() == "precious\n"


def test_a_symlinked_lock_in_the_daemons_own_directory_is_not_followed(
        victim: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "d.sock.lock").symlink_to(victim)
    got = serve(["--listen", f"unix:{run}/d.sock", "--state-dir", ""], {})
    assert got.returncode == 2, got.stderr
    assert f"{run / 'd.sock.lock'}: is a symlink" in got.stderr
    assert victim.read_text() == "precious\n"


def test_a_shared_socket_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)  # not sticky: anyone could move the daemon's socket away
    got = serve(["--listen", f"unix:{loose}/d.sock", "--state-dir", ""], {})
    assert got.returncode == 2 and "others could move the daemon's socket away" in got.stderr




@pytest.mark.parametrize("declared", [False, True], ids=["saved", "declared"])
def test_saved_state_files_of_another_user_are_never_reattached(tmp_path: Path,
                                                                declared: bool) -> None:
    import urllib.request

    extra: tuple[str, ...] = ()
    if declared:
        cfg = tmp_path / "pools.toml"
        g = SPEC.geometry
        cfg.write_text(f'[[pool]]\nname = "{SPEC.name}"\nkind = "mha"\ndtype = "bfloat16"\n'
                       f"page_size = {SPEC.page_size}\nsize_tokens = {SPEC.size_tokens}\n"
                       f"layer_num = {g.layer_num}\nhead_num = {g.head_num}\n"
                       f"head_dim = {g.head_dim}\n")
        extra = ("--config", str(cfg))
    d = start_daemon(tmp_path, *extra)
    with HiCacheClient(d.target) as c, ShmDeviceBuffers.create(SPEC, 4, sealed=True) as bufs:
        c.create_pool(SPEC)
        s = c.open_session(SPEC.name, "w", bufs.descriptors, fds=bufs.fds, heartbeat=False)
        assert s.store([b"mine"], torch.arange(4)).status == bytes([1])
        s.close()
    assert d.stop() == 0
    state = state_dir_of(tmp_path)
    for suffix in (".meta", ".data"):  # as if nobody had written them (and may still)
        os.chown(state / f"{SPEC.name}{suffix}", NOBODY, NOBODY)
        os.chmod(state / f"{SPEC.name}{suffix}", 0o666)
    d = start_daemon(tmp_path, *extra)
    try:
        with HiCacheClient(d.target) as c:
            info = c.get_info()
            if declared:
                deadline = time.monotonic() + 20
                while c.get_pool(SPEC.name).state != "READY":
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                assert c.get_pool(SPEC.name).attach_outcome == "cold_untrusted"
            else:
                assert [p.spec.name for p in c.list_pools()] == []
                c.create_pool(SPEC)
            assert c.lookup(SPEC.name, [b"mine"]).hits == 0  # never served
            with urllib.request.urlopen(f"http://127.0.0.1:{info.metrics_port}/metrics") as r:
                text = r.read().decode()
        assert prom.value(text, "hicache_pool_attach_total", 0.0, outcome="cold_untrusted") == 1
        assert "untrusted" in d.log()
        for suffix in (".meta", ".data"):
            if (state / f"{SPEC.name}{suffix}").exists():
                assert (state / f"{SPEC.name}{suffix}").stat().st_uid == 0
    finally:
        d.stop(signal.SIGKILL)


def test_a_client_hands_nothing_to_a_daemon_socket_another_user_listens_on(
        shared: Path) -> None:
    base = shared / "impostor.sock"
    ready_r, ready_w = os.pipe()

    def impostor() -> str:  # listens where the daemon's sockets go, as nobody
        socks = []
        for path in (f"{base}.id", f"{base}.fast"):
            s = socket.socket(socket.AF_UNIX)
            s.bind(path)
            s.listen(8)
            s.settimeout(20)
            socks.append(s)
        os.write(ready_w, b"x")
        said = []
        for s in socks:  # the identity socket, then the fast path: does any fd or byte come?
            conn, _ = s.accept()
            conn.settimeout(2)
            try:
                data, fds, _, _ = socket.recv_fds(conn, 4096, 8)
            except OSError:
                data, fds = b"", []
            said.append(f"{len(data)} bytes, {len(fds)} fds")
            conn.close()
        return "; ".join(said)

    result: list[str] = []
    t = threading.Thread(target=lambda: result.append(as_nobody(impostor)))
    t.start()
    try:
        assert os.read(ready_r, 1) == b"x"
        memfd = os.memfd_create("kv")
        try:
            with pytest.raises(DaemonUntrusted) as exc:
                request_token(f"unix:{base}", [memfd], trusted_uids())
            assert exc.value.metadata["uid"] == str(NOBODY)
            with pytest.raises(DaemonUntrusted):
                FastPath(f"{base}.fast", 5.0)._connect(5.0)
            assert trusted_uids(NOBODY) >= {0, NOBODY}  # told that user is the daemon's
        finally:
            os.close(memfd)
        t.join(30)
        assert result == ["0 bytes, 0 fds; 0 bytes, 0 fds"]  # connected to, given nothing
    finally:
        os.close(ready_r)
        os.close(ready_w)


def test_group_rules_use_the_groups_the_kernel_recorded_at_connect(tmp_path: Path) -> None:
    """Both workers run as nobody and reach the socket through its group (nobody's primary);
    the one whose supplementary group the rule lists is let in, the other is not. Groups come
    with the connection (SO_PEERGROUPS), whatever /proc says later."""
    base = Path(tempfile.mkdtemp(prefix="hicache-groups-", dir="/tmp"))
    base.chmod(0o755)
    shm = tmp_path / "shm"
    shm.mkdir()
    config = ServerConfig(listen=(f"unix:{base}/g/s.sock",), shm_dir=str(shm), state_dir="",
                          metrics_listen="", memory_budget_bytes=64 << 20, reserve_bytes=0,
                          pools=(SPEC,), socket_mode=0o660, socket_group="nogroup",
                          access=(AccessRule(SPEC.name, gids=(USERS_GID,)),))
    server, bound = create_server(config)
    try:
        out: list[bytes] = []
        w.put_string(out, SPEC.name)
        w.put_string(out, "")
        w.put_keys(out, [b"k"])
        body = b"".join(out)
        frame = (w.HELLO.pack(w.MAGIC, w.VERSION, 0, 0)
                 + w.REQUEST.pack(len(body), 1, w.Method.LOOKUP, 0, 0) + body)
        path = bound[0][len("unix:"):] + ".fast"

        def lookup() -> str:  # a worker of user nobody, over a raw fast-path connection
            with socket.socket(socket.AF_UNIX) as sk:
                sk.settimeout(10)
                sk.connect(path)
                sk.sendall(frame)
                w.recv_exact(sk, w.HELLO.size)
                (_, _, status), data = w.FrameSocket(sk).read(w.REPLY)
            return "OK" if status == w.OK else from_status_bytes(data).reason

        verdicts = [as_nobody(lookup, groups) for groups in ((USERS_GID,), ())]
        assert verdicts == ["OK", "PEER_NOT_ALLOWED"]
        assert os.stat(f"{base}/g").st_gid == NOBODY  # the socket group may enter
    finally:
        server.drain_and_stop(1.0)
        shutil.rmtree(base, ignore_errors=True)

