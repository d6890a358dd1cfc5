"""A real Prometheus server scrapes a real daemon with the scrape config from deploy/."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from hicache.errors import HiCacheError
from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers
from tests.daemon_proc import start_daemon
from tests.helpers import free_port, require_binary

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SPEC = PoolSpec("prom", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 2, 32), 8,
                Layout.PAGE_FIRST, size_tokens=512)


def query(port: int, expr: str) -> list[dict[str, object]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def wait_value(port: int, expr: str, want: float, timeout: float = 40.0) -> None:
    deadline = time.monotonic() + timeout
    got: object = None
    while time.monotonic() < deadline:
        try:
            res = query(port, expr)
        except OSError:
            res = []
        if res:
            got = float(res[0]["value"][1])  # type: ignore[index]
            if got == want:
                return
        time.sleep(0.5)
    raise AssertionError(f"{expr}: Prometheus has {got}, expected {want}")


def test_prometheus_scrapes_transfers_rejections_and_capacity(tmp_path: Path) -> None:
    prometheus = require_binary("prometheus", "prometheus")
    mport, pport = free_port(), free_port()
    daemon = start_daemon(tmp_path, "--metrics-listen", f"127.0.0.1:{mport}")
    cfg = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    cfg["global"]["scrape_interval"] = cfg["global"]["evaluation_interval"] = "1s"
    job = cfg["scrape_configs"][0]
    job["scrape_interval"], job["scrape_timeout"] = "1s", "1s"
    job["static_configs"] = [{"targets": [f"127.0.0.1:{mport}"]}]
    cfg["rule_files"] = [str(DEPLOY / "alerts.yml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    with open(tmp_path / "prometheus.log", "wb") as log:
        prom = subprocess.Popen(
            [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{pport}"],
            stdout=subprocess.DEVNULL, stderr=log)
    try:
        with HiCacheClient(daemon.target) as c:
            pool = c.create_pool(SPEC)
            with ShmDeviceBuffers.create(SPEC, 64, daemon.shm_dir) as bufs:
                with c.open_session(SPEC.name, "w", bufs.descriptors) as s:
                    host = c.alloc(SPEC.name, 16)
                    for _ in range(3):
                        s.backup(host, torch.arange(16))
                    for _ in range(2):
                        s.load(host, torch.arange(16))
                    with pytest.raises(HiCacheError) as exc:
                        s.backup(host[:12], torch.arange(12))
                    assert exc.value.reason == "INDICES_NOT_PAGE_ALIGNED"
        wait_value(pport, 'up{job="hicached"}', 1)
        wait_value(pport, 'hicache_transfer_bytes_total{job="hicached",pool="prom",op="backup"}',
                   3 * 2 * SPEC.page_bytes)
        wait_value(pport, 'hicache_transfer_bytes_total{job="hicached",pool="prom",op="load"}',
                   2 * 2 * SPEC.page_bytes)
        wait_value(pport, 'hicache_rejected_requests_total{reason="INDICES_NOT_PAGE_ALIGNED"}', 1)
        wait_value(pport, 'hicache_rejected_requests_total{reason="CANARY_MISMATCH"}', 0)
        wait_value(pport, 'hicache_pool_capacity_bytes{pool="prom"}', pool.capacity_bytes)
        wait_value(pport, 'hicache_pool_capacity_pages{pool="prom"}', 64)
        with urllib.request.urlopen(f"http://127.0.0.1:{pport}/api/v1/rules", timeout=5) as r:
            groups = json.loads(r.read())["data"]["groups"]
        assert [g["name"] for g in groups] == ["hicached"]
    finally:
        prom.terminate()
        prom.wait(20)
        assert daemon.stop() == 0, daemon.log()
