"""deploy/: promtool-valid Prometheus config and alert rules (with rule unit tests), a Grafana
dashboard that only uses metrics the daemon exports, parseable manifests."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from hicache.errors import HiCacheError
from hicache.specs import CanarySpec, DType, KVGeometry, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers
from hicached.publish.kv_event_config import KvEventsConfig
from hicached.server.app import create_server
from hicached.server.config import ServerConfig
from hicached.tiers.config import DiskTierConfig
from tests import prom
from tests.deploy_files import CLUSTER_TIER, DEPLOY, deploy_metric_names, documented_metric
from tests.helpers import require_binary


def promtool() -> str:
    return require_binary("promtool", "prometheus")


@pytest.mark.parametrize("args", [
    ["check", "config", "prometheus.yml"],
    ["check", "rules", "alerts.yml"],
    ["test", "rules", "alerts_test.yml"],
])
def test_promtool(args: list[str]) -> None:
    out = subprocess.run([promtool(), *args], cwd=DEPLOY, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_manifests_parse() -> None:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "sidecar-pod.yaml").read_text()))
    pod = docs[0]
    names = [c["name"] for c in pod["spec"]["containers"]]
    assert names == ["hicached", "sglang"]
    sidecar = pod["spec"]["containers"][0]
    assert sidecar["readinessProbe"]["grpc"]["service"] == "hicache.v1.HostCache"
    assert {v["emptyDir"]["medium"] for v in pod["spec"]["volumes"]
            if v["name"].startswith("hicache")} == {"Memory"}
    unit = (DEPLOY / "systemd" / "hicached.service").read_text()
    for line in ("NoNewPrivileges=yes", "ProtectSystem=strict", "LimitMEMLOCK=infinity",
                 "RuntimeDirectory=hicached"):
        assert line in unit
    import tomllib

    from hicached.server.config import config_from_mapping

    cfg = config_from_mapping(tomllib.loads((DEPLOY / "hicached.toml").read_text()))
    assert cfg.pools[0].name == "llama3-8b-tp0"


@pytest.fixture
def scraped_names(tmp_path: Path) -> Iterator[set[str]]:
    """Metric names a daemon exports after every kind of operation."""
    shm = tmp_path / "shm"
    shm.mkdir()
    spec = PoolSpec("d", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 2, 16), 4,
                    size_tokens=64, canary=CanarySpec(16))
    server, bound = create_server(ServerConfig(
        listen=(f"unix:{tmp_path}/s.sock",), shm_dir=str(shm), metrics_listen="127.0.0.1:0",
        state_dir=str(tmp_path / "state"), disk=DiskTierConfig(str(tmp_path / "disk"), 1 << 30),
        memory_budget_bytes=1 << 26, reserve_bytes=0, pools=(spec,),
        kv_events=KvEventsConfig(endpoint=f"ipc://{tmp_path}/kv.sock")))
    try:
        with HiCacheClient(bound[0]) as c, ShmDeviceBuffers.create(spec, 16, str(shm)) as b:
            with c.open_session("d", "w", b.descriptors, heartbeat=False) as s:
                host = c.alloc("d", 4)
                s.backup(host, torch.arange(4))
                s.load(host, torch.arange(4))
                s.store([b"k"], torch.arange(4))
                deadline = time.monotonic() + 10
                while c.get_pool("d").disk_keys < 1:  # the spiller wrote it
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                c.remove_keys("d", [b"k"])
                with pytest.raises(HiCacheError):
                    c.alloc("d", 1000)
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as r:
            text = r.read().decode()
        yield prom.names(text)
    finally:
        server.drain_and_stop(1.0)


def test_dashboard_and_alerts_use_only_exported_metrics(scraped_names: set[str]) -> None:
    used = {m for m in deploy_metric_names() if not m.startswith(CLUSTER_TIER)}
    assert used and used <= scraped_names, used - scraped_names


def test_every_exported_metric_is_documented(scraped_names: set[str]) -> None:
    doc = (DEPLOY.parent / "docs" / "operations.md").read_text()
    ours = {n for n in scraped_names if n.startswith("hicache_")}
    assert ours and {n for n in ours if not documented_metric(n, doc)} == set()


def test_every_alert_has_a_runbook_entry() -> None:
    doc = (DEPLOY.parent / "docs" / "operations.md").read_text()
    headings = {line[4:].strip() for line in doc.splitlines() if line.startswith("### ")}
    rules = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
    assert alerts
    for rule in alerts:
        name = rule["alert"]
        assert name in headings, f"docs/operations.md has no runbook entry for {name}"
        assert rule["annotations"]["runbook"] == f"docs/operations.md#{name.lower()}"
        entry = doc.split(f"### {name}\n", 1)[1].split("\n### ", 1)[0]
        for part in ("**Means:**", "**Check:**", "**Do:**"):
            assert part in entry, f"{name}: runbook entry lacks {part}"
