"""End to end over VMM memory with the fake driver: a real daemon process, real worker processes
whose KV lies in cuMemCreate chunks (a layer across two) handed over as fds, a SIGKILLed worker
whose imports, mappings and reservations must all go, hostile fds refused.

What the daemon still holds is read from the outside: its metrics, and /proc of its process
(the fake driver's chunks are memfds named ``fakecuda-vmm-<uuid>``, an import holds one open,
a mapping shows in its maps, a reserved range maps the memfd ``fakecuda-reserved``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from hicache.buffers import DeviceBufferSpec
from hicache.errors import HiCacheError
from hicache.identity import public_session_id
from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec, Role
from hicache_client import HiCacheClient
from tests import prom
from tests.daemon_proc import REAPED_WITHIN_S, REPO, DaemonProc, start_daemon
from tests.fakecuda import UUID_A, UUID_B, format_uuid, library

SPECS = {
    "mha": PoolSpec("vmm-mha", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 4, 2, 64), 16,
                    Layout.PAGE_FIRST, size_tokens=4096),
    "mla": PoolSpec("vmm-mla", KVGeometry(PoolKind.MLA, DType.FLOAT16, 3, kv_lora_rank=64,
                                          qk_rope_head_dim=16), 16, Layout.LAYER_FIRST,
                    size_tokens=4096),
}
TOKENS = 16 * 16
GRANULE = 2 << 20


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    lib = library()
    saved = {k: os.environ.get(k) for k in ("HICACHED_CUDA_DRIVER", "FAKECUDA_DEVICES",
                                            "FAKECUDA_DEFER")}
    os.environ["HICACHED_CUDA_DRIVER"] = lib
    os.environ["FAKECUDA_DEVICES"] = f"{UUID_A},{UUID_B}"
    os.environ["FAKECUDA_DEFER"] = "1"  # the daemon's copies run only when it synchronizes
    try:
        d = start_daemon(tmp_path_factory.mktemp("cuda-vmm-daemon"))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture
def client(daemon: DaemonProc) -> Iterator[HiCacheClient]:
    c = HiCacheClient(daemon.target, reconnect_seconds=2)
    for s in SPECS.values():
        c.create_pool(s)
    yield c
    c.close()


def spawn(daemon: DaemonProc, kind: str, worker: str, seed: int, rounds: int, devices: str,
          *flags: str) -> subprocess.Popen[str]:
    env = dict(os.environ, HICACHED_CUDA_DRIVER=library(), FAKECUDA_DEVICES=devices)
    cmd = [sys.executable, "-m", "tests.cuda_worker_proc", daemon.target, SPECS[kind].name,
           worker, str(seed), str(rounds), str(TOKENS), "--fake", "--vmm", *flags]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def metric(client: HiCacheClient, name: str) -> float:
    port = client.get_info().metrics_port
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    got = prom.samples(body, name)
    assert got, f"{name} not exported"
    return got[0][1]


def holds(daemon: DaemonProc) -> dict[str, int]:
    """What the daemon process holds of workers' VMM memory: imported chunks (an open fd
    each), chunks mapped, reserved ranges."""
    pid = daemon.proc.pid
    fds = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds += os.readlink(f"/proc/{pid}/fd/{name}").startswith("/memfd:fakecuda-vmm-")
        except OSError:
            continue  # closed meanwhile
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {"imports": fds, "mappings": maps.count("memfd:fakecuda-vmm-"),
            "reservations": maps.count("memfd:fakecuda-reserved")}


NOTHING = {"imports": 0, "mappings": 0, "reservations": 0}


def finish(w: subprocess.Popen[str]) -> dict[str, object]:
    out, err = w.communicate(timeout=120)
    assert w.returncode == 0, err
    lines = [json.loads(x) for x in out.strip().splitlines()]
    r = lines[-1]
    assert r["mismatches"] == 0 and r["verified_buffers"] == r["rounds"] * r["buffers"] > 0, r
    first: dict[str, object] = lines[0]
    return first


@pytest.mark.parametrize("kind", list(SPECS))
def test_vmm_workers_round_trip_exactly(daemon: DaemonProc, client: HiCacheClient,
                                        kind: str) -> None:
    """Two workers (one numbering the GPUs the other way round: its device 0 is the daemon's
    device 1) store pages from VMM buffers and load them back into rows zeroed first: raw
    pages with per-layer events, keyed pages; every byte exact."""
    assert "cuda_vmm" in client.get_info().transports
    workers = [spawn(daemon, kind, f"{kind}-w0", 1, 4, f"{UUID_A},{UUID_B}", "--layer-events"),
               spawn(daemon, kind, f"{kind}-w1", 2, 4, f"{UUID_B},{UUID_A}", "--keyed")]
    firsts = [finish(w) for w in workers]
    assert [f["device_uuid"] for f in firsts] == [format_uuid(UUID_A), format_uuid(UUID_B)]
    assert client.list_sessions(SPECS[kind].name) == []
    assert metric(client, "hicache_cuda_vmm_chunks_mapped") == 0
    assert metric(client, "hicache_cuda_vmm_mapped_bytes") == 0
    assert holds(daemon) == NOTHING


def test_a_killed_vmm_worker_is_released_after_its_lease_and_the_next_is_served(
        daemon: DaemonProc, client: HiCacheClient) -> None:
    victim = spawn(daemon, "mha", "victim", 3, 0, f"{UUID_A},{UUID_B}", "--forever",
                   "--layer-events")
    assert victim.stdout is not None
    first = json.loads(victim.stdout.readline())
    before = metric(client, "hicache_transfer_requests_total")
    deadline = time.monotonic() + 30
    while metric(client, "hicache_transfer_requests_total") < before + 4:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    chunks = metric(client, "hicache_cuda_vmm_chunks_mapped")
    assert chunks >= 3  # K and V segments: a layer of each across two chunks
    assert metric(client, "hicache_cuda_vmm_mapped_bytes") >= chunks * GRANULE
    held = holds(daemon)
    assert held["imports"] == held["mappings"] == chunks and held["reservations"] >= 1, held
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    deadline = time.monotonic() + REAPED_WITHIN_S
    while any(s.public_id == public_session_id(first["session"]) for s in client.list_sessions()):
        assert time.monotonic() < deadline, "the dead worker's session was not reaped"
        time.sleep(0.1)
    assert metric(client, "hicache_cuda_vmm_chunks_mapped") == 0
    assert holds(daemon) == NOTHING, "the dead worker's GPU memory is still held by the daemon"
    assert metric(client, "hicache_sessions_reaped_total") >= 1
    finish(spawn(daemon, "mha", "next", 4, 2, f"{UUID_A},{UUID_B}"))
    assert holds(daemon) == NOTHING


def _descriptor(fd_indices: tuple[int, ...], chunk_bytes: tuple[int, ...],
                offset: int = 0) -> DeviceBufferSpec:
    return DeviceBufferSpec(member="kv", role=Role.K, layer=0, shape=(32, 2, 64),
                            dtype=DType.BFLOAT16, strides=(), transport="cuda_vmm",
                            fd_indices=fd_indices, chunk_bytes=chunk_bytes,
                            device_uuid=format_uuid(UUID_A), offset=offset, nbytes=8192)


def test_hostile_vmm_fds_get_structured_errors_and_are_closed(
        daemon: DaemonProc, client: HiCacheClient, tmp_path: Path) -> None:
    """Over the identity socket and gRPC: fds that are not exported chunks, indices past the
    fds passed, sizes off the granularity, a buffer outside its region. Each is a structured
    error of bounded size; the daemon keeps none of the fds and maps nothing."""
    plain = os.memfd_create("kv")
    os.ftruncate(plain, GRANULE)
    path = tmp_path / "kv.bin"
    path.write_bytes(b"\0" * GRANULE)
    regular = os.open(path, os.O_RDWR)
    pid = daemon.proc.pid
    open_fds = len(os.listdir(f"/proc/{pid}/fd"))
    cases = [  # (buffers, fds, reason, what its message says)
        ([_descriptor((0,), (GRANULE,))], [], "FD_REJECTED", "were handed over"),
        ([_descriptor((1,), (GRANULE,))], [plain], "FD_REJECTED", "were handed over"),
        ([_descriptor((0,), (GRANULE,))], [plain], "IPC_HANDLE_INVALID", "cannot be imported"),
        ([_descriptor((0,), (GRANULE,))], [regular], "IPC_HANDLE_INVALID",
         "cannot be imported"),
        ([_descriptor((0,), (GRANULE + 4096,))], [plain], "IPC_HANDLE_INVALID", "granularity"),
        ([_descriptor((0,), (GRANULE,), offset=GRANULE)], [plain], "IPC_HANDLE_INVALID",
         "leave the"),
        ([_descriptor((0, 0), (GRANULE, GRANULE))], [plain], "FD_REJECTED", "again"),
    ]
    try:
        for buffers, fds, reason, says in cases:
            with pytest.raises(HiCacheError) as info:
                client.open_session(SPECS["mha"].name, "hostile", buffers, fds=fds,
                                    heartbeat=False)
            err = info.value
            assert err.reason == reason and says in str(err), err
            assert err.grpc_code != grpc.StatusCode.INTERNAL  # type: ignore[attr-defined]
            assert len(str(err)) < 600
    finally:
        os.close(plain)
        os.close(regular)
    assert holds(daemon) == NOTHING
    deadline = time.monotonic() + 5
    while len(os.listdir(f"/proc/{pid}/fd")) > open_fds:  # every fd handed over is closed
        assert time.monotonic() < deadline, "the daemon kept fds it was handed"
        time.sleep(0.05)
    assert metric(client, "hicache_cuda_vmm_chunks_mapped") == 0
