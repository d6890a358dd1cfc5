"""The service in-process: create_server on a temp socket, metrics on its fresh registry."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from hicache.errors import HiCacheError
from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers
from hicached.server.app import HiCacheServer, create_server
from hicached.server.config import ServerConfig
from hicached.server.metrics import REASONS
from tests.helpers import sample

SPEC = PoolSpec("m", KVGeometry(PoolKind.MLA, DType.BFLOAT16, 2, kv_lora_rank=32,
                                qk_rope_head_dim=0), 4, size_tokens=256)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[HiCacheServer, HiCacheClient, Path]]:
    shm = tmp_path / "shm"
    shm.mkdir()
    cfg = ServerConfig(listen=(f"unix:{tmp_path}/s.sock",), shm_dir=str(shm),
                       state_dir=str(tmp_path / "state"),
                       metrics_listen="127.0.0.1:0", memory_budget_bytes=64 << 20,
                       reserve_bytes=0, pools=(SPEC,), grace_seconds=2)
    server, bound = create_server(cfg)
    client = HiCacheClient(bound[0], reconnect_seconds=0.5)
    yield server, client, shm
    client.close()
    server.drain_and_stop(1.0)


def test_declared_pool_exists_from_startup(served) -> None:  # type: ignore[no-untyped-def]
    _server, client, _ = served
    info = client.get_pool("m")
    assert info.page_num == 64 and info.spec == SPEC


def test_metrics_follow_known_operations(served) -> None:  # type: ignore[no-untyped-def]
    server, client, shm = served
    for reason in REASONS:
        assert server.registry.get_sample_value("hicache_rejected_requests_total",
                                                {"reason": reason}) == 0.0
    with ShmDeviceBuffers.create(SPEC, 32, str(shm)) as bufs:
        with client.open_session("m", "w", bufs.descriptors, heartbeat=False) as s:
            assert sample(server, "hicache_sessions_open") == 1
            host = client.alloc("m", 8)
            s.backup(host, torch.arange(8))
            s.load(host, torch.arange(8))
            s.load(host, torch.arange(8))
            with pytest.raises(HiCacheError):
                s.backup(host[:5], torch.arange(5))
    page_bytes = SPEC.page_bytes
    assert sample(server, "hicache_transfer_bytes_total", pool="m", op="backup") == 2 * page_bytes
    assert sample(server, "hicache_transfer_bytes_total", pool="m", op="load") == 4 * page_bytes
    assert sample(server, "hicache_transfer_requests_total", pool="m", op="load") == 2
    assert sample(server, "hicache_transfer_duration_seconds_count", pool="m", op="load") == 2
    assert sample(server, "hicache_rejected_requests_total",
                  reason="INDICES_NOT_PAGE_ALIGNED") == 1
    assert sample(server, "hicache_rpc_requests_total", method="Backup",
                  code="INVALID_ARGUMENT") == 1
    assert sample(server, "hicache_pool_used_pages", pool="m") == 2
    assert sample(server, "hicache_pool_capacity_pages", pool="m") == 64
    assert sample(server, "hicache_pool_capacity_bytes", pool="m") == 64 * page_bytes
    assert sample(server, "hicache_sessions_open") == 0
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as r:
        text = r.read().decode()
    assert "hicache_transfer_bytes_total" in text and "process_resident_memory_bytes" in text


def test_draining_refuses_new_work_with_unavailable(served) -> None:  # type: ignore[no-untyped-def]
    server, client, _ = served
    server.daemon.draining.set()
    with pytest.raises(HiCacheError) as exc:
        client.alloc("m", 4)  # not retried
    assert exc.value.reason == "DRAINING" and exc.value.grpc_code == grpc.StatusCode.UNAVAILABLE
    assert exc.value.from_daemon
    t0 = time.monotonic()
    with pytest.raises(HiCacheError) as exc:
        client.create_pool(SPEC)  # retried for reconnect_seconds: a successor may come up
    assert exc.value.reason == "DRAINING", exc.value  # not a generic "unreachable"
    assert time.monotonic() - t0 >= client.reconnect_seconds
    assert client.get_info().serving is False  # reads still answer
    server.daemon.draining.clear()
    client.create_pool(SPEC)  # served again once the drain is over


def test_an_unreachable_daemon_is_unavailable_after_retries(tmp_path: Path) -> None:
    client = HiCacheClient(f"unix:{tmp_path}/nobody.sock", reconnect_seconds=0.3)
    with pytest.raises(HiCacheError) as exc:
        client.get_info()
    assert exc.value.reason == "UNAVAILABLE" and not exc.value.from_daemon
    assert "unreachable" in exc.value.message
    client.close()


def test_budget_is_enforced(served) -> None:  # type: ignore[no-untyped-def]
    _, client, _ = served
    big = PoolSpec("big", SPEC.geometry, 4, size_bytes=128 << 20)
    with pytest.raises(HiCacheError) as exc:
        client.create_pool(big)
    assert exc.value.reason == "HOST_MEMORY_INSUFFICIENT"
    assert exc.value.metadata["budget_bytes"] == str(64 << 20)


def test_delete_pool_in_use_is_refused(served) -> None:  # type: ignore[no-untyped-def]
    _, client, shm = served
    with ShmDeviceBuffers.create(SPEC, 32, str(shm)) as bufs:
        with client.open_session("m", "w", bufs.descriptors, heartbeat=False):
            with pytest.raises(HiCacheError) as exc:
                client.delete_pool("m")
            assert exc.value.reason == "POOL_IN_USE"
    client.delete_pool("m")
    assert client.list_pools() == []


def test_closing_the_client_stops_heartbeats(served) -> None:  # type: ignore[no-untyped-def]
    _, client, shm = served
    with ShmDeviceBuffers.create(SPEC, 32, str(shm)) as bufs:
        session = client.open_session("m", "w", bufs.descriptors, lease_ms=90)
        thread = session._thread
        assert thread is not None and thread.is_alive()
        client.close()
        thread.join(2)
        assert not thread.is_alive()
        assert session.heartbeat_error is None


def test_drain_rpc_refuses_bad_grace_then_drains_once(served) -> None:  # type: ignore[no-untyped-def]
    server, client, _ = served
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(HiCacheError) as exc:
            client.drain(bad)
        assert exc.value.reason == "SPEC_INVALID"
        assert exc.value.violations[0].field == "grace_seconds"
    assert client.get_info().serving is True  # a refused drain changed nothing
    first = client.drain(0.5)
    assert first.grace_seconds == 0.5 and not first.already_draining
    try:
        second = client.drain(0.5)
        assert second.already_draining
    except HiCacheError as exc:  # the first drain may already have stopped the server
        assert exc.reason == "UNAVAILABLE"
    assert server.wait(10), "the drain stops the server"


def test_an_unexpected_failure_is_internal_counted_and_not_leaked(served, monkeypatch,
                                                                   caplog) -> None:  # type: ignore[no-untyped-def]
    server, client, _ = served

    def broken() -> list[object]:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(server.daemon.pools, "entries", broken)
    with pytest.raises(HiCacheError) as exc:
        client.list_pools()
    assert exc.value.grpc_code == grpc.StatusCode.INTERNAL and not exc.value.from_daemon
    assert "secret" not in exc.value.message and "see the daemon log" in exc.value.message
    assert "secret internals" in caplog.text  # logged with its traceback
    assert sample(server, "hicache_rpc_requests_total", method="ListPools", code="INTERNAL") == 1
    assert sample(server, "hicache_rpc_duration_seconds_count", method="ListPools") == 1


def test_interceptors_count_only_the_cache_service(served) -> None:  # type: ignore[no-untyped-def]
    server, client, _ = served
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = client.target
    with grpc.insecure_channel(target) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    client.ping()
    methods = {s.labels["method"] for m in server.registry.collect()
               if m.name == "hicache_rpc_requests" for s in m.samples}
    assert "Ping" in methods and not any("Health" in m or "/" in m for m in methods)


def test_cache_metrics_follow_stores_lookups_and_evictions(served) -> None:  # type: ignore[no-untyped-def]
    server, client, shm = served
    small = PoolSpec("small", SPEC.geometry, 4, size_tokens=8)  # two pages
    client.create_pool(small)
    with ShmDeviceBuffers.create(small, 16, str(shm)) as bufs:
        with client.open_session("small", "w", bufs.descriptors, heartbeat=False) as s:
            assert s.store([b"a", b"b", b"c"], torch.arange(12)).status == b"\x01\x01\x03"
            # evicts b: of one batch the deepest goes first (the default reuse eviction)
            assert s.store([b"c"], torch.arange(4)).status == b"\x01"
            client.lookup("small", [b"a", b"b", b"c", b"d"])
            with pytest.raises(HiCacheError):
                s.load_keys([b"b"], torch.arange(4))
            s.load_keys([b"c"], torch.arange(4))
    for status, n in (("stored", 3), ("no_space", 1), ("already_present", 0)):
        assert sample(server, "hicache_cache_store_keys_total", pool="small", status=status) == n
    assert sample(server, "hicache_cache_evicted_pages_total", pool="small") == 1
    for reason, n in (("store", 1), ("promotion", 0), ("alloc", 0)):  # a Store made room
        assert sample(server, "hicache_cache_evictions_total", pool="small", reason=reason) == n
    assert sample(server, "hicache_cache_evicted_age_seconds_count", pool="small") == 1
    assert sample(server, "hicache_cache_evicted_age_seconds_bucket", pool="small",
                  le="+Inf") == 1
    assert 0 <= sample(server, "hicache_cache_evicted_age_seconds_sum", pool="small") < 60
    assert sample(server, "hicache_cache_hit_ratio", pool="small") == 0.5  # 2 of 4 keys
    assert sample(server, "hicache_cache_lookup_keys_total", pool="small", result="hit") == 2
    assert sample(server, "hicache_cache_lookup_keys_total", pool="small", result="miss") == 2
    assert sample(server, "hicache_cache_load_misses_total", pool="small") == 1
    assert sample(server, "hicache_cache_keys", pool="small") == 2
    assert sample(server, "hicache_cache_eviction_margin", pool="small") == 0  # LRU so far
    assert sample(server, "hicache_rejected_requests_total", reason="KEY_NOT_FOUND") == 1
    assert sample(server, "hicache_transfer_pages_total", pool="small", op="store") == 3
    assert sample(server, "hicache_transfer_pages_total", pool="small", op="load_keys") == 1


def test_event_streams_are_bounded_resumable_and_end_on_drain(served) -> None:  # type: ignore[no-untyped-def]
    server, client, shm = served
    with ShmDeviceBuffers.create(SPEC, 32, str(shm)) as bufs:
        with client.open_session("m", "w", bufs.descriptors, heartbeat=False) as s:
            s.store([b"x", b"y"], torch.arange(8))
            client.remove_keys("m", [b"x"])
    streams = [client.watch_events("m") for _ in range(server.daemon.max_watchers)]
    got = [next(iter(st)) for st in streams]  # each holds a slot now
    assert {(e.seq, e.kind, e.keys) for e in got} == {(1, "STORED", (b"x", b"y"))}
    with pytest.raises(HiCacheError) as exc:
        next(iter(client.watch_events("m")))
    assert exc.value.reason == "TOO_MANY_WATCHERS" and exc.value.metadata["limit"] == "4"
    streams[0].cancel()
    deadline = time.monotonic() + 5
    while server.daemon.watchers == len(streams):  # the slot frees once the stream ends
        assert time.monotonic() < deadline
        time.sleep(0.05)
    resumed = client.watch_events("m", after_seq=1)
    resumed_iter = iter(resumed)
    assert next(resumed_iter).kind == "REMOVED"
    server.daemon.draining.set()  # a drain ends every stream, after what was already there
    for st in streams[1:]:
        assert [e.seq for e in st] == [2]
    assert list(resumed_iter) == []
    server.daemon.draining.clear()


def test_alloc_owner_must_be_a_session_of_that_pool(served) -> None:  # type: ignore[no-untyped-def]
    _, client, shm = served
    client.create_pool(PoolSpec("other", SPEC.geometry, 4, size_tokens=16))
    with ShmDeviceBuffers.create(SPEC, 32, str(shm)) as bufs:
        with client.open_session("m", "w", bufs.descriptors, heartbeat=False) as s:
            with pytest.raises(HiCacheError) as exc:
                client.alloc("other", 4, session_id=s.session_id)
            assert exc.value.reason == "SPEC_INVALID"
            assert client.get_pool("other").used_pages == 0
            owned = s.alloc(8)
            assert client.get_pool("m").raw_pages == 2 and owned.numel() == 8
        assert client.get_pool("m").raw_pages == 0  # freed with the session
    with pytest.raises(HiCacheError) as exc:
        client.alloc("m", 4, session_id="gone")
    assert exc.value.reason == "SESSION_NOT_FOUND"


def test_a_session_ending_under_a_copy_is_told_over_both_transports(served) -> None:  # type: ignore[no-untyped-def]
    """A session closed while a copy of it runs: its calls hear SESSION_ENDING with a retry
    delay over gRPC and over the fast path alike (the worker's fence waits on it), and
    SESSION_NOT_FOUND once the copy has ended."""
    from hicache.errors import SessionEnding

    server, client, shm = served
    with ShmDeviceBuffers.create(SPEC, 32, str(shm)) as bufs:
        s = client.open_session("m", "w", bufs.descriptors, heartbeat=False)
        sid = s.session_id
        with server.daemon.sessions.transfer(sid):  # a copy under way
            client.close_session(sid)
            for ask in (lambda: client.heartbeat(sid, timeout=0.3), lambda: client.beat(sid)):
                with pytest.raises(SessionEnding) as info:
                    ask()
                assert info.value.from_daemon
                assert info.value.reason == "SESSION_ENDING"
                assert info.value.retry_after() == 0.05
        with pytest.raises(HiCacheError) as exc:
            client.heartbeat(sid)
        assert exc.value.reason == "SESSION_NOT_FOUND"
        assert sample(server, "hicache_rpc_requests_total", method="Heartbeat",
                      code="UNAVAILABLE") >= 1
