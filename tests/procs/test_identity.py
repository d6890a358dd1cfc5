"""Who opened a session: the identity socket (SO_PEERCRED) and per-pool access rules.

Real daemons; identities of other users come from forked children that drop to ``nobody``
and ask the identity socket themselves, so the kernel reports their uid, not the test's.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from hicache.codec import buffer_to_proto, spec_to_proto
from hicache.identity import PEER_TOKEN_HEADER, SESSION_HEADER
from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicache.v1 import hicache_pb2 as pb
from hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache_client import HiCacheClient, ShmDeviceBuffers
from tests.daemon_proc import DaemonProc, Daemons

NOBODY = 65534


def spec(name: str) -> PoolSpec:
    return PoolSpec(name, KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 2, 64), 16,
                    size_tokens=16 * 16)


@pytest.fixture
def daemon(daemons: Daemons, tmp_path: Path) -> Iterator[DaemonProc]:
    cfg = tmp_path / "access.toml"
    cfg.write_text('[[access]]\npools = "root-*"\nuids = [0]\n\n'
                   '[[access]]\npools = "nobody-*"\nuids = [65534]\n\n'
                   '[[access]]\npools = "group-*"\ngids = [65534]\n')
    run = tempfile.mkdtemp(prefix="hicache-id-", dir="/tmp")
    os.chmod(run, 0o711)  # others may reach the sockets; their modes decide who connects
    yield daemons.start("--config", str(cfg), "--socket-mode", "0660",
                        "--socket-group", "nogroup", socket=f"{run}/hicached.sock")
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
                s.sendall(b'{"fds": 0}\n')
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


def ensure_pool(daemon: DaemonProc, pool: str) -> None:
    """Create ``pool`` as a peer its rule admits (nobody for nobody-* and group-*)."""
    if not pool.startswith(("nobody-", "group-")):
        with HiCacheClient(daemon.target) as c:
            c.create_pool(spec(pool))
        return
    with grpc.insecure_channel(daemon.target) as ch:
        stub = pb_grpc.HostCacheStub(ch)
        stub.CreatePool(pb.CreatePoolRequest(spec=spec_to_proto(spec(pool))), timeout=10,
                        metadata=[(PEER_TOKEN_HEADER, token_as_nobody(daemon))])
        while stub.GetPool(pb.GetPoolRequest(name=pool), timeout=10).state != pb.POOL_STATE_READY:
            time.sleep(0.01)


def open_with(daemon: DaemonProc, pool: str, token: str) -> pb.Session:
    ensure_pool(daemon, pool)
    with ShmDeviceBuffers.create(spec(pool), 16, daemon.shm_dir) as bufs, \
            grpc.insecure_channel(daemon.target) as ch:
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


POOL_CALLS = ("Lookup", "RemoveKeys", "ClearPool", "Free", "Alloc", "CreatePool", "DeletePool",
              "WatchEvents")


def pool_call(daemon: DaemonProc, stub: pb_grpc.HostCacheStub, method: str, pool: str,
              metadata: list[tuple[str, str]]) -> None:
    """One pool-level call naming ``pool``; raises the RPC error."""
    req = {
        "Lookup": lambda: pb.LookupRequest(pool=pool, keys=[b"k"]),
        "RemoveKeys": lambda: pb.RemoveKeysRequest(pool=pool, keys=[b"k"]),
        "ClearPool": lambda: pb.ClearPoolRequest(pool=pool),
        "Free": lambda: pb.FreeRequest(pool=pool, host_indices=b""),
        "Alloc": lambda: pb.AllocRequest(pool=pool, num_tokens=16),
        "CreatePool": lambda: pb.CreatePoolRequest(spec=spec_to_proto(spec(pool))),
        "DeletePool": lambda: pb.DeletePoolRequest(name=pool),
        "WatchEvents": lambda: pb.WatchEventsRequest(pool=pool),
    }[method]()
    call = getattr(stub, method)
    if method == "WatchEvents":
        stream = call(req, timeout=2, metadata=metadata)
        try:
            next(stream)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # no event: it was admitted
                raise
        return
    resp = call(req, timeout=10, metadata=metadata)
    if method == "Alloc":  # give the page back, as the test runner (root: tokens are one-use)
        with HiCacheClient(daemon.target) as c:
            stub.Free(pb.FreeRequest(pool=pool, host_indices=resp.host_indices), timeout=10,
                      metadata=[(PEER_TOKEN_HEADER, c.peer_token())])


def refused(fn: Callable[[], object]) -> bool:
    try:
        fn()
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err
        assert "PEER_NOT_ALLOWED" in str(err.details()) or "may not" in str(err.details())
        return True
    return False


def denied(daemon: DaemonProc, stub: pb_grpc.HostCacheStub, method: str, pool: str,
           metadata: list[tuple[str, str]]) -> bool:
    return refused(lambda: pool_call(daemon, stub, method, pool, metadata))


def test_pool_level_calls_on_covered_pools_need_a_credential(daemon: DaemonProc) -> None:
    assert os.getuid() == 0
    with HiCacheClient(daemon.target) as c, grpc.insecure_channel(daemon.target) as ch, \
            ShmDeviceBuffers.create(spec("root-p"), 16, daemon.shm_dir) as bufs, \
            ShmDeviceBuffers.create(spec("free-p"), 16, daemon.shm_dir) as free_bufs:
        stub = pb_grpc.HostCacheStub(ch)
        c.create_pool(spec("root-p"))  # the client identifies itself when a rule asks
        c.create_pool(spec("free-p"))
        for m in POOL_CALLS:
            if m == "DeletePool":
                continue  # below, last
            assert denied(daemon, stub, m, "root-p", []), m
            assert denied(daemon, stub, m, "root-p",
                          [(PEER_TOKEN_HEADER, token_as_nobody(daemon))]), m
            assert denied(daemon, stub, m, "root-p", [(PEER_TOKEN_HEADER, "f" * 32)]), m
            assert not denied(daemon, stub, m, "root-p", [(PEER_TOKEN_HEADER, c.peer_token())]), m
            assert not denied(daemon, stub, m, "free-p", []), m
        # a session's capability vouches for its own pool only
        mine = c.open_session("root-p", "w", bufs.descriptors, heartbeat=False)
        other = c.open_session("free-p", "w", free_bufs.descriptors, heartbeat=False)
        assert not denied(daemon, stub, "Lookup", "root-p", [(SESSION_HEADER, mine.session_id)])
        assert denied(daemon, stub, "Lookup", "root-p", [(SESSION_HEADER, other.session_id)])
        assert denied(daemon, stub, "Lookup", "root-p", [(SESSION_HEADER, mine.public_id)])
        # closing someone's session by its public id needs a credential for its pool
        assert refused(lambda: stub.CloseSession(
            pb.CloseSessionRequest(session_id=mine.public_id), timeout=10))
        assert any(s.public_id == mine.public_id for s in c.list_sessions())
        c.close_session(mine.public_id)  # root, identified: allowed
        assert not any(s.public_id == mine.public_id for s in c.list_sessions())
        other.close()
        # the client's own calls just work for an allowed peer
        assert c.lookup("root-p", [b"k"]).hits == 0
        assert c.clear_pool("root-p") == 0
        assert denied(daemon, stub, "DeletePool", "root-p", [])
        c.delete_pool("root-p")
        assert "root-p" not in {p.spec.name for p in c.list_pools()}
