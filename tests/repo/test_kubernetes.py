"""deploy/kubernetes/: every manifest valid against Kubernetes' own schemas (strict: an unknown
or misspelled field fails), the node DaemonSet and the pods that use it wired to one socket,
GPUs reached only the supported ways."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.deploy_files import KUBE, docs

MANIFESTS = sorted(KUBE.glob("*.yaml"))
VERSIONS = ["1.34.0", "1.37.0"]
"""The oldest with dynamic resource allocation's v1 API (the sidecar's shared GPU claim), and the
newest the validator carries."""
CUSTOM = {("monitoring.coreos.com/v1", "ServiceMonitor")}
"""Kinds of operators, not of Kubernetes: no schema to check them against."""


def arg(container: dict[str, Any], flag: str) -> str:
    got = [a.split("=", 1)[1] for a in container.get("args", []) if a.startswith(flag + "=")]
    assert len(got) == 1, f"{container['name']}: {flag} {got}"
    return str(got[0])


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = doc["spec"]
    return spec["template"]["spec"] if "template" in spec else spec


def test_there_are_a_daemonset_a_pod_for_it_and_a_sidecar_pod() -> None:
    assert [p.name for p in MANIFESTS] == ["hicached-daemonset.yaml", "inference-pod.yaml",
                                           "sidecar-pod.yaml", "vllm-pod.yaml",
                                           "vllm-sidecar-pod.yaml"]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_is_valid_kubernetes(path: Path, version: str) -> None:
    import kubernetes_validate

    checked = 0
    for d in docs(path):
        if (d["apiVersion"], d["kind"]) in CUSTOM:
            continue
        kubernetes_validate.validate(d, version, strict=True)
        checked += 1
    assert checked


def test_the_validator_catches_a_misspelled_field() -> None:
    import kubernetes_validate

    ds = docs(KUBE / "hicached-daemonset.yaml")[1]
    ds["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, VERSIONS[-1], strict=True)


def test_no_container_is_given_gpus_by_an_environment_variable_alone() -> None:
    """NVIDIA_VISIBLE_DEVICES without a GPU request sees every GPU where the runtime honours it
    and none where it is hardened: only with the nvidia runtime class and its volume-mount
    device list (the node agent's way), never in a container of an ordinary pod."""
    for path in MANIFESTS:
        for d in docs(path):
            if d["kind"] not in ("Pod", "DaemonSet"):
                continue
            spec = pod_spec(d)
            for c in spec["containers"]:
                env = {e["name"]: e.get("value") for e in c.get("env", [])}
                if "NVIDIA_VISIBLE_DEVICES" not in env:
                    continue
                assert spec.get("runtimeClassName") == "nvidia", (path.name, c["name"])
                mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
                assert f"/var/run/nvidia-container-devices/{env['NVIDIA_VISIBLE_DEVICES']}" \
                    in mounts, (path.name, c["name"])
                assert "nvidia.com/gpu" not in c.get("resources", {}).get("limits", {})


def vllm_extra(container: dict[str, Any]) -> dict[str, Any]:
    """The ``kv_connector_extra_config`` of a vLLM container's ``--kv-transfer-config``
    (tests/integrations/vllm/test_vllm_offloading.py reads the same line with vLLM's own parser)."""
    import json

    assert container["command"] == ["vllm", "serve"]
    kv = json.loads(arg(container, "--kv-transfer-config"))
    assert (kv["kv_connector"], kv["kv_connector_module_path"], kv["kv_role"],
            kv["kv_load_failure_policy"]) == ("HicachedOffloadingConnector",
                                              "hicache_vllm.connector", "kv_both", "recompute")
    extra: dict[str, Any] = kv["kv_connector_extra_config"]
    assert (extra["spec_name"], extra["spec_module_path"]) == ("HicachedOffloadingSpec",
                                                               "hicache_vllm.spec")
    return extra


@pytest.mark.parametrize("name", ["sidecar-pod.yaml", "vllm-sidecar-pod.yaml"])
def test_the_sidecar_and_the_engine_share_one_gpu_claim_and_the_socket(name: str) -> None:
    pod = docs(KUBE / name)[0]
    sidecar, engine = pod["spec"]["containers"]
    listen = arg(sidecar, "--listen")
    if engine["name"] == "vllm":
        assert vllm_extra(engine)["target"] == listen
    else:
        from tests.sglang_harness import sglang_config_from_argv

        assert sglang_config_from_argv(engine["args"])["target"] == listen
    api = {m["name"] for m in sidecar["volumeMounts"] if listen.startswith(
        "unix:" + m["mountPath"] + "/")}
    assert api and api <= {m["name"] for m in engine["volumeMounts"]}
    claims = {c["name"] for c in pod["spec"]["resourceClaims"]}
    for c in pod["spec"]["containers"]:
        assert {x["name"] for x in c["resources"]["claims"]} == claims, c["name"]
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    templates = {d["metadata"]["name"] for d in docs(KUBE / name)
                 if d["kind"] == "ResourceClaimTemplate"}
    assert {c["resourceClaimTemplateName"] for c in pod["spec"]["resourceClaims"]} <= templates


@pytest.mark.parametrize("name", ["inference-pod.yaml", "vllm-pod.yaml"])
def test_the_inference_pod_reaches_the_node_daemon(name: str) -> None:
    from tests.sglang_harness import sglang_config_from_argv

    ds = docs(KUBE / "hicached-daemonset.yaml")[1]
    spec = pod_spec(ds)
    daemon = spec["containers"][0]
    listen = arg(daemon, "--listen").removeprefix("unix:")
    assert arg(daemon, "--socket-mode") == "0660" and "--no-shm-paths" in daemon["args"]
    pod = docs(KUBE / name)[0]
    engine = pod["spec"]["containers"][0]
    if engine["name"] == "vllm":
        extra = vllm_extra(engine)
    else:
        extra = sglang_config_from_argv(engine["args"])
    assert extra["target"] == f"unix:{listen}"

    def node_dir(s: dict[str, Any], c: dict[str, Any], path: str) -> str:
        """The node directory ``path`` is in, through the container's hostPath mounts."""
        vols = {v["name"]: v for v in s["volumes"]}
        for m in sorted(c["volumeMounts"], key=lambda m: -len(m["mountPath"])):
            if path.startswith(m["mountPath"] + "/"):
                host = vols[m["name"]]["hostPath"]["path"]
                return str(host + path[len(m["mountPath"]):].rsplit("/", 1)[0])
        raise AssertionError(f"{path} is on no hostPath of {c['name']}")

    assert node_dir(spec, daemon, listen) == node_dir(pod["spec"], engine, listen)
    # the pod may connect: the daemon's group, its uid told to the client, one IPC namespace
    assert spec["securityContext"]["runAsGroup"] in pod["spec"]["securityContext"][
        "supplementalGroups"]
    env = {e["name"]: e["value"] for e in engine["env"]}
    assert env["HICACHE_DAEMON_UID"] == str(spec["securityContext"]["runAsUser"])
    assert spec["hostIPC"] and pod["spec"]["hostIPC"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] >= 1
    # the node directories are the daemon's before it starts (it refuses ones it does not own)
    init = " ".join(spec["initContainers"][0]["args"])
    assert "chown 10001:10001" in init and "chmod 0750 /node/run/api" in init
