"""The daemon serves without torch: started where ``import torch`` fails, it serves a CPU worker
(sealed memfd buffers) and fake-CUDA workers (IPC handles through the fake driver), each from
an environment that has torch, byte-exact; afterwards no torch library is mapped in the daemon
and its log shows no import error.

"Without torch" is a directory first on the daemon's ``PYTHONPATH`` whose ``torch`` package
raises ``ImportError`` on import, as an interpreter without torch installed does; any import of
torch, however indirect, fails the daemon.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers
from tests.daemon_proc import REPO, DaemonProc, Daemons
from tests.fakecuda import UUID_A, UUID_B, library

PS = 16
CPU_SPEC = PoolSpec("lean-cpu", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 4, 2, 64), PS,
                    Layout.LAYER_FIRST, size_tokens=PS * 64)
GPU_SPEC = PoolSpec("gpu", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 4, 2, 64), PS,
                    Layout.PAGE_FIRST, size_tokens=4096)


def no_torch_dir(root: Path) -> Path:
    pkg = root / "no-torch" / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        'raise ImportError("torch is not installed in the daemon\'s environment")\n')
    return pkg.parent


@pytest.fixture(scope="module")
def daemon(module_daemons: Daemons) -> DaemonProc:
    work = module_daemons.workdir
    path = os.pathsep.join([str(no_torch_dir(work)), os.environ.get("PYTHONPATH", "")])
    return module_daemons.start(env={"PYTHONPATH": path, "HICACHED_CUDA_DRIVER": library(),
                                     "FAKECUDA_DEVICES": f"{UUID_A},{UUID_B}"})


def torch_mapped(pid: int) -> list[str]:
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sorted({line.split()[-1] for line in maps if "torch" in line.split()[-1]})


def test_the_daemon_serves_a_cpu_worker_without_torch(daemon: DaemonProc) -> None:
    with HiCacheClient(daemon.target) as c:
        c.create_pool(CPU_SPEC)
        bufs = ShmDeviceBuffers.create(CPU_SPEC, 8 * PS, sealed=True)
        rows = [t.view(torch.uint8) for t in bufs.all_tensors()]
        s = c.open_session(CPU_SPEC.name, "cpu", bufs.descriptors, fds=bufs.fds)
        try:
            for r in rows:
                r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8))
            want = [r.clone() for r in rows]
            keys = [f"lean-{i}".encode() for i in range(8)]
            assert s.store(keys, torch.arange(8 * PS)).stored == 8
            for r in rows:
                r.zero_()
            s.load_keys(keys, torch.arange(8 * PS))
            n = 8 * PS  # the rows past them are the padding page, never stored
            assert all(torch.equal(r[:n], w[:n]) for r, w in zip(rows, want, strict=True))
        finally:
            s.close()
            bufs.close()
    assert torch_mapped(daemon.proc.pid) == []


def test_the_daemon_serves_fake_cuda_workers_without_torch(daemon: DaemonProc) -> None:
    with HiCacheClient(daemon.target) as c:
        c.create_pool(GPU_SPEC)
    env = dict(os.environ, HICACHED_CUDA_DRIVER=library(), FAKECUDA_DEVICES=f"{UUID_A},{UUID_B}")
    for worker, flags in (("raw", []), ("keyed", ["--keyed", "--layer-events"])):
        p = subprocess.run([sys.executable, "-m", "tests.cuda_worker_proc", daemon.target,
                            GPU_SPEC.name, worker, "7", "3", str(16 * 16), "--fake", *flags],
                           cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 0, p.stderr + daemon.log()
        r = json.loads(p.stdout.strip().splitlines()[-1])
        assert r["mismatches"] == 0 and r["verified_buffers"] > 0, r
    assert torch_mapped(daemon.proc.pid) == []
    assert "ImportError" not in daemon.log() and "Traceback" not in daemon.log()


def test_installing_the_daemon_brings_no_torch() -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = [d.split("=")[0].split(">")[0].split("<")[0].strip().lower()
            for d in project["dependencies"]]
    assert "torch" not in deps and "numpy" in deps
    assert any(d.startswith("torch") for d in project["optional-dependencies"]["worker"])
    containerfile = (REPO / "deploy" / "Containerfile").read_text()
    assert "torch==" not in containerfile
