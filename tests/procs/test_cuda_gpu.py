"""The CUDA path on a real GPU: real torch CUDA tensors in real worker processes, real IPC.

Skipped on hosts without a CUDA device (CI runs the same code on the fake driver in
test_cuda_path.py and test_cuda_e2e.py). Run with ``pytest -m cuda``.
"""

from __future__ import annotations

import json
import os
import re
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


NEIGHBOUR = """
import sys, torch
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
print("busy", flush=True)
while True:  # the engine's own kernels, beside the daemon's copies
    a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
"""


@pytest.mark.parametrize("way", ["dma", "batch", "kernel"])
def test_every_copy_way_is_exact_beside_a_neighbours_kernels(module_daemons: Daemons,
                                                              way: str) -> None:
    """A daemon forced to one way of GPU copies (cuda_copy_paths), every layout at page sizes
    1, 16 and 64: two workers per pool, all pools at once (backups and loads in both
    directions at the same time), one loading with per-layer events checked group by group,
    while another process keeps the GPU's SMs busy with matmuls; every buffer exact, and the
    daemon's metrics say the batches went that way."""

    d = module_daemons.start("--memory-budget", "8GiB", "--cuda-copy-paths", way)
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR], stdout=subprocess.PIPE,
                                 text=True)
    specs = [PoolSpec(f"gpu-{way}-{layout.value}-p{ps}", GEOMETRIES["mha"], ps, layout,
                      size_tokens=ps * 256) for layout in Layout for ps in (1, 16, 64)]
    try:
        assert neighbour.stdout is not None and neighbour.stdout.readline().strip() == "busy"
        with HiCacheClient(d.target) as c:
            for spec in specs:
                c.create_pool(spec)
            workers = [(spec.name, spawn(d, spec.name, f"w{i}", i + 1, 3,
                                         spec.page_size * 64, *flags))
                       for spec in specs for i, flags in enumerate([(), ("--layer-events",)])]
            for name, w in workers:
                out, err = w.communicate(timeout=300)
                assert w.returncode == 0, (name, err[-3000:])
                r = json.loads(out.strip().splitlines()[-1])
                assert r["mismatches"] == 0 and r["verified_buffers"] > 0, (name, r)
            for spec in specs:
                c.delete_pool(spec.name)
        took = {m.group(1) for m in re.finditer(
            r'^hicache_cuda_copy_batches_total\{op="[a-z]+",path="([a-z]+)"\} [1-9]',
            d.metrics(), re.M)}
        assert took == {way}, (way, took, d.log()[-2000:])
    finally:
        neighbour.kill()
        neighbour.wait(30)


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


def test_expandable_segments_go_as_vmm_chunks_or_are_refused_with_the_cause() -> None:
    """PyTorch's expandable segments are VMM memory: handed over as cuda_vmm where torch
    creates them exportable as POSIX fds, else refused saying so and how to fix it."""
    code = (
        "import torch\n"
        "from hicache_client.cuda import CudaDeviceBuffers\n"
        "from hicache.errors import BufferNotShareable\n"
        "from hicache.specs import Role\n"
        "t = torch.empty(1 << 20, dtype=torch.bfloat16, device='cuda')\n"
        "try:\n"
        "    with CudaDeviceBuffers.from_tensors({'kv': {Role.K: [t]}}) as b:\n"
        "        print(b.transport, len(b.fds))\n"
        "except BufferNotShareable as e:\n"
        "    print(e.reason, e)\n"
    )
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, text=True,
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if out.stdout.startswith("cuda_vmm"):
        assert int(out.stdout.split()[1]) >= 1, out.stdout
    else:
        assert out.stdout.startswith("BUFFER_NOT_SHAREABLE"), out.stdout
        assert "not created exportable" in out.stdout and "expandable_segments" in out.stdout


def test_vmm_address_range_is_the_mapping_and_its_chunk_exports_as_an_fd() -> None:
    """What the worker's VMM export counts on, on the real driver: cuMemGetAddressRange of an
    address in cuMemMap'ed memory is the one mapping holding it (not the reserved range),
    cuMemRetainAllocationHandle finds its allocation, whose properties (CUmemAllocationProp's
    layout) name the device and the POSIX fd handle type, and it exports as an fd."""
    from hicache.cuda_driver import load_driver
    from tests.cuda_fixtures import alloc_vmm, free_vmm

    torch.cuda.init()
    drv = load_driver()
    assert drv is not None
    granule = drv.mem_granularity(0)
    assert granule > 0 and granule % 4096 == 0
    seg = alloc_vmm(drv, [granule, 2 * granule])
    try:
        with drv.context(0):
            assert drv.address_range(seg.base + granule + 100) == (seg.base + granule,
                                                                    2 * granule)
            assert drv.address_range(seg.base + 5) == (seg.base, granule)
            assert drv.pointer_attribute(10, seg.base) == 0  # not legacy-IPC capable
            handle = drv.mem_retain_handle(seg.base + granule + 100)
            try:
                props = drv.mem_properties(handle)
                assert (props.location_type, props.device, props.exports_fd) == (1, 0, True)
                fd = drv.mem_export_fd(handle)
                assert fd >= 0
                os.close(fd)
            finally:
                drv.mem_release(handle)
            plain = drv.mem_create(granule, 0, exportable=False)
            try:
                assert not drv.mem_properties(plain).exports_fd
            finally:
                drv.mem_release(plain)
    finally:
        free_vmm(drv, seg)


def test_vmm_workers_round_trip_exactly_and_are_released(daemon: DaemonProc) -> None:
    """KV in cuMemCreate chunks exportable as POSIX fds (vLLM 0.34's with a connector that
    declares KVCacheAccess.EXPORTS_FD), a layer across two chunks, handed over as cuda_vmm:
    the daemon imports, maps and copies them; raw pages with layer events (MHA) and keyed pages
    (MLA) land exact in rows zeroed first; once the workers are gone nothing stays mapped."""
    specs = [PoolSpec(f"gpu-vmm-{kind}", GEOMETRIES[kind], 16, Layout.PAGE_FIRST,
                      size_tokens=16 * 256) for kind in ("mha", "mla")]
    with HiCacheClient(daemon.target) as c:
        assert "cuda_vmm" in c.get_info().transports
        for spec in specs:
            c.create_pool(spec)
        workers = [spawn(daemon, specs[0].name, "v0", 1, 3, 16 * 64, "--vmm", "--layer-events"),
                   spawn(daemon, specs[1].name, "v1", 2, 3, 16 * 64, "--vmm", "--keyed")]
        for w in workers:
            out, err = w.communicate(timeout=300)
            assert w.returncode == 0, err[-3000:]
            r = json.loads(out.strip().splitlines()[-1])
            assert r["mismatches"] == 0 and r["verified_buffers"] == 3 * r["buffers"] > 0
        for spec in specs:
            assert c.list_sessions(spec.name) == []
            c.delete_pool(spec.name)
    mapped = re.search(r"^hicache_cuda_vmm_chunks_mapped (\S+)", daemon.metrics(), re.M)
    assert mapped is not None and float(mapped.group(1)) == 0, daemon.log()[-2000:]


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



def test_a_pool_over_1_gib_round_trips_runs_across_its_registration_seam(
        daemon: DaemonProc) -> None:
    """A pool over 1 GiB is locked in 1 GiB registrations, and the driver refuses a copy over
    two: Stores of 48-page runs, one of them over the seam at 1 GiB (page 512 of layer 6's V,
    in this layer-first pool), and every key loads back exact into zeroed GPU pages."""
    from tests.cuda_worker_proc import real_buffers

    spec = PoolSpec("gpu-seam", GEOMETRIES["mha"], 16, Layout.LAYER_FIRST,
                    size_tokens=16 * 2304)  # 2,304 pages of 512 KiB: 1.125 GiB
    tokens, n = 16 * 576, 528
    with HiCacheClient(daemon.target) as c:
        info = c.create_pool(spec)
        assert info.capacity_bytes > 1 << 30 and info.pinned_bytes == info.capacity_bytes
        try:
            bufs, views = real_buffers(spec, tokens)
            ordered = [views[k] for k in sorted(views, key=lambda k: (k[0], k[1].value, k[2]))]
            for v in ordered:
                v.view(torch.uint8).random_()
            torch.cuda.synchronize()
            saved = [v.view(-1, 16 * v.shape[1])[:n].cpu() for v in ordered]
            keys = [f"seam/{p}".encode() for p in range(n)]
            with c.open_session(spec.name, "seam", bufs.descriptors, lease_ms=1000) as sess:
                for b in range(0, n, 48):
                    pages = torch.arange(b, b + 48)
                    assert sess.store(keys[b:b + 48],
                                      (pages[:, None] * 16 + torch.arange(16)).reshape(-1)
                                      ).stored == 48
                for v in ordered:
                    v.zero_()
                torch.cuda.synchronize()
                for b in range(0, n, 48):
                    pages = torch.arange(b, b + 48)
                    sess.load_keys(keys[b:b + 48],
                                   (pages[:, None] * 16 + torch.arange(16)).reshape(-1))
                torch.cuda.synchronize()
            for v, want in zip(ordered, saved, strict=True):
                assert torch.equal(v.view(-1, 16 * v.shape[1])[:n].cpu(), want)
        finally:
            c.delete_pool(spec.name)
    assert "CUDA_ERROR" not in daemon.log()

ELASTIC_TOML = """
[budget]
elastic = true
interval_seconds = 0.2
grow_step_bytes = "8MiB"
step_fraction = 0.25
pin_unit_bytes = "1MiB"

[[budget.pools]]
pools = "el-*"
floor_bytes = "16MiB"
"""


def test_an_elastic_budget_moves_locked_memory_and_keys_load_back_exact(
        module_daemons: Daemons, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two pools share 384 MiB by demand on a GPU host: the busy one's locked memory grows
    with its share, the other's Stores take memory back from it (its oldest keys evicted,
    the rest moved below its new share, the units above unlocked and given back), and the
    keys it kept load back exact into zeroed GPU pages."""
    from tests.cuda_worker_proc import real_buffers

    config = tmp_path / "elastic.toml"
    config.write_text(ELASTIC_TOML)
    d = module_daemons.start("--config", str(config), "--memory-budget", "384MiB",
                             workdir=tmp_path)
    geometry = GEOMETRIES["mha"]  # a page: 8 layers x K/V x 16 x 8 x 128 x 2 = 512 KiB
    specs = [PoolSpec(f"el-{n}", geometry, 16, Layout.LAYER_FIRST, size_tokens=16 * 448)
             for n in "ab"]
    with HiCacheClient(d.target) as c:
        for s in specs:
            info = c.create_pool(s)
            assert 0 < info.pinned_bytes < info.capacity_bytes, "locked: its floor, not all"
        saved: dict[bytes, list[torch.Tensor]] = {}
        tokens = 16 * 448

        def fill_and_store(s: PoolSpec, n: int, tag: str) -> None:
            bufs, views = real_buffers(s, tokens)
            ordered = [views[k] for k in sorted(views, key=lambda k: (k[0], k[1].value, k[2]))]
            with c.open_session(s.name, tag, bufs.descriptors, lease_ms=1000) as sess:
                for b in range(0, n, 16):
                    pages = torch.arange(b, b + 16)
                    for v in ordered:
                        v.view(-1, 16 * v.shape[1])[pages] = torch.randint(
                            0, 256, v.view(-1, 16 * v.shape[1])[pages].shape,
                            dtype=torch.uint8, device="cuda")
                    torch.cuda.synchronize()
                    keys = [f"{tag}/{p}".encode() for p in range(b, b + 16)]
                    assert sess.store(keys, (pages[:, None] * 16 + torch.arange(16)).reshape(-1)
                                      ).stored == 16
                    if s is specs[0]:
                        for p, key in zip(range(b, b + 16), keys, strict=True):
                            saved[key] = [v.view(-1, 16 * v.shape[1])[p].cpu() for v in ordered]

        fill_and_store(specs[0], 400, "a")  # 200 MiB: a grows from the slack
        a = c.get_pool("el-a")
        assert a.share_bytes >= 400 * specs[0].page_bytes
        assert a.share_bytes <= a.pinned_bytes <= a.share_bytes + (1 << 20) * 16, \
            "every page of the share locked, and little more"
        locked_before = a.pinned_bytes
        fill_and_store(specs[1], 400, "b")  # b's demand takes memory from a's oldest keys
        deadline = time.monotonic() + 30
        while c.get_pool("el-a").pinned_bytes >= locked_before:
            assert time.monotonic() < deadline, "a's locked memory did not shrink"
            time.sleep(0.2)
        a = c.get_pool("el-a")
        assert a.pinned_bytes < locked_before and a.share_bytes <= a.pinned_bytes
        # what a kept loads back exact into zeroed GPU pages
        bufs, views = real_buffers(specs[0], tokens)
        ordered = [views[k] for k in sorted(views, key=lambda k: (k[0], k[1].value, k[2]))]
        keys = list(saved)
        held = c.lookup("el-a", keys)
        kept = [k for k, tier in zip(keys, held.tiers, strict=True) if tier == 1]
        assert 0 < len(kept) < len(keys)
        with c.open_session("el-a", "check", bufs.descriptors, lease_ms=1000) as sess:
            for v in ordered:
                v.zero_()
            torch.cuda.synchronize()
            for b in range(0, len(kept), 16):
                batch = kept[b:b + 16]
                pages = torch.tensor([int(k.split(b"/")[1]) for k in batch])
                sess.load_keys(batch, (pages[:, None] * 16 + torch.arange(16)).reshape(-1))
            torch.cuda.synchronize()
            for key in kept:
                p = int(key.split(b"/")[1])
                for v, want in zip(ordered, saved[key], strict=True):
                    assert torch.equal(v.view(-1, 16 * v.shape[1])[p].cpu(), want), key
        for s in specs:
            c.delete_pool(s.name)
    assert "CUDA_ERROR" not in d.log()


def test_the_driver_refuses_a_copy_over_two_registrations_and_cut_copies_land() -> None:
    """What ``segments.split_at`` is for, on the real driver: host memory locked as two
    adjoining registrations; one copy over both is refused (CUDA_ERROR_INVALID_VALUE), the
    same copy cut at the seam lands exact in host bytes zeroed first."""
    import numpy as np

    from hicache.cuda_driver import CudaCallFailed, load_driver
    from hicached.core.memory import HostMemory
    from hicached.core.registrations import Registrations
    from hicached.cuda import segments
    from hicached.cuda.pinner import DriverPinner

    driver = load_driver()
    assert driver is not None
    n, edge = 1 << 20, 4096
    mem = HostMemory(n, hugepages=False, prefault_threads=1)
    try:
        pinner = DriverPinner(driver)
        mem.pin_range(pinner, 0, n // 2)
        mem.pin_range(pinner, n // 2, n // 2)
        dev = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        one = segments.Segments(*(np.asarray([v], dtype=np.int64) for v in (
            mem.address + edge, dev.data_ptr() + edge, n - 2 * edge, n - 2 * edge,
            n - 2 * edge, 1, 1)))
        with driver.context(0):
            stream = driver.stream_create()
            try:
                with pytest.raises(CudaCallFailed) as refused:
                    segments.submit(driver, stream, one, use_native=False)
                    driver.stream_synchronize(stream)
                assert refused.value.name == "CUDA_ERROR_INVALID_VALUE"
                mem.array()[:] = 0
                seam = np.asarray([mem.address + n // 2])
                cut = segments.split_at(one, Registrations(seam, mem.address, n), True)
                assert cut.count == 2 and cut.nbytes == one.nbytes
                segments.submit(driver, stream, cut)
                driver.stream_synchronize(stream)
            finally:
                driver.stream_destroy(stream)
        got = mem.array()
        want = dev.cpu().numpy()
        assert np.array_equal(got[edge:n - edge], want[edge:n - edge])
        assert not got[:edge].any() and not got[n - edge:].any()
        # a 2-D copy whose last row ends at the seam while its pitch runs past it is taken:
        # the driver spans (height - 1) * pitch + width, what split_at keeps in one
        rows, width, pitch = 4, 4096, 8192
        host = mem.address + n // 2 - (rows - 1) * pitch - width
        two_d = segments.Segments(*(np.asarray([v], dtype=np.int64) for v in (
            host, dev.data_ptr(), pitch, width, width, rows, 1)))
        assert segments.split_at(two_d, Registrations(seam, mem.address, n), True) is two_d
        mem.array()[:] = 0
        with driver.context(0):
            stream = driver.stream_create()
            try:
                segments.submit(driver, stream, two_d)
                driver.stream_synchronize(stream)
            finally:
                driver.stream_destroy(stream)
        off = host - mem.address
        for r in range(rows):
            row = mem.array()[off + r * pitch:off + r * pitch + width]
            assert np.array_equal(row, want[r * width:(r + 1) * width]), r
    finally:
        mem.close()
