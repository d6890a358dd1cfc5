"""CreatePool answers at once; the pool builds in the background (CREATING -> READY / FAILED).

The build is held at a gate (``HostPool`` wrapped in the table's module) so the CREATING state is
observed for certain, through a real in-process server and its gRPC API.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.errors import HiCacheError, HostMemoryInsufficient, PinFailed
from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers
from hicached.server.app import HiCacheServer, create_server
from hicached.server.config import ServerConfig
from hicached.service import pool_table

SPEC = PoolSpec("slow", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 2, 64), 16,
                size_tokens=16 * 64)


class Gate:
    """Holds every pool build until ``open``; ``fail`` makes the next build fail."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.fail: Exception | None = None
        real = pool_table.HostPool  # type: ignore[attr-defined]

        def gated(*args: Any, **kw: Any) -> Any:
            self.entered.set()
            kw["on_progress"](1)  # a first chunk faulted in: progress shows
            assert self.opened.wait(30)
            if self.fail is not None:
                raise self.fail
            return real(*args, **kw)

        gated.metadata_bytes_per_page = real.metadata_bytes_per_page  # type: ignore[attr-defined]
        monkeypatch.setattr(pool_table, "HostPool", gated)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[HiCacheServer, str, str]]:
    shm = tmp_path / "shm"
    shm.mkdir()
    server, bound = create_server(ServerConfig(
        listen=(f"unix:{tmp_path}/s.sock",), shm_dir=str(shm), metrics_listen="",
        state_dir=str(tmp_path / "state"),
        memory_budget_bytes=64 << 20, reserve_bytes=0))
    yield server, bound[0], str(shm)
    server.drain_and_stop(1.0)


def test_create_answers_at_once_and_the_pool_is_not_ready_until_built(
        served, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    server, target, shm = served
    gate = Gate(monkeypatch)
    with HiCacheClient(target, reconnect_seconds=0) as c:
        t0 = time.monotonic()
        info = c.create_pool(SPEC, wait=False)
        assert time.monotonic() - t0 < 5 and info.state == "CREATING"
        assert gate.entered.wait(10)
        info = c.get_pool(SPEC.name)
        assert info.state == "CREATING" and 0 < info.progress < 1
        assert server.registry.get_sample_value(  # scraped progress, state-labelled
            "hicache_pool_build_progress", {"pool": SPEC.name, "state": "CREATING"}
        ) == pytest.approx(info.progress)
        assert [p.state for p in c.list_pools()] == ["CREATING"]
        assert c.create_pool(SPEC, wait=False).state == "CREATING"  # idempotent meanwhile
        for call in (lambda: c.alloc(SPEC.name, 16), lambda: c.lookup(SPEC.name, [b"k"])):
            with pytest.raises(HiCacheError) as exc:
                call()
            assert exc.value.reason == "POOL_NOT_READY"
            assert exc.value.metadata["state"] == "CREATING"
        with ShmDeviceBuffers.create(SPEC, 16, shm) as bufs, pytest.raises(HiCacheError) as exc:
            c.open_session(SPEC.name, "early", bufs.descriptors)
        assert exc.value.reason == "POOL_NOT_READY"
        assert c.get_info().serving  # control calls answer while it builds
        gate.opened.set()
        info = c.create_pool(SPEC)  # waits for READY
        assert info.state == "READY" and info.page_num == 64
        assert server.registry.get_sample_value(
            "hicache_pool_build_progress", {"pool": SPEC.name, "state": "CREATING"}) is None
        with ShmDeviceBuffers.create(SPEC, 16, shm) as bufs:
            s = c.open_session(SPEC.name, "ready", bufs.descriptors)
            s.backup(c.alloc(SPEC.name, 16), torch.arange(16))
            s.close()


def test_a_failed_build_says_why_and_can_be_retried(
        served, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    server, target, _ = served
    gate = Gate(monkeypatch)
    gate.fail = PinFailed("cudaHostRegister refused the pool", metadata={"bytes": 1})
    gate.opened.set()
    with HiCacheClient(target, reconnect_seconds=0) as c:
        with pytest.raises(PinFailed):
            c.create_pool(SPEC)
        info = c.get_pool(SPEC.name)
        assert (info.state, info.error_reason) == ("FAILED", "PIN_FAILED")
        assert "refused" in info.error
        with pytest.raises(HiCacheError) as exc:
            c.alloc(SPEC.name, 16)
        assert exc.value.metadata["state"] == "FAILED"
        assert server.daemon.pools.used_bytes == 0  # a failed build holds no budget
        gate.fail = None
        assert c.create_pool(SPEC).state == "READY"  # the same spec builds again


def test_the_budget_is_reserved_when_a_build_starts(
        served, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    _, target, _ = served
    gate = Gate(monkeypatch)
    big = PoolSpec("big", SPEC.geometry, 16, size_bytes=40 << 20)
    with HiCacheClient(target, reconnect_seconds=0) as c:
        assert c.create_pool(big, wait=False).state == "CREATING"
        with pytest.raises(HostMemoryInsufficient):  # 40 of 64 MiB are spoken for already
            c.create_pool(PoolSpec("big2", SPEC.geometry, 16, size_bytes=40 << 20), wait=False)
        gate.opened.set()
        assert c.create_pool(big).state == "READY"
