"""Sealed memfd buffers handed over by fd (SCM_RIGHTS on the identity socket).

A real daemon; workers in this process create memfds sealed against shrinking, pass them with
their identity request and open sessions on them. Every load lands in zeroed rows. Garbage and
unsealed fds are refused with ``FD_REJECTED`` naming why, nothing stays mapped, the daemon
serves on.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hicache.buffers import DeviceBufferSpec
from hicache.errors import FdRejected, HiCacheError, ShmPathRejected
from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers
from tests.daemon_proc import DaemonProc, Daemons, start_daemon

SPEC = PoolSpec("memfd", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 3, 2, 64), 16,
                size_tokens=16 * 64)
N = 4 * 16


@pytest.fixture(scope="module")
def daemon(module_daemons: Daemons) -> DaemonProc:
    d = module_daemons.start()
    with HiCacheClient(d.target) as c:
        c.create_pool(SPEC)
    return d


def fill(bufs: ShmDeviceBuffers) -> list[torch.Tensor]:
    rows = [t.view(torch.uint8) for t in bufs.all_tensors()]
    for r in rows:
        r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8))
    return [r[:N].clone() for r in rows]


def roundtrip(client: HiCacheClient, bufs: ShmDeviceBuffers, tag: str) -> None:
    """Store N tokens of random bytes by key, zero other rows, load there, compare."""
    want = fill(bufs)
    s = client.open_session(SPEC.name, tag, bufs.descriptors, fds=bufs.fds, heartbeat=False)
    keys = [f"{tag}-{i}".encode() for i in range(N // 16)]
    assert s.store(keys, torch.arange(N)).stored == len(keys)
    rows = [t.view(torch.uint8) for t in bufs.all_tensors()]
    for r in rows:
        r[N:2 * N] = 0
    s.load_keys(keys, torch.arange(N, 2 * N))
    assert all(torch.equal(r[N:2 * N], w) for r, w in zip(rows, want, strict=True))
    s.close()


def test_sealed_buffers_round_trip_and_cannot_shrink(daemon: DaemonProc) -> None:
    with HiCacheClient(daemon.target) as c, \
            ShmDeviceBuffers.create(SPEC, 2 * N, sealed=True) as bufs:
        assert "memfd" in c.get_info().transports
        assert bufs.paths == [] and len(bufs.fds) == 2  # K and V, no file in any directory
        assert {d.transport for d in bufs.descriptors} == {"memfd"}
        for fd in bufs.fds:
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)  # not even the worker can pull the memory away
        roundtrip(c, bufs, "sealed")
        assert c.get_info().sessions == 0


def _memfd(size: int, seals: int = 0) -> int:
    fd = os.memfd_create("test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _unsealed(need: int, tmp: Path) -> int:
    return _memfd(need)


def _sealed_too_small(need: int, tmp: Path) -> int:
    return _memfd(need // 2, fcntl.F_SEAL_SHRINK)


def _sealed_against_writes(need: int, tmp: Path) -> int:
    return _memfd(need, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE)


def _shm_file(need: int, tmp: Path) -> int:
    path = Path("/dev/shm") / f"hicache-test-{os.getpid()}-{time.monotonic_ns()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(path)
    os.ftruncate(fd, need)
    return fd


def _pipe(need: int, tmp: Path) -> int:
    r, w = os.pipe()
    os.close(w)
    return r


def _dev_zero(need: int, tmp: Path) -> int:
    return os.open("/dev/zero", os.O_RDWR)


def _directory(need: int, tmp: Path) -> int:
    return os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)


def _socket(need: int, tmp: Path) -> int:
    a, b = socket.socketpair()
    b.close()
    return a.detach()


GARBAGE: dict[str, tuple[Callable[[int, Path], int], str]] = {
    "unsealed memfd": (_unsealed, "not sealed against shrinking"),
    "sealed but too small": (_sealed_too_small, "bytes, buffers need"),
    "sealed against writes": (_sealed_against_writes, "sealed against writing"),
    "tmpfs file": (_shm_file, "not sealed against shrinking"),
    "pipe": (_pipe, "not a memory file"),
    "/dev/zero": (_dev_zero, "not a memory file"),
    "directory": (_directory, "not a memory file"),
    "socket": (_socket, "not a memory file"),
}


@pytest.mark.parametrize("kind", list(GARBAGE))
def test_garbage_and_unsealed_fds_are_refused(daemon: DaemonProc, kind: str,
                                              tmp_path: Path) -> None:
    make, why = GARBAGE[kind]
    with HiCacheClient(daemon.target) as c, \
            ShmDeviceBuffers.create(SPEC, 2 * N, sealed=True) as good:
        need = max(d.offset + d.nbytes for d in good.descriptors)
        bad = make(need, tmp_path)
        try:
            before = c.get_info()
            with pytest.raises(FdRejected) as err:
                c.open_session(SPEC.name, "hostile", good.descriptors,
                               fds=[bad, good.fds[1]], heartbeat=False)
            assert why in str(err.value), err.value
            assert err.value.metadata["fd_index"] == "0"
            after = c.get_info()
            assert after.sessions == before.sessions == 0
        finally:
            os.close(bad)
        roundtrip(c, good, f"after-{kind.replace(' ', '-').replace('/', '')}")
    assert daemon.proc.poll() is None


def test_fd_index_out_of_range_and_missing_fds(daemon: DaemonProc) -> None:
    with HiCacheClient(daemon.target) as c, \
            ShmDeviceBuffers.create(SPEC, 2 * N, sealed=True) as bufs:
        with pytest.raises(FdRejected, match="2 were handed over"):
            shifted = [DeviceBufferSpec(**{**d.__dict__, "fd_index": d.fd_index + 1})
                       for d in bufs.descriptors]
            c.open_session(SPEC.name, "w", shifted, fds=bufs.fds, heartbeat=False)
        with pytest.raises(FdRejected, match="0 were handed over"):
            c.open_session(SPEC.name, "w", bufs.descriptors, heartbeat=False)  # no fds
        with pytest.raises(FdRejected):
            negative = [DeviceBufferSpec(**{**d.__dict__, "fd_index": -5})
                        for d in bufs.descriptors]
            c.open_session(SPEC.name, "w", negative, fds=bufs.fds, heartbeat=False)
        assert c.get_info().sessions == 0
        roundtrip(c, bufs, "after-index")


def _ask(path: str, payload: bytes, fds: list[int] | None = None) -> dict[str, object]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        if fds:
            socket.send_fds(s, [payload], fds)
        elif payload:
            s.sendall(payload)
        else:
            s.shutdown(socket.SHUT_WR)
        out: dict[str, object] = json.loads(s.makefile("rb").readline())
        return out


def test_identity_socket_refuses_malformed_requests(daemon: DaemonProc) -> None:
    path = daemon.socket + ".id"
    assert "token" in _ask(path, b'{"fds": 0}\n')
    for bad in (b"", b"hello\n", b'{"fds": -1}\n', b'{"fds": true}\n', b"[1]\n",
                b'{"fds": 3}\n'):
        assert "error" in _ask(path, bad), bad
    fd = _memfd(4096, fcntl.F_SEAL_SHRINK)
    try:
        assert "error" in _ask(path, b'{"fds": 2}\n', [fd])  # count disagrees
        assert "more than 128" in str(_ask(path, b'{"fds": 200}\n', [fd] * 200))
    finally:
        os.close(fd)
    assert daemon.proc.poll() is None


def test_idle_identity_connections_do_not_delay_others(daemon: DaemonProc) -> None:
    idle = []
    try:
        for _ in range(64):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(daemon.socket + ".id")
            idle.append(s)
        with HiCacheClient(daemon.target) as c:
            t0 = time.monotonic()
            assert c.peer_token()
            assert time.monotonic() - t0 < 1.0  # not queued behind 64 silent peers
    finally:
        for s in idle:
            s.close()


def _memfds_held(pid: int, label: str) -> int:
    held = []
    for x in os.listdir(f"/proc/{pid}/fd"):
        try:
            held.append(os.readlink(f"/proc/{pid}/fd/{x}"))
        except FileNotFoundError:
            pass
    return sum(f"memfd:{label}" in h for h in held)


def test_the_daemon_keeps_no_fd_it_no_longer_needs(tmp_path: Path) -> None:
    d = start_daemon(tmp_path)
    try:
        with HiCacheClient(d.target) as c:
            c.create_pool(SPEC)
            fd = _memfd(1 << 20, fcntl.F_SEAL_SHRINK)
            assert c.peer_token([fd])  # never redeemed: held until its token expires
            os.close(fd)
            assert _memfds_held(d.proc.pid, "test") == 1
            with ShmDeviceBuffers.create(SPEC, 2 * N, sealed=True, prefix="leak") as bufs:
                s = c.open_session(SPEC.name, "w", bufs.descriptors, fds=bufs.fds,
                                   heartbeat=False)
                assert _memfds_held(d.proc.pid, "leak") == 2  # the mappings' own references
                s.close()
                assert _memfds_held(d.proc.pid, "leak") == 0
                with pytest.raises(FdRejected):  # refused (V's fd missing): nothing kept
                    c.open_session(SPEC.name, "w", bufs.descriptors, fds=bufs.fds[:1],
                                   heartbeat=False)
                assert _memfds_held(d.proc.pid, "leak") == 0
    finally:
        assert d.stop() == 0


def test_a_daemon_without_paths_takes_only_memfds(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "--no-shm-paths")
    try:
        with HiCacheClient(d.target) as c:
            assert "shm" not in c.get_info().transports
            c.create_pool(SPEC)
            with ShmDeviceBuffers.create(SPEC, 2 * N, d.shm_dir) as files:
                with pytest.raises(ShmPathRejected, match="accept_shm_paths"):
                    c.open_session(SPEC.name, "w", files.descriptors, heartbeat=False)
            with ShmDeviceBuffers.create(SPEC, 2 * N, sealed=True) as bufs:
                roundtrip(c, bufs, "only")
    finally:
        assert d.stop() == 0


def test_memfd_over_tcp_is_refused_by_the_client() -> None:
    with HiCacheClient("127.0.0.1:1") as c:
        fd = _memfd(4096, fcntl.F_SEAL_SHRINK)
        try:
            with pytest.raises(HiCacheError, match="identity socket"):
                c.open_session("x", "w", [], fds=[fd])
        finally:
            os.close(fd)
