"""End to end: a real daemon process, real worker processes, real shared memory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from hicache.buffers import DeviceBufferSpec
from hicache.errors import HiCacheError
from hicache.identity import public_session_id
from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec, Role
from hicache.v1 import hicache_pb2 as pb
from hicache_client import HiCacheClient, ShmDeviceBuffers
from tests.daemon_proc import REAPED_WITHIN_S, REPO, DaemonProc, Daemons, start_daemon

SPEC = PoolSpec("e2e", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 4, 2, 64), 16,
                Layout.PAGE_FIRST, size_tokens=4096)


@pytest.fixture(scope="module")
def daemon(module_daemons: Daemons) -> DaemonProc:
    return module_daemons.start()


@pytest.fixture
def client(daemon: DaemonProc) -> Iterator[HiCacheClient]:
    c = HiCacheClient(daemon.target, reconnect_seconds=2)
    c.create_pool(SPEC)
    yield c
    c.close()


def spawn_worker(daemon: DaemonProc, worker: str, seed: int, rounds: int,
                 forever: bool = False) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "tests.worker_proc", daemon.target, SPEC.name, worker,
           str(seed), str(rounds), daemon.shm_dir]
    if forever:
        cmd.append("--forever")
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_two_workers_back_up_and_load_their_own_pages_exactly(daemon: DaemonProc,
                                                               client: HiCacheClient) -> None:
    workers = [spawn_worker(daemon, f"w{i}", seed=i, rounds=5) for i in range(2)]
    results = []
    for w in workers:
        out, err = w.communicate(timeout=120)
        assert w.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        assert r["mismatches"] == 0 and r["verified_buffers"] == 5 * r["buffers"] > 0
    assert client.list_sessions(SPEC.name) == []
    assert client.get_pool(SPEC.name).used_pages == 0


def daemon_maps(daemon: DaemonProc) -> str:
    return Path(f"/proc/{daemon.proc.pid}/maps").read_text()


def test_sigkilled_worker_is_reaped_and_the_other_is_unaffected(daemon: DaemonProc,
                                                                client: HiCacheClient) -> None:
    victim = spawn_worker(daemon, "victim", seed=7, rounds=0, forever=True)
    assert victim.stdout is not None
    first = json.loads(victim.stdout.readline())
    time.sleep(0.3)  # mid-run: transfers are flowing
    survivor = spawn_worker(daemon, "survivor", seed=8, rounds=20)
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    assert any(s.public_id == public_session_id(first["session"]) for s in client.list_sessions())
    out, err = survivor.communicate(timeout=120)
    assert survivor.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["mismatches"] == 0
    deadline = time.monotonic() + REAPED_WITHIN_S
    while any(s.public_id == public_session_id(first["session"]) for s in client.list_sessions()):
        assert time.monotonic() < deadline, "the dead worker's session was not reaped"
        time.sleep(0.1)
    assert "wvictim" not in daemon_maps(daemon), "the dead worker's buffers are still mapped"


def test_a_huge_lease_is_clamped_and_the_reply_says_so(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "--lease-seconds", "1", "--max-lease-seconds", "3")
    try:
        with HiCacheClient(d.target) as c, \
                ShmDeviceBuffers.create(SPEC, 2 * SPEC.page_size, d.shm_dir) as bufs:
            c.create_pool(SPEC)
            s = c.open_session(SPEC.name, "greedy", bufs.descriptors, lease_ms=10**12,
                               heartbeat=False)
            assert (s.lease_ms, s.lease_clamped) == (3000, True)
            listed = next(x for x in c.list_sessions() if x.public_id == s.public_id)
            assert listed.lease_clamped and listed.lease_ms == 3000
            deadline = time.monotonic() + 10  # silent: reaped after 3 s, not 31 years
            while any(x.public_id == s.public_id for x in c.list_sessions()):
                assert time.monotonic() < deadline, "the clamped session was not reaped"
                time.sleep(0.1)
            short = c.open_session(SPEC.name, "modest", bufs.descriptors, lease_ms=2000,
                                   heartbeat=False)
            assert (short.lease_ms, short.lease_clamped) == (2000, False)
    finally:
        d.stop()


def test_misaligned_batch_is_rejected_and_changes_nothing(daemon: DaemonProc,
                                                           client: HiCacheClient) -> None:
    ps = SPEC.page_size
    with ShmDeviceBuffers.create(SPEC, 8 * ps, daemon.shm_dir, prefix="misaligned") as bufs:
        k0 = bufs.layers("kv", Role.K)[0].view(torch.uint8)
        k0.copy_(torch.randint(0, 256, k0.shape, dtype=torch.uint8))
        with client.open_session(SPEC.name, "m", bufs.descriptors) as session:
            host = client.alloc(SPEC.name, 2 * ps)
            dev = torch.arange(2 * ps)
            session.backup(host, dev)
            before = k0[: 2 * ps].clone()
            k0.zero_()
            bad = host.clone()
            bad[ps + 3] += 1  # page 2 is no longer a consecutive run
            with pytest.raises(HiCacheError) as exc:
                session.backup(bad, dev)
            err = exc.value
            assert err.reason == "INDICES_NOT_PAGE_ALIGNED"
            assert err.grpc_code == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
            assert err.metadata["first_bad_position"] == str(ps + 3)
            assert err.metadata["page_size"] == str(ps)
            assert [v.field for v in err.violations] == ["host_indices"]
            with pytest.raises(HiCacheError) as exc:
                session.backup(host[:-1], dev[:-1])  # length not a multiple of page_size
            assert exc.value.reason == "INDICES_NOT_PAGE_ALIGNED"
            assert exc.value.metadata["count"] == str(2 * ps - 1)
            session.load(host, dev)
            assert torch.equal(k0[: 2 * ps], before), "the rejected batch changed host pages"
            client.free(SPEC.name, host)


def test_pool_spec_errors(client: HiCacheClient) -> None:
    with pytest.raises(HiCacheError) as exc:
        client.create_pool(pb.PoolSpec(name="bad", kind=pb.POOL_KIND_MHA,
                                       dtype=pb.DTYPE_BFLOAT16, page_size=64, layer_num=2,
                                       head_num=2, head_dim=8, size_tokens=1000))
    assert exc.value.reason == "POOL_SIZE_NOT_PAGE_ALIGNED"
    assert exc.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert exc.value.metadata["aligned_size"] == "960"
    assert [v.field for v in exc.value.violations] == ["spec.size_tokens"]
    with pytest.raises(HiCacheError) as exc:
        client.create_pool(pb.PoolSpec(name="zero", kind=pb.POOL_KIND_MHA,
                                       dtype=pb.DTYPE_BFLOAT16, page_size=0, layer_num=2,
                                       head_num=2, head_dim=8, size_tokens=64))
    assert exc.value.reason == "PAGE_SIZE_INVALID"
    assert exc.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]


def test_create_pool_is_idempotent_and_conflicts_are_already_exists(
        client: HiCacheClient) -> None:
    again = client.create_pool(SPEC)
    assert again.spec == SPEC
    other = PoolSpec(SPEC.name, SPEC.geometry, 32, SPEC.layout, size_tokens=4096)
    with pytest.raises(HiCacheError) as exc:
        client.create_pool(other)
    assert exc.value.reason == "POOL_SPEC_CONFLICT"
    assert exc.value.grpc_code == grpc.StatusCode.ALREADY_EXISTS  # type: ignore[attr-defined]
    assert "/tokens=4096" in exc.value.metadata["requested"]
    by_bytes = PoolSpec(SPEC.name, SPEC.geometry, 32, SPEC.layout, size_bytes=1 << 20)
    with pytest.raises(HiCacheError) as exc:
        client.create_pool(by_bytes)
    assert exc.value.metadata["requested"].endswith("/bytes=1048576"), exc.value.metadata
    assert "page=32" in exc.value.message and "DeletePool" in exc.value.message


def test_unknown_session_and_pool(client: HiCacheClient) -> None:
    with pytest.raises(HiCacheError) as exc:
        client.backup("nope", torch.arange(16), torch.arange(16))
    assert exc.value.reason == "SESSION_NOT_FOUND"
    with pytest.raises(HiCacheError) as exc:
        client.get_pool("nope")
    assert exc.value.grpc_code == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]


def test_cuda_ipc_without_cuda_is_transport_unavailable(client: HiCacheClient) -> None:
    if client.get_info().cuda_available:
        pytest.skip("this daemon has a CUDA driver with a device")
    buf = DeviceBufferSpec(member="kv", role=Role.K, layer=0, shape=(16, 2, 64),
                           dtype=DType.BFLOAT16, strides=(), transport="cuda_ipc",
                           ipc_handle=b"\x00" * 64, device_uuid="GPU-0", nbytes=4096)
    with pytest.raises(HiCacheError) as exc:
        client.open_session(SPEC.name, "gpu", [buf])
    assert exc.value.reason == "TRANSPORT_UNAVAILABLE"
    assert "libcuda.so.1" in str(exc.value)  # says why: the driver does not load here
    assert exc.value.grpc_code == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]


def test_shm_path_outside_the_directory_is_permission_denied(client: HiCacheClient,
                                                              tmp_path: Path) -> None:
    with ShmDeviceBuffers.create(SPEC, 64, str(tmp_path), prefix="outside") as bufs:
        with pytest.raises(HiCacheError) as exc:
            client.open_session(SPEC.name, "x", bufs.descriptors)
    assert exc.value.reason == "SHM_PATH_REJECTED"
    assert exc.value.grpc_code == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]


def test_health_and_reflection(daemon: DaemonProc) -> None:
    with grpc.insecure_channel(daemon.target) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="hicache.v1.HostCache"), timeout=5)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(iter(stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)))
        names = {s.name for s in resp.list_services_response.service}
        assert {"hicache.v1.HostCache", "grpc.health.v1.Health"} <= names


def test_socket_is_private(daemon: DaemonProc) -> None:
    assert oct(os.stat(daemon.socket).st_mode & 0o777) == "0o600"


def run_ctl(target: str, *args: str, expect: int = 0) -> str:
    out = subprocess.run([sys.executable, "-m", "hicache_client.cli", "--target", target,
                          *args], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == expect, out.stdout + out.stderr
    return out.stdout + out.stderr


def test_hicachectl(daemon: DaemonProc, client: HiCacheClient) -> None:
    def ctl(*args: str) -> str:
        return run_ctl(daemon.target, *args)

    status = json.loads(ctl("--json", "status"))
    assert status["version"] and status["transports"] == ["shm", "memfd"]
    pools = json.loads(ctl("--json", "pools"))
    assert SPEC.name in [p["spec"]["name"] for p in pools]
    assert "version" in ctl("status")
    row = next(line.split() for line in ctl("pools").splitlines() if line.startswith("e2e "))
    assert row[1:5] == ["MHA", "bfloat16", "page_first", "16"], row  # names, not enum numbers
    assert row[-1] in ("created", "reattached") and row[-5] == "-", row  # attach, no disk tier
    assert json.loads(ctl("--json", "sessions")) == []
    assert ctl("health").strip() == "SERVING"  # the exec probe of the shipped pod
    assert json.loads(ctl("--json", "health", "--service", "hicache.v1.HostCache")) == {
        "serving": True}
    assert run_ctl(daemon.target, "health", "--service", "no.such.Service",
                   expect=1).strip() == "NOT_SERVING"
    assert run_ctl(f"unix:{daemon.socket}.absent", "health", expect=1).strip() == "NOT_SERVING"


def test_hicachectl_admin_verbs(daemon: DaemonProc, client: HiCacheClient) -> None:
    spec = PoolSpec("ctl-admin", SPEC.geometry, 16, size_tokens=256)
    client.create_pool(spec)
    with ShmDeviceBuffers.create(spec, 64, daemon.shm_dir) as bufs:
        # a lease longer than the daemon's: several hicachectl processes start before
        # close-session names it, and nothing heartbeats
        s = client.open_session(spec.name, "ctl", bufs.descriptors, heartbeat=False,
                                lease_ms=60_000)
        refused = run_ctl(daemon.target, "delete-pool", spec.name, expect=1)
        assert "POOL_IN_USE" in refused
        assert [x.public_id for x in client.list_sessions(spec.name)] == [s.public_id]
        # operators name sessions by the public id hicachectl shows
        assert s.public_id in run_ctl(daemon.target, "sessions")
        assert json.loads(run_ctl(daemon.target, "--json", "close-session", s.public_id)) == {
            "closed_session": s.public_id}
        assert client.list_sessions(spec.name) == []
        with pytest.raises(HiCacheError) as exc:
            s.load(torch.arange(16), torch.arange(16))
        assert exc.value.reason == "SESSION_NOT_FOUND"
        assert "SESSION_NOT_FOUND" in run_ctl(daemon.target, "close-session", s.session_id,
                                              expect=1)
        s2 = client.open_session(spec.name, "ctl2", bufs.descriptors, heartbeat=False)
        s2.store([b"a", b"b"], torch.arange(32))
        cleared = json.loads(run_ctl(daemon.target, "--json", "clear-pool", spec.name))
        assert cleared == {"cleared_pool": spec.name, "keys_removed": 2}
        assert client.lookup(spec.name, [b"a", b"b"]).hits == 0
        s2.close()
    assert "deleted pool ctl-admin" in run_ctl(daemon.target, "delete-pool", spec.name)
    assert spec.name not in [p.spec.name for p in client.list_pools()]
    assert "POOL_NOT_FOUND" in run_ctl(daemon.target, "delete-pool", spec.name, expect=1)


def test_hicachectl_drain_stops_the_daemon_gracefully(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "--grace-seconds", "3")
    with HiCacheClient(d.target, reconnect_seconds=0.2) as c:
        c.create_pool(SPEC)
        out = json.loads(run_ctl(d.target, "--json", "drain", "--grace", "2"))
        assert out["draining"] is True and out["grace_seconds"] == 2.0
        assert out["already_draining"] is False
        assert d.proc.wait(20) == 0
    log = d.log()
    assert "draining" in log and "hicached stopped" in log
    assert not os.path.exists(d.socket)
    assert "INVALID_ARGUMENT" not in log


def test_second_instance_refuses_and_stale_socket_is_replaced(tmp_path: Path) -> None:
    first = start_daemon(tmp_path)
    try:
        second = start_daemon(tmp_path, wait=False)
        assert second.proc.wait(30) == 2
        assert "another hicached" in second.log()
        assert first.proc.poll() is None
    finally:
        assert first.stop(signal.SIGKILL, timeout=10) == -signal.SIGKILL
    assert os.path.exists(first.socket), "a killed daemon leaves its socket behind"
    third = start_daemon(tmp_path)
    assert third.stop() == 0


def test_sigterm_drains_and_cleans_up(tmp_path: Path) -> None:
    d = start_daemon(tmp_path)
    with HiCacheClient(d.target) as c:
        c.create_pool(SPEC)
        host = c.alloc(SPEC.name, 64)
        assert host.numel() == 64
    assert d.stop(signal.SIGTERM) == 0
    log = d.log()
    assert "draining" in log and "hicached stopped" in log
    assert not os.path.exists(d.socket)


def _tgkill(pid: int, tid: int, sig: int) -> None:
    """``sig`` to one thread of another process (what the kernel may do with a process's
    signal when the main thread cannot take it at once)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(234, pid, tid, sig) != 0:  # SYS_tgkill on x86-64
        raise OSError(ctypes.get_errno(), "tgkill")


@pytest.mark.parametrize("thread", ["grpc", "python"])
def test_sigterm_taken_by_another_thread_still_drains(daemons: Daemons, thread: str) -> None:
    """A SIGTERM the kernel hands to a thread other than the main one (gRPC's, or one of
    the daemon's own Python threads) only flags the interpreter; the main thread must still
    run the handler: the daemon drains and exits 0, in seconds."""
    d = daemons.start()
    names = {}
    for task in Path(f"/proc/{d.proc.pid}/task").iterdir():
        if int(task.name) != d.proc.pid:
            names[int(task.name)] = (task / "comm").read_text().strip()
    want = ("grpc", "event_engine") if thread == "grpc" else ("python",)
    tid = next(t for t, n in sorted(names.items()) if n.startswith(want))
    t0 = time.monotonic()
    _tgkill(d.proc.pid, tid, signal.SIGTERM)
    assert d.proc.wait(10) == 0, d.log()[-2000:]
    assert time.monotonic() - t0 < 5 and "hicached stopped" in d.log()


def test_client_reconnects_after_daemon_restart(tmp_path: Path) -> None:
    d = start_daemon(tmp_path)
    c = HiCacheClient(d.target, reconnect_seconds=1.0, timeout=5)
    try:
        c.ping()
        d.stop(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(HiCacheError) as exc:
            c.get_info()
        assert exc.value.reason == "UNAVAILABLE" and "unreachable" in exc.value.message
        assert time.monotonic() - t0 >= 0.9
        d2 = start_daemon(tmp_path)
        c.ping()  # the same client object works again
        assert d2.stop() == 0
    finally:
        c.close()


def test_socket_mode_and_group_let_the_services_group_connect(tmp_path: Path) -> None:
    import grp
    import stat

    group = grp.getgrnam("daemon")  # any group other than the daemon's own
    d = start_daemon(tmp_path, "--socket-mode", "0660", "--socket-group", group.gr_name)
    try:
        st = os.stat(d.socket)
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == group.gr_gid
        with HiCacheClient(d.target) as c:
            assert c.health()
    finally:
        d.stop()
    refused = start_daemon(tmp_path, "--socket-mode", "0666", wait=False)
    assert refused.proc.wait(30) == 2 and "socket_mode" in refused.log()


def test_worker_buffer_files_take_the_mode_asked_for(tmp_path: Path) -> None:
    import stat

    old = os.umask(0o077)  # a strict umask must not take the group's bits away
    try:
        with ShmDeviceBuffers.create(SPEC, 16, str(tmp_path), mode=0o660) as shared, \
                ShmDeviceBuffers.create(SPEC, 16, str(tmp_path)) as private:
            assert {stat.S_IMODE(os.stat(p).st_mode) for p in shared.paths} == {0o660}
            assert {stat.S_IMODE(os.stat(p).st_mode) for p in private.paths} == {0o600}
    finally:
        os.umask(old)


def test_list_sessions_never_hands_out_the_capability(daemon: DaemonProc,
                                                      client: HiCacheClient) -> None:
    with ShmDeviceBuffers.create(SPEC, 2 * SPEC.page_size, daemon.shm_dir, prefix="cap") as b:
        s = client.open_session(SPEC.name, "holder", b.descriptors, heartbeat=False)
        host = client.alloc(SPEC.name, SPEC.page_size)
        listed = [x for x in client.list_sessions() if x.worker_id == "holder"]
        assert len(listed) == 1
        assert listed[0].session_id == "" and listed[0].public_id == s.public_id
        assert s.public_id == public_session_id(s.session_id) != s.session_id
        # what a stranger can learn does not move a byte
        with pytest.raises(HiCacheError) as exc:
            client.backup(listed[0].public_id, host, torch.arange(SPEC.page_size))
        assert exc.value.reason == "SESSION_NOT_FOUND"
        with pytest.raises(HiCacheError):
            client.heartbeat(listed[0].public_id)
        s.backup(host, torch.arange(SPEC.page_size))  # the holder still can
        assert "holder" in daemon.log() and s.session_id not in daemon.log()
        s.close()
