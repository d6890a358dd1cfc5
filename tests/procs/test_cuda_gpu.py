"""The CUDA path on a real GPU: real torch CUDA tensors in real worker processes, real IPC.

Skipped on hosts without a CUDA device (CI runs the same code on the fake driver in
test_cuda_path.py and test_cuda_e2e.py). Run with ``pytest -m cuda``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from hicache.identity import public_session_id
from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache_client import HiCacheClient
from tests.daemon_proc import REPO, DaemonProc, Daemons

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device (the CUDA path runs on the fake driver in "
                              "test_cuda_path.py / test_cuda_e2e.py instead)"),
]

GEOMETRIES = {
    "mha": KVGeometry(PoolKind.MHA, DType.BFLOAT16, 8, 8, 128),
    "mla": KVGeometry(PoolKind.MLA, DType.BFLOAT16, 8, kv_lora_rank=512, qk_rope_head_dim=64),
}


@pytest.fixture(scope="module")
def daemon(module_daemons: Daemons) -> DaemonProc:
    return module_daemons.start("--memory-budget", "8GiB")


def spawn(daemon: DaemonProc, pool: str, worker: str, seed: int, rounds: int, tokens: int,
          *flags: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "tests.cuda_worker_proc", daemon.target, pool, worker,
           str(seed), str(rounds), str(tokens), *flags]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.value)
@pytest.mark.parametrize("kind", list(GEOMETRIES))
def test_two_gpu_workers_round_trip_exactly(daemon: DaemonProc, layout: Layout,
                                            kind: str) -> None:
    spec = PoolSpec(f"gpu-{kind}-{layout.value}", GEOMETRIES[kind], 16, layout,
                    size_tokens=16 * 256)
    with HiCacheClient(daemon.target) as c:
        pool = c.create_pool(spec)
        assert pool.pinned_bytes == pool.capacity_bytes, "pools are pinned on GPU hosts"
        workers = [spawn(daemon, spec.name, "w0", 1, 5, 16 * 64),
                   spawn(daemon, spec.name, "w1", 2, 5, 16 * 64, "--layer-events")]
        for w in workers:
            out, err = w.communicate(timeout=300)
            assert w.returncode == 0, err
            r = json.loads(out.strip().splitlines()[-1])
            assert r["mismatches"] == 0 and r["verified_buffers"] == 5 * r["buffers"] > 0
        assert c.list_sessions(spec.name) == []
        c.delete_pool(spec.name)


def test_killed_worker_gives_its_device_memory_back(daemon: DaemonProc) -> None:
    spec = PoolSpec("gpu-kill", GEOMETRIES["mha"], 16, Layout.LAYER_FIRST, size_tokens=16 * 64)
    tokens = 16 * 4096  # 8 layers x K/V x 4096 pages x 16 x 8 x 128 x 2 bytes = 2 GiB
    with HiCacheClient(daemon.target) as c:
        c.create_pool(spec)
        torch.cuda.init()
        torch.cuda.synchronize()
        baseline = torch.cuda.mem_get_info()[0]
        victim = spawn(daemon, spec.name, "victim", 3, 0, tokens, "--forever")
        assert victim.stdout is not None
        session = json.loads(victim.stdout.readline())["session"]
        time.sleep(2)
        in_use = baseline - torch.cuda.mem_get_info()[0]
        assert in_use >= 2 << 30, f"the worker holds {in_use} bytes"
        victim.send_signal(signal.SIGKILL)
        victim.wait(30)
        deadline = time.monotonic() + 10
        while any(s.public_id == public_session_id(session) for s in c.list_sessions()):
            assert time.monotonic() < deadline, "the dead worker's session was not reaped"
            time.sleep(0.1)
        deadline = time.monotonic() + 10
        while baseline - torch.cuda.mem_get_info()[0] > 256 << 20:
            assert time.monotonic() < deadline, (
                f"{(baseline - torch.cuda.mem_get_info()[0]) >> 20} MiB still in use after "
                "the worker died: the daemon kept its allocations mapped")
            time.sleep(0.2)
        c.delete_pool(spec.name)


def test_expandable_segments_are_refused_with_the_cause() -> None:
    code = (
        "import torch\n"
        "from hicache_client.cuda import CudaDeviceBuffers\n"
        "from hicache.errors import BufferNotShareable\n"
        "from hicache.specs import Role\n"
        "t = torch.empty(1 << 20, dtype=torch.bfloat16, device='cuda')\n"
        "try:\n"
        "    CudaDeviceBuffers.from_tensors({'kv': {Role.K: [t]}})\n"
        "except BufferNotShareable as e:\n"
        "    print(e.reason, e)\n"
    )
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, text=True,
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("BUFFER_NOT_SHAREABLE"), out.stdout
    assert "expandable_segments" in out.stdout


def test_pool_files_on_a_disk_filesystem_are_refused_with_the_cause(tmp_path) -> None:
    """The kernel page-locks no shared pages of a file on a disk filesystem (what the fake
    driver mimics): a pool file there fails to pin naming the filesystem, and a daemon refuses
    such a state_dir at start; the same pool on tmpfs pins."""
    from hicache.cuda_driver import load_driver
    from hicache.errors import PinFailed
    from hicached.core.memory import Backing, HostMemory
    from hicached.core.system import filesystem_of, lock_refusal
    from hicached.cuda.pinner import DriverPinner

    disk = next((d for d in (tmp_path, REPO) if lock_refusal(str(d)) is not None), None)
    if disk is None:
        pytest.skip("no disk filesystem here")
    driver = load_driver()
    assert driver is not None
    work = disk / f".hicache-pin-{os.getpid()}"
    work.mkdir(exist_ok=True)
    try:
        with pytest.raises(PinFailed) as exc:
            HostMemory(8 << 20, backing=Backing.FILE, path=str(work / "pool"),
                       pinner=DriverPinner(driver))
        assert "CUDA_ERROR_INVALID_VALUE" in str(exc.value)
        assert filesystem_of(str(work)) in str(exc.value)
        out = subprocess.run([sys.executable, "-m", "hicached", "serve", "--listen",
                              f"unix:{tmp_path / 'd.sock'}", "--state-dir", str(work / "state"),
                              "--metrics-listen", "", "--reserve", "0"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and "tmpfs" in out.stdout + out.stderr, out.stderr
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    m = HostMemory(8 << 20, backing=Backing.FILE, path=f"/dev/shm/hicache-pin-{os.getpid()}",
                   pinner=DriverPinner(driver))
    assert m.pinned_bytes == 8 << 20
    m.close()
