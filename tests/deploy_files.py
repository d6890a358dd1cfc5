"""The deployment files as tests read them: the Kubernetes manifests, and the metric names the
dashboard and the alert rules use.

Primitives: ``DEPLOY``, ``KUBE`` (their directories); ``docs(path)`` (a YAML file's
documents); ``deploy_metric_names()``; ``CLUSTER_TIER`` (the prefix of the cluster tier's
metrics, on a daemon joined to a Mooncake master only); ``documented_metric(name, doc)``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
KUBE = DEPLOY / "kubernetes"


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def deploy_metric_names() -> set[str]:
    """Every hicache_ metric the dashboard and the alert rules use."""
    dash = json.loads((DEPLOY / "grafana" / "hicached-dashboard.json").read_text())
    rules = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    return {m for e in exprs for m in re.findall(r"\bhicache_[a-z_]+", e)}


CLUSTER_TIER = ("hicache_cluster_", "hicache_remote_")
"""The cluster tier's metrics (and their deprecated names) exist only on a daemon joined to a
Mooncake master: they are checked against a real scrape in tests/procs/test_mooncake_e2e.py."""


def documented_metric(name: str, doc: str) -> bool:
    """Documented by name, as a histogram's or counter's family, in docs/operations.md."""
    family = re.sub(r"_(bucket|sum|count|created|total)$", "", name)
    return f"`{name}`" in doc or f"`{family}" in doc
