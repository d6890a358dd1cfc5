"""Hostile and overloaded: one daemon, a bystander worker whose cache must survive everything.

One daemon serves a bystander that stores keyed pages before the attacks and checks them after
each (loaded into zeroed rows); the attacks, each by real processes or real connections:
truncating a handed-over buffer mid-load, shrinking one, passing garbage or unsealed fds and
shrinking a sealed one, connecting as another uid,
guessing and reusing session ids, a flood of 10,000 requests, 64 idle connections, a worker
SIGSTOPped past its lease. After each: the daemon is up, health SERVING, the bystander's keys
all there and exact.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from hicache.errors import FdRejected, HiCacheError
from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache.v1 import hicache_pb2 as pb
from hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache_client import HiCacheClient, ShmDeviceBuffers
from hicache_client.session import WorkerSession
from tests.daemon_proc import REPO, DaemonProc, start_daemon
from tests.reliability.figures import record

SPEC = PoolSpec("hostile", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 4, 2, 64), 16,
                Layout.LAYER_FIRST, size_tokens=16 * 256)
PAGES = 8
N = PAGES * 16


class Bystander:
    """A well-behaved worker: keyed pages stored once, verified after every attack."""

    def __init__(self, daemon: DaemonProc) -> None:
        self.client = HiCacheClient(daemon.target)
        self.client.create_pool(SPEC)
        self.bufs = ShmDeviceBuffers.create(SPEC, 2 * N, daemon.shm_dir, prefix="bystander")
        self.rows = [t.view(torch.uint8) for t in self.bufs.all_tensors()]
        for r in self.rows:
            r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8))
        self.want = [r[:N].clone() for r in self.rows]
        self.session: WorkerSession = self.client.open_session(SPEC.name, "bystander",
                                                               self.bufs.descriptors)
        self.keys = [f"bystander-{i}".encode() for i in range(PAGES)]
        assert self.session.store(self.keys, torch.arange(N)).stored == PAGES
        self.checks = 0

    def check(self, daemon: DaemonProc) -> None:
        assert daemon.proc.poll() is None, daemon.log()[-3000:]
        assert self.client.health("hicache.v1.HostCache")
        for r in self.rows:
            r[N:2 * N] = 0
        self.session.load_keys(self.keys, torch.arange(N, 2 * N))
        assert all(torch.equal(r[N:2 * N], w) for r, w in zip(self.rows, self.want,
                                                              strict=True))
        self.checks += 1

    def close(self) -> None:
        self.session.close()
        self.bufs.close()
        self.client.close()


@pytest.fixture(scope="module")
def arena(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProc, Bystander]]:
    d = start_daemon(tmp_path_factory.mktemp("hostile"), "--lease-seconds", "2",
                     "--grpc-threads", "8")
    b = Bystander(d)
    yield d, b
    record("hostile_bystander", checks=b.checks)
    b.close()
    assert d.stop() == 0, d.log()[-3000:]


def test_truncate_and_shrink_buffers_mid_load(arena) -> None:  # type: ignore[no-untyped-def]
    d, bystander = arena
    faults = 0
    for shrink_to in (0, 4096):
        with HiCacheClient(d.target, reconnect_seconds=0) as c, \
                ShmDeviceBuffers.create(SPEC, N, d.shm_dir, prefix="attacker") as bufs:
            s = c.open_session(SPEC.name, "attacker", bufs.descriptors, heartbeat=False)
            host = c.alloc(SPEC.name, N)
            s.backup(host, torch.arange(N))
            stop, outcomes = threading.Event(), list[str]()

            def loads(s: WorkerSession = s, host: torch.Tensor = host,
                      stop: threading.Event = stop, outcomes: list[str] = outcomes) -> None:
                while not stop.is_set():
                    try:
                        s.load(host, torch.arange(N))
                    except HiCacheError as exc:
                        outcomes.append(exc.reason)
                        return

            t = threading.Thread(target=loads)
            t.start()
            time.sleep(0.05)
            for p in bufs.paths:
                os.truncate(p, shrink_to)
            t.join(30)
            stop.set()
            assert outcomes and outcomes[0] in ("BUFFER_FAULT", "SESSION_NOT_FOUND"), outcomes
            faults += outcomes[0] == "BUFFER_FAULT"
            c.free(SPEC.name, host)
        bystander.check(d)
    record("hostile_truncate", attacks=2, buffer_faults=faults)


def test_garbage_unsealed_and_shrunk_fds(arena) -> None:  # type: ignore[no-untyped-def]
    d, bystander = arena
    refused = 0
    with HiCacheClient(d.target, reconnect_seconds=0) as c, \
            ShmDeviceBuffers.create(SPEC, N, sealed=True, prefix="attacker") as bufs:
        need = max(x.offset + x.nbytes for x in bufs.descriptors)
        unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
        os.ftruncate(unsealed, need)
        r, w = os.pipe()
        garbage = [unsealed, r, w, os.open("/dev/null", os.O_RDWR), os.open("/", os.O_RDONLY)]
        try:
            for fd in garbage:
                with pytest.raises(FdRejected):
                    c.open_session(SPEC.name, "attacker", bufs.descriptors,
                                   fds=[fd, bufs.fds[1]], heartbeat=False)
                refused += 1
            # a sealed buffer mid-load: the worker tries to shrink it; the kernel says no
            s = c.open_session(SPEC.name, "attacker", bufs.descriptors, fds=bufs.fds,
                               heartbeat=False)
            host = c.alloc(SPEC.name, N)
            s.backup(host, torch.arange(N))
            shrinks = 0
            for _ in range(20):
                s.load(host, torch.arange(N))
                for fd in bufs.fds:
                    with pytest.raises(PermissionError):
                        os.ftruncate(fd, 0)
                    shrinks += 1
            s.close()
            c.free(SPEC.name, host)
        finally:
            for fd in garbage:
                os.close(fd)
    bystander.check(d)
    record("hostile_fds", garbage_refused=refused, shrinks_refused_by_kernel=shrinks)


def test_another_uid_cannot_connect(arena) -> None:  # type: ignore[no-untyped-def]
    if os.getuid() != 0:
        pytest.skip("needs root to run a worker as nobody")
    d, bystander = arena
    pid = os.fork()
    if pid == 0:  # the child becomes nobody and tries the daemon's socket
        code = 1
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(d.socket)
            code = 0  # connected: the boundary failed
        except PermissionError:
            code = 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 3, "nobody reached a 0600 socket"
    bystander.check(d)
    record("hostile_other_uid", attempts=1, admitted=0)


def test_guessed_and_reused_session_ids_move_nothing(arena) -> None:  # type: ignore[no-untyped-def]
    d, bystander = arena
    refused = 0
    with grpc.insecure_channel(d.target) as ch:
        stub = pb_grpc.HostCacheStub(ch)
        listed = stub.ListSessions(pb.ListSessionsRequest(), timeout=5).sessions
        guesses = [uuid.uuid4().hex for _ in range(50)] + [s.public_id for s in listed] + \
            [s.session_id for s in listed]  # empty: ListSessions never hands them out
        for sid in guesses:
            req = pb.LoadKeysRequest(session_id=sid, keys=bystander.keys,
                                     device_indices=torch.arange(N).numpy().tobytes())
            with pytest.raises(grpc.RpcError) as err:
                stub.LoadKeys(req, timeout=5)
            assert err.value.code() in (grpc.StatusCode.NOT_FOUND,
                                        grpc.StatusCode.INVALID_ARGUMENT)
            refused += 1
    bystander.check(d)
    record("hostile_session_guess", attempts=len(guesses), refused=refused)


def test_flood_of_ten_thousand_requests(arena) -> None:  # type: ignore[no-untyped-def]
    d, bystander = arena
    outcomes: dict[str, int] = {}
    lock = threading.Lock()

    def burst(i: int) -> None:
        with HiCacheClient(d.target, reconnect_seconds=0, timeout=30) as c:
            for j in range(500):
                try:
                    if j % 2:
                        c.lookup(SPEC.name, [f"k{i}-{j}".encode()] * 1)
                    else:
                        c.get_pool(SPEC.name)
                    key = "ok"
                except HiCacheError as exc:
                    key = exc.reason
                with lock:
                    outcomes[key] = outcomes.get(key, 0) + 1

    t0 = time.monotonic()
    with ThreadPoolExecutor(20) as ex:
        list(ex.map(burst, range(20)))
    elapsed = time.monotonic() - t0
    assert sum(outcomes.values()) == 10_000
    assert set(outcomes) <= {"ok", "OVERLOADED", "RESOURCE_EXHAUSTED"}, outcomes
    bystander.check(d)
    record("hostile_flood", requests=10_000, ok=outcomes.get("ok", 0),
           overloaded=outcomes.get("OVERLOADED", 0), requests_per_s=10_000 / elapsed)


def test_sixty_four_idle_connections(arena) -> None:  # type: ignore[no-untyped-def]
    d, bystander = arena
    channels = [grpc.insecure_channel(d.target) for _ in range(64)]
    try:
        for ch in channels:
            grpc.channel_ready_future(ch).result(timeout=10)
        bystander.check(d)  # served while all of them sit open
    finally:
        for ch in channels:
            ch.close()
    record("hostile_idle_connections", connections=64)


def test_worker_stopped_past_its_lease(arena) -> None:  # type: ignore[no-untyped-def]
    d, bystander = arena
    w = subprocess.Popen([sys.executable, "-m", "tests.worker_proc", d.target, SPEC.name,
                          "sleeper", "3", "0", d.shm_dir, "--forever"], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert w.stdout is not None
        first = json.loads(w.stdout.readline())
        w.send_signal(signal.SIGSTOP)
        public = [s.public_id for s in bystander.client.list_sessions()
                  if s.worker_id == "sleeper"]
        assert len(public) == 1
        deadline = time.monotonic() + 15  # the daemon's 2 s lease, reaper runs often
        while any(s.worker_id == "sleeper" for s in bystander.client.list_sessions()):
            assert time.monotonic() < deadline, "a stopped worker kept its session"
            time.sleep(0.1)
        bystander.check(d)
        assert first["session"] not in d.log()  # reaped by its public id only
        w.send_signal(signal.SIGCONT)  # it wakes to a session that is gone
        assert w.wait(60) != 0
    finally:
        if w.poll() is None:
            w.kill()
            w.wait(10)
    record("hostile_sigstop", reaped=1)
