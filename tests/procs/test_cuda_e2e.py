"""End to end on the CUDA IPC path with the fake driver: a real daemon process, real worker
processes that number the GPUs differently, a SIGKILLed worker whose mappings must go."""

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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.buffers import DeviceBufferSpec
from hicache.errors import HiCacheError
from hicache.identity import public_session_id
from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec, Role
from hicache_client import HiCacheClient
from tests import prom
from tests.daemon_proc import REAPED_WITHIN_S, REPO, DaemonProc, start_daemon
from tests.fakecuda import UUID_A, UUID_B, format_uuid, library

SPEC = PoolSpec("gpu", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 4, 2, 64), 16,
                Layout.PAGE_FIRST, size_tokens=4096)
TOKENS = 16 * 16


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    lib = library()
    saved = {k: os.environ.get(k) for k in ("HICACHED_CUDA_DRIVER", "FAKECUDA_DEVICES",
                                            "FAKECUDA_DEFER")}
    os.environ["HICACHED_CUDA_DRIVER"] = lib
    os.environ["FAKECUDA_DEVICES"] = f"{UUID_A},{UUID_B}"
    os.environ["FAKECUDA_DEFER"] = "1"  # the daemon's copies run only when it synchronizes
    try:
        d = start_daemon(tmp_path_factory.mktemp("cuda-daemon"))
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
    c.create_pool(SPEC)
    yield c
    c.close()


def spawn(daemon: DaemonProc, worker: str, seed: int, rounds: int, devices: str,
          *flags: str) -> subprocess.Popen[str]:
    env = dict(os.environ, HICACHED_CUDA_DRIVER=library(), FAKECUDA_DEVICES=devices)
    cmd = [sys.executable, "-m", "tests.cuda_worker_proc", daemon.target, SPEC.name, worker,
           str(seed), str(rounds), str(TOKENS), "--fake", *flags]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def metric(client: HiCacheClient, name: str) -> float:
    port = client.get_info().metrics_port
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    got = prom.samples(body, name)
    assert got, f"{name} not exported"
    return got[0][1]


def test_daemon_reports_its_gpus_and_pins_pools(client: HiCacheClient) -> None:
    info = client.get_info()
    assert info.cuda_available and "cuda_ipc" in info.transports
    assert [d.uuid for d in info.cuda_devices] == [format_uuid(UUID_A), format_uuid(UUID_B)]
    pool = client.get_pool(SPEC.name)
    assert pool.pinned_bytes == pool.capacity_bytes > 0
    assert metric(client, "hicache_pool_pin_seconds") >= 0


def test_workers_numbering_gpus_differently_round_trip_exactly(daemon: DaemonProc,
                                                               client: HiCacheClient) -> None:
    # worker 1 sees the GPUs the other way round: its device 0 is the daemon's device 1
    workers = [spawn(daemon, "w0", 1, 4, f"{UUID_A},{UUID_B}"),
               spawn(daemon, "w1", 2, 4, f"{UUID_B},{UUID_A}", "--layer-events")]
    results = []
    for w in workers:
        out, err = w.communicate(timeout=120)
        assert w.returncode == 0, err
        lines = [json.loads(x) for x in out.strip().splitlines()]
        results.append(lines)
    assert results[0][0]["device_uuid"] == format_uuid(UUID_A)
    assert results[1][0]["device_uuid"] == format_uuid(UUID_B)
    for lines in results:
        r = lines[-1]
        assert r["mismatches"] == 0 and r["verified_buffers"] == 4 * r["buffers"] > 0
    assert client.list_sessions(SPEC.name) == []
    assert metric(client, "hicache_cuda_ipc_handles_open") == 0


def test_keyed_store_and_load_over_cuda_ipc(daemon: DaemonProc,
                                            client: HiCacheClient) -> None:
    """Store and LoadKeys on the GPU path: synchronous, and with layer events (the pages stay
    held until the Completer saw the copies land, then are released and evictable)."""
    workers = [spawn(daemon, "k0", 5, 4, f"{UUID_A},{UUID_B}", "--keyed"),
               spawn(daemon, "k1", 6, 4, f"{UUID_B},{UUID_A}", "--keyed", "--layer-events")]
    for w in workers:
        out, err = w.communicate(timeout=120)
        assert w.returncode == 0, err
        r = json.loads(out.strip().splitlines()[-1])
        assert r["mismatches"] == 0 and r["verified_buffers"] == 4 * r["buffers"] > 0
    pool = client.get_pool(SPEC.name)
    assert pool.busy_pages == 0 and pool.keys == 0  # every round removed its keys
    assert metric(client, "hicache_cuda_ipc_handles_open") == 0


def test_killed_worker_releases_its_gpu_mappings(daemon: DaemonProc,
                                                 client: HiCacheClient) -> None:
    victim = spawn(daemon, "victim", 3, 0, f"{UUID_A},{UUID_B}", "--forever", "--layer-events")
    assert victim.stdout is not None
    first = json.loads(victim.stdout.readline())
    deadline = time.monotonic() + 30
    while metric(client, "hicache_transfer_requests_total") < 4:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert metric(client, "hicache_cuda_ipc_handles_open") == 2  # K and V allocations
    assert "memfd:fakecuda" in Path(f"/proc/{daemon.proc.pid}/maps").read_text()
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    deadline = time.monotonic() + REAPED_WITHIN_S
    while any(s.public_id == public_session_id(first["session"]) for s in client.list_sessions()):
        assert time.monotonic() < deadline, "the dead worker's session was not reaped"
        time.sleep(0.1)
    assert metric(client, "hicache_cuda_ipc_handles_open") == 0
    assert metric(client, "hicache_cuda_ipc_mapped_bytes") == 0
    assert "memfd:fakecuda" not in Path(f"/proc/{daemon.proc.pid}/maps").read_text(), \
        "the dead worker's GPU memory is still mapped by the daemon"
    assert metric(client, "hicache_sessions_reaped_total") >= 1


def test_backup_refuses_layer_event_completion(daemon: DaemonProc,
                                               client: HiCacheClient) -> None:
    from hicache.calls import TransferRequest
    from hicache.errors import SpecInvalid

    with pytest.raises(SpecInvalid, match="COMPLETION_LAYER_EVENTS"):
        q = TransferRequest("no-such-session", b"", b"", (0, 0), True)  # type: ignore[arg-type]
        client.call("Backup", q)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(handle=st.one_of(st.binary(min_size=64, max_size=64), st.binary(max_size=80),
                        st.just(b"FAKECUDA" + b"\xff" * 56)),
       uuid=st.sampled_from([format_uuid(UUID_A), format_uuid(UUID_B), "GPU-nope", ""]),
       offset=st.integers(-(2**40), 2**40), nbytes=st.integers(-8, 2**40),
       events=st.lists(st.binary(max_size=70), max_size=3))
def test_hostile_cuda_handles_get_structured_errors(client: HiCacheClient, handle: bytes,
                                                    uuid: str, offset: int, nbytes: int,
                                                    events: list[bytes]) -> None:
    buf = DeviceBufferSpec(member="kv", role=Role.K, layer=0, shape=(32, 2, 64),
                           dtype=DType.BFLOAT16, strides=(), transport="cuda_ipc",
                           ipc_handle=handle, device_uuid=uuid, offset=offset, nbytes=nbytes)
    with pytest.raises(HiCacheError) as info:
        client.open_session(SPEC.name, "fuzz", [buf], layer_events=events, heartbeat=False)
    err = info.value
    assert err.reason in {"IPC_HANDLE_INVALID", "DEVICE_NOT_FOUND", "SPEC_INVALID",
                          "GEOMETRY_MISMATCH"}, err
    assert err.grpc_code != grpc.StatusCode.INTERNAL  # type: ignore[attr-defined]
    assert metric(client, "hicache_cuda_ipc_handles_open") == 0


def test_hicachectl_shows_gpus(daemon: DaemonProc, client: HiCacheClient) -> None:
    out = subprocess.run([sys.executable, "-m", "hicache_client.cli", "--target", daemon.target,
                          "status"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "cuda_ipc" in out.stdout and format_uuid(UUID_B) in out.stdout


def test_layer_event_counts_that_leave_an_event_unrecorded_are_refused(
        client: HiCacheClient) -> None:
    from hicache.errors import SpecInvalid

    # 4 layers in 3 events would be groups of 2: the third event would never fire
    with pytest.raises(SpecInvalid, match=r"use one of \[1, 2, 4\]"):
        client.open_session(SPEC.name, "events", [], layer_events=[b"\0" * 64] * 3,
                            heartbeat=False)
