"""Who opened a session: the identity socket (SO_PEERCRED) and per-pool access rules.

Real daemons; identities of other users come from forked children that drop to ``nobody``
and ask the identity socket themselves, so the kernel reports their uid, not the test's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from hicache.codec import buffer_to_proto
from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicache.v1 import hicache_pb2 as pb
from hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache_client import HiCacheClient, ShmDeviceBuffers
from tests.daemon_proc import DaemonProc, start_daemon

NOBODY = 65534


def spec(name: str) -> PoolSpec:
    return PoolSpec(name, KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 2, 64), 16,
                    size_tokens=16 * 16)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    cfg = tmp_path / "access.toml"
    cfg.write_text('[[access]]\npools = "root-*"\nuids = [0]\n\n'
                   '[[access]]\npools = "nobody-*"\nuids = [65534]\n\n'
                   '[[access]]\npools = "group-*"\ngids = [65534]\n')
    run = tempfile.mkdtemp(prefix="hicache-id-", dir="/tmp")
    os.chmod(run, 0o711)  # others may reach the sockets; their modes decide who connects
    d = start_daemon(tmp_path, "--config", str(cfg), "--socket-mode", "0660",
                     "--socket-group", "nogroup", socket=f"{run}/hicached.sock")
    yield d
    d.stop(signal.SIGKILL)
    shutil.rmtree(run, ignore_errors=True)


def token_as_nobody(daemon: DaemonProc) -> str:
    """A token the identity socket issued to a process running as nobody:nogroup."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(daemon.socket + ".id")
                os.write(w, s.makefile("rb").readline())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    line = b""
    while chunk := os.read(r, 4096):
        line += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child could not reach the socket"
    out = json.loads(line)
    assert out["uid"] == NOBODY
    return str(out["token"])


def open_with(daemon: DaemonProc, pool: str, token: str) -> pb.Session:
    with HiCacheClient(daemon.target) as c, \
            ShmDeviceBuffers.create(spec(pool), 16, daemon.shm_dir) as bufs, \
            grpc.insecure_channel(daemon.target) as ch:
        c.create_pool(spec(pool))
        stub = pb_grpc.HostCacheStub(ch)
        s: pb.Session = stub.OpenSession(pb.OpenSessionRequest(
            pool=pool, worker_id="w", buffers=[buffer_to_proto(b) for b in bufs.descriptors],
            peer_token=token), timeout=10)
        stub.CloseSession(pb.CloseSessionRequest(session_id=s.session_id), timeout=10)
        return s


def test_sessions_know_who_opened_them(daemon: DaemonProc) -> None:
    with HiCacheClient(daemon.target) as c, \
            ShmDeviceBuffers.create(spec("any"), 16, daemon.shm_dir) as bufs:
        c.create_pool(spec("any"))
        s = c.open_session("any", "me", bufs.descriptors)
        assert s.peer_uid == os.getuid()
        listed = next(x for x in c.list_sessions() if x.public_id == s.public_id)
        assert listed.peer_known and listed.peer_pid == os.getpid()
        s.close()


def test_access_rules_admit_only_listed_users_and_groups(daemon: DaemonProc) -> None:
    assert os.getuid() == 0, "the rules below are written for a root test runner"
    with HiCacheClient(daemon.target) as c:
        assert open_with(daemon, "root-a", c.peer_token()).peer_uid == 0
        for pool in ("nobody-a", "group-a"):
            with pytest.raises(grpc.RpcError) as err:
                open_with(daemon, pool, c.peer_token())
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "PEER_NOT_ALLOWED" in str(err.value.details())
        # nobody's own token opens nobody's and nogroup's pools, not root's
        assert open_with(daemon, "nobody-a", token_as_nobody(daemon)).peer_uid == NOBODY
        assert open_with(daemon, "group-a", token_as_nobody(daemon)).peer_gid == NOBODY
        with pytest.raises(grpc.RpcError):
            open_with(daemon, "root-b", token_as_nobody(daemon))
        # pools no rule covers are open to anyone who can connect
        assert not open_with(daemon, "free-a", "").peer_known


def test_tokens_are_single_use_and_required_where_a_rule_applies(daemon: DaemonProc) -> None:
    with HiCacheClient(daemon.target) as c:
        token = c.peer_token()
        assert open_with(daemon, "root-c", token).peer_uid == 0
        for reused in (token, "", "f" * 32):  # used, missing, forged
            with pytest.raises(grpc.RpcError) as err:
                open_with(daemon, "root-c", reused)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with HiCacheClient("127.0.0.1:1") as tcp:  # over TCP there is no identity socket
        assert tcp.peer_token() == ""
