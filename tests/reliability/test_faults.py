"""Faults: the daemon SIGKILLed or SIGTERMed mid-load, restarts on a stale socket, a full pool."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from hicache.errors import HiCacheError
from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec, Role
from hicache_client import HiCacheClient, ShmDeviceBuffers
from tests.daemon_proc import start_daemon
from tests.reliability.figures import record

SPEC = PoolSpec("faults", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 8, 4, 128), 16,
                Layout.LAYER_FIRST, size_tokens=64 * 16)


def loader(client: HiCacheClient, session_id: str, host: torch.Tensor, dev: torch.Tensor,
           outcomes: list[str], stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            client.load(session_id, host, dev)
            outcomes.append("ok")
        except HiCacheError as exc:
            outcomes.append(exc.reason)
            return


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_daemon_killed_mid_load(tmp_path: Path, sig: signal.Signals) -> None:
    daemon = start_daemon(tmp_path)
    client = HiCacheClient(daemon.target, reconnect_seconds=1.0, timeout=10)
    outcomes: list[str] = []
    n = 32 * 16
    with ShmDeviceBuffers.create(SPEC, 2 * n, daemon.shm_dir, prefix="fault") as bufs:
        k = bufs.layers("kv", Role.K)[3].view(torch.uint8)
        k.copy_(torch.randint(0, 256, k.shape, dtype=torch.uint8))
        k[n:2 * n] = 0  # loads land in zeroed rows: a load that moved nothing cannot pass
        client.create_pool(SPEC)
        session = client.open_session(SPEC.name, "w", bufs.descriptors, heartbeat=False,
                                      lease_ms=30_000)
        host = client.alloc(SPEC.name, n)
        session.backup(host, torch.arange(n))
        expect = k[:n].clone()
        stop = threading.Event()
        t = threading.Thread(target=loader, args=(client, session.session_id, host,
                                                  torch.arange(n, 2 * n), outcomes, stop))
        t.start()
        time.sleep(0.5)
        code = daemon.stop(sig, timeout=30)
        t.join(30)
        stop.set()
        assert not t.is_alive()
        assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL), daemon.log()
        assert outcomes.count("ok") >= 1
        # the load that was cut off ended with a clear, structured error
        assert outcomes[-1] in ("UNAVAILABLE", "DRAINING", "SESSION_NOT_FOUND"), \
            (outcomes[-1], daemon.log())
        # at least one load completed, and every write (the cut-off one's too) carried these
        assert torch.equal(k[n:2 * n], expect), "a completed load left wrong bytes"
        if sig == signal.SIGTERM:
            assert "drained" in daemon.log()
        # a new daemon starts on the same socket (stale after SIGKILL) and the same client
        # object reconnects to it
        again = start_daemon(tmp_path)
        try:
            assert client.get_info().serving
        finally:
            assert again.stop() == 0
    client.close()
    record(f"daemon_{sig.name}_mid_load", faults_injected=1, loads_completed=outcomes.count("ok"))


def test_full_pool_is_resource_exhausted_and_recovers(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path)
    try:
        with HiCacheClient(daemon.target) as c:
            c.create_pool(SPEC)
            held = [c.alloc(SPEC.name, 16 * 16) for _ in range(4)]
            with pytest.raises(HiCacheError) as exc:
                c.alloc(SPEC.name, 16)
            assert exc.value.reason == "POOL_EXHAUSTED"
            assert exc.value.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
            assert exc.value.metadata["free_pages"] == "0"
            c.free(SPEC.name, held.pop())
            assert c.alloc(SPEC.name, 16 * 16).numel() == 256
            assert c.get_pool(SPEC.name).free_pages == 0
    finally:
        assert daemon.stop() == 0
    record("full_pool", faults_injected=1)
