"""Overload: the data path is bounded, control calls and probes are not starved by it.

Data calls (Backup, Load, Store, LoadKeys, Lookup) run on their own executor, at most
``max_data_rpcs`` at once, and are refused at once past it with ``OVERLOADED`` and a
``RetryInfo``; control calls (heartbeats, sessions, pools, health) keep the server's threads
however busy transfers are, and a health-only server on its own threads (``health_listen``)
answers probes apart from the API.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from hicache.error_mapping import from_status_bytes
from hicache.errors import HiCacheError
from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache.v1 import hicache_pb2 as pb
from hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache_client import HiCacheClient, ShmDeviceBuffers
from hicached.frontends.envelope import Call, Refused
from hicached.frontends.interceptors import ExecutorInterceptor
from hicached.server.app import HiCacheServer, create_server
from hicached.server.config import ServerConfig

SPEC = PoolSpec("busy", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 16, 8, 128), 16,
                Layout.LAYER_FIRST, size_tokens=64 * 16 * 10)
BATCH = 64 * 16  # tokens: 64 pages, 64 MiB per backup


def test_admission_refuses_past_the_limit_and_lets_control_through(tmp_path: Path) -> None:
    """The envelope's gate, as both front ends meet it: a data call past the limit is refused
    at once, a control call is never gated, the slot comes back."""
    shm = tmp_path / "shm"
    shm.mkdir()
    server, _ = create_server(ServerConfig(
        listen=(f"unix:{tmp_path}/s.sock",), shm_dir=str(shm), state_dir="",
        metrics_listen="", memory_budget_bytes=64 << 20, reserve_bytes=0, max_data_rpcs=1))
    env = server.envelope
    entered, release = threading.Event(), threading.Event()

    def slow(request: object) -> str:
        entered.set()
        release.wait(10)
        return "done"

    def backup() -> object:
        return env.run(Call("Backup", "fast"), lambda: None, slow)

    try:
        first = threading.Thread(target=backup)
        first.start()
        assert entered.wait(10)
        with pytest.raises(Refused) as exc:
            backup()
        refused = from_status_bytes(exc.value.status.SerializeToString())
        assert refused.reason == "OVERLOADED"
        assert refused.metadata == {"in_flight": "1", "limit": "1", "retry_after_ms": "10"}
        assert env.run(Call("Heartbeat", "grpc"), lambda: None, lambda r: "beat") == "beat"
        release.set()
        first.join(10)
        assert env.gate.in_flight == 0
        assert backup() == "done"  # the slot came back
    finally:
        release.set()
        server.drain_and_stop(1.0)


def test_data_calls_get_their_own_executor() -> None:
    pool = ThreadPoolExecutor(1)
    ex = ExecutorInterceptor(pool, {"Backup", "LoadKeys"})

    def handler(request: object, context: object) -> str:
        return "ran"

    backup, heartbeat = ex.wrap("Backup", handler), ex.wrap("Heartbeat", handler)
    assert backup.experimental_thread_pool is pool  # type: ignore[attr-defined]
    assert backup(None, None) == "ran"
    assert heartbeat is handler and not hasattr(heartbeat, "experimental_thread_pool")
    pool.shutdown()


@pytest.mark.parametrize("data_path", ["grpc", "fast"])
def test_control_answers_with_every_data_thread_busy(tmp_path: Path, data_path: str) -> None:
    """Two control threads, two data slots, six flooding workers: with one shared pool the
    copies would hold every thread; here control calls never queue behind them, whether the
    copies come over gRPC (its data executor) or the fast path (its connections' threads)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    server, bound = create_server(ServerConfig(
        listen=(f"unix:{tmp_path}/api.sock",), shm_dir=str(shm), state_dir="",
        metrics_listen="", memory_budget_bytes=2 << 30, reserve_bytes=0, grpc_threads=2,
        max_data_rpcs=2, max_watchers=1, copy_threads=1, pools=(SPEC,)))
    stop = threading.Event()
    running: set[str] = set()
    try:
        with ShmDeviceBuffers.create(SPEC, BATCH, str(shm)) as bufs, \
                HiCacheClient(bound[0], reconnect_seconds=0,
                              fast_path=data_path == "fast") as c:
            s = c.open_session(SPEC.name, "flood", bufs.descriptors)
            hosts = [c.alloc(SPEC.name, BATCH) for _ in range(6)]

            def flood(host: torch.Tensor) -> None:
                while not stop.is_set():
                    try:
                        s.backup(host, torch.arange(BATCH))
                    except HiCacheError:
                        pass

            threads = [threading.Thread(target=flood, args=(h,)) for h in hosts]
            for t in threads:
                t.start()
            worst = 0.0
            with HiCacheClient(bound[0], reconnect_seconds=0, timeout=5) as ctl:
                for _ in range(40):
                    running |= {t.name.split("_")[0] for t in threading.enumerate()}
                    t0 = time.monotonic()
                    ctl.heartbeat(s.session_id)
                    ctl.get_pool(SPEC.name)
                    worst = max(worst, time.monotonic() - t0)
            stop.set()
            for t in threads:
                t.join(30)
            assert c.data_path == data_path
        # the copies ran on the data executor (or the fast path's threads), not control's
        assert any(name.startswith("data" if data_path == "grpc" else "fast-")
                   for name in running), running
        assert worst < 1.0, f"a control call waited {worst:.2f}s behind transfers"
    finally:
        stop.set()
        server.drain_and_stop(1.0)


@pytest.fixture
def busy(tmp_path: Path) -> Iterator[tuple[HiCacheServer, str, str]]:
    shm = tmp_path / "shm"
    shm.mkdir()
    server, bound = create_server(ServerConfig(
        listen=(f"unix:{tmp_path}/api.sock",), health_listen=(f"unix:{tmp_path}/health.sock",),
        shm_dir=str(shm), state_dir=str(tmp_path / "state"), metrics_listen="",
        memory_budget_bytes=2 << 30, reserve_bytes=0,
        grpc_threads=4, max_data_rpcs=2, max_watchers=1, copy_threads=1, pools=(SPEC,)))
    yield server, bound[0], str(shm)
    server.drain_and_stop(1.0)


def test_saturated_data_path_refuses_transfers_not_control(busy) -> None:  # type: ignore[no-untyped-def]
    server, target, shm = busy
    assert server.config.max_data_rpcs == 2
    outcomes: list[str] = []
    stop = threading.Event()
    with ShmDeviceBuffers.create(SPEC, BATCH, shm) as bufs, \
            HiCacheClient(target, reconnect_seconds=0) as fast_fail:
        session = fast_fail.open_session(SPEC.name, "flood", bufs.descriptors)
        hosts = [fast_fail.alloc(SPEC.name, BATCH) for _ in range(8)]

        def flood(host: torch.Tensor) -> None:
            while not stop.is_set():
                try:
                    session.backup(host, torch.arange(BATCH))
                    outcomes.append("ok")
                except HiCacheError as exc:
                    outcomes.append(exc.reason)

        threads = [threading.Thread(target=flood, args=(h,)) for h in hosts]
        for t in threads:
            t.start()
        try:
            control_ok = 0
            with HiCacheClient(target, reconnect_seconds=0) as ctl, \
                    grpc.insecure_channel(f"unix:{server.health_bound[0][5:]}") as ch:
                probe = health_pb2_grpc.HealthStub(ch)
                deadline = time.monotonic() + 60
                while "OVERLOADED" not in outcomes or control_ok < 30:
                    assert time.monotonic() < deadline, "the data path never filled"
                    ctl.heartbeat(session.session_id)
                    assert ctl.get_pool(SPEC.name).spec.name == SPEC.name
                    assert ctl.health("hicache.v1.HostCache")
                    r = probe.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                    assert r.status == health_pb2.HealthCheckResponse.SERVING
                    control_ok += 1
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert outcomes.count("ok") > 0
        assert set(outcomes) <= {"ok", "OVERLOADED"}, set(outcomes)
        # a client that may retry gets through once a slot frees (the daemon's hint)
        with HiCacheClient(target, reconnect_seconds=10) as patient:
            assert patient.backup(session.session_id, hosts[0], torch.arange(BATCH)).pages == 64


def test_overloaded_travels_with_retry_info(busy) -> None:  # type: ignore[no-untyped-def]
    server, target, _ = busy
    gate = server.admission
    gate.limit = 0  # every data call is refused: the wire form is what is checked here
    try:
        with grpc.insecure_channel(target) as ch:
            stub = pb_grpc.HostCacheStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                stub.Lookup(pb.LookupRequest(pool=SPEC.name, keys=[b"k"]), timeout=5)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            status = rpc_status.from_call(err.value)
            assert status is not None
            retry = [d for d in status.details if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR)]
            assert len(retry) == 1
            info = error_details_pb2.RetryInfo()
            retry[0].Unpack(info)
            assert info.retry_delay.ToMilliseconds() == 10
            stub.ListPools(pb.ListPoolsRequest(), timeout=5)  # control still answers
    finally:
        gate.limit = 2


def test_health_only_listener_serves_no_api(busy) -> None:  # type: ignore[no-untyped-def]
    server, _target, _ = busy
    with grpc.insecure_channel(f"unix:{server.health_bound[0][5:]}") as ch:
        assert health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="hicache.v1.HostCache"), timeout=5
        ).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.HostCacheStub(ch).ListPools(pb.ListPoolsRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
