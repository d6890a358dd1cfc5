"""What differs between the vLLM releases served lives in ``hicache_vllm.vllm_api``, one
adapter each: a job's engine blocks as each release's own connector hands them to the worker
(0.33: block ids; 0.34: pointers vLLM resolved from them) come back as the same blocks, for
several KV cache groups; device sides vLLM never hands over are refused, never read as some
other block; and a vLLM outside the table stops where it loads the spec, naming its version.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon_proc import REPO, DaemonProc, Daemons
from tests.vllm_harness import model_dir
from tests.vllm_runs import CORE, RELEASES, reports_failures, run, vllm_dir, vllm_env


@CORE
def test_each_release_s_device_side_names_the_blocks_it_was_built_from(vllm: str) -> None:
    got = run("device_blocks", vllm=vllm)
    assert got["line"] == ".".join(vllm.split(".")[:2])
    assert got["both"] == [[0, [5, 6, 7], 4], [1, [9, 2], 1]]
    assert got["second_only"] == [[1, [3, 15], 6]]  # a group without blocks is no group
    assert got["one_group_job"] == 4
    assert "2 KV cache groups" in got["two_groups_job"]
    assert all(got["refused"].values()), got["refused"]  # each refused, with why
    if reports_failures(vllm):
        assert set(got["refused"]) == {
            "off_a_block", "past_the_tensor", "below_the_tensor", "wrong_size",
            "references_disagree", "groups_miscounted", "pointers_miscounted",
            "references_miscounted"}
        assert "not a block" in got["refused"]["off_a_block"]
        assert "2048 bytes" in got["refused"]["wrong_size"]
        assert "different blocks" in got["refused"]["references_disagree"]


@pytest.fixture
def daemon(daemons: Daemons) -> DaemonProc:
    return daemons.start()


@pytest.mark.parametrize("connector", ["plain", "hicached"])
def test_a_vllm_outside_the_table_stops_at_start_naming_its_version(
        tmp_path: Path, daemon: DaemonProc, connector: str) -> None:
    """vLLM 0.35.0 as a user would have it installed (its distribution's metadata first on
    the path; the code is the newest served, so only the version check can stop it): the
    engine does not start, and says SPEC_INVALID with the version and the lines served."""
    fake = tmp_path / "site"
    dist = fake / "vllm-0.35.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.35.0\n")
    env = vllm_env(RELEASES[0])
    env["PYTHONPATH"] = f"{fake}:{vllm_dir(RELEASES[0])}:{REPO}"
    args = {"model": str(model_dir(tmp_path)), "target": daemon.target, "connector": connector}
    out = subprocess.run([sys.executable, "-m", "tests.vllm_harness", "refused_at_start",
                          json.dumps(args)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.split("RESULT ", 1)[1])
    assert got["vllm"] == "0.35.0"
    assert (got["type"], got["reason"]) == ("SpecInvalid", "SPEC_INVALID"), got
    assert got["metadata"] == {"engine": "vllm", "installed": "0.35.0",
                               "supported": "0.33.x, 0.34.x"}
    assert "vLLM 0.35.0 is not served" in got["message"]


@CORE
def test_the_connector_declares_the_kv_cache_access_the_spec_needs(vllm: str) -> None:
    """vLLM 0.34 asks the connector how its workers reach the device KV cache before it
    allocates it: on GPUs the daemon, another process, imports it by fd (EXPORTS_FD: vLLM keeps
    its extensible KV cache, exportable), or by legacy CUDA IPC when the user asks
    (LEGACY_IPC: vLLM turns the extensible cache off); fds travel only over the Unix socket,
    so fd with a TCP target stops the start, saying what to set. On the CPU the workers copy
    through their own staging (IN_PROCESS). vLLM 0.33 never asks (no such declaration)."""
    got = run("kv_cache_access", vllm=vllm, target="unix:/run/hicached/hicached.sock")
    bad = got["cpu"]["bad"]
    assert bad.startswith("SpecInvalid: SPEC_INVALID") and "cuda_sharing" in bad
    if not reports_failures(vllm):  # 0.33
        assert {k for k, v in got["cuda"].items() if v} == {"bad"}
        return
    assert got["cpu"] == {**dict.fromkeys(["default", "fd", "legacy_ipc", "fd_over_tcp",
                                           "legacy_ipc_over_tcp"], "IN_PROCESS"), "bad": bad}
    cuda = got["cuda"]
    assert cuda["default"] == cuda["fd"] == "EXPORTS_FD"
    assert cuda["legacy_ipc"] == cuda["legacy_ipc_over_tcp"] == "LEGACY_IPC"
    assert cuda["fd_over_tcp"].startswith("SpecInvalid: SPEC_INVALID"), cuda["fd_over_tcp"]
    assert "legacy_ipc" in cuda["fd_over_tcp"] and "Unix socket" in cuda["fd_over_tcp"]
