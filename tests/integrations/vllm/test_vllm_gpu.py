"""The vLLM spec's worker on a real GPU: vLLM's canonical KV tensors (CUDA) exported to the
daemon over CUDA IPC (torch's caching allocator) or by fd (vLLM 0.34's extensible KV cache, its
own allocator), ``submit_store`` right behind a kernel still writing the blocks on the
engine's stream (the ready event must hold the daemon's copy back), ``submit_load`` into other
blocks zeroed first, exact bytes.

Skipped without a CUDA device or vLLM's offloading interfaces (the CPU tests in
test_vllm_offloading.py drive the same worker through vLLM's scheduler on staging memfds). Run
by scripts/gpu_check.sh, with the vLLM modules it needs from ``.vllm-gpu``
(scripts/gpu/vllm_subset.py).
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import torch

from tests.daemon_proc import DaemonProc, Daemons
from tests.helpers import require_module

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

LAYERS, BLOCKS, BLOCK_TOKENS, N = 4, 64, 16, 16
PAGE = 2 * BLOCK_TOKENS * 8 * 128 * 2  # K and V, 16 tokens, 8 heads x 128, bf16: 64 KiB


@pytest.fixture
def daemon(daemons: Daemons) -> DaemonProc:
    # killed at the end: the checked drain is not yet verified on a GPU host
    return daemons.start("--memory-budget", "2GiB", checked=False)


def offloading_config() -> SimpleNamespace:
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    return SimpleNamespace(
        groups=[SimpleNamespace(layer_names=names, tokens_per_block=BLOCK_TOKENS)],
        cache=SimpleNamespace(blocks_per_chunk=1), worker_kv_bytes_per_block=PAGE * LAYERS,
        replicated_layout=False, model=SimpleNamespace(name="gpu-check/llama", dtype="bfloat16"),
        kv_cache_layout="NHD",
        parallel=SimpleNamespace(pp_size=1, pcp_size=1, dcp_size=1, world_size=1,
                                 data_parallel_index=0))


def round_trip(daemon: DaemonProc, layers: list[torch.Tensor]) -> str:
    """The worker on these canonical layer tensors: a store submitted behind a kernel still
    writing the blocks on the engine's stream, a load into other blocks zeroed first, exact;
    the transport its session used."""
    require_module("vllm", "vLLM's offloading interfaces (scripts/gpu/vllm_subset.py)")
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )

    from hicache_vllm.blocks import HicachedLoadStoreSpec
    from hicache_vllm.config import SpecConfig
    from hicache_vllm.namespace import Plan
    from hicache_vllm.vllm_api import current
    from hicache_vllm.worker import HicachedOffloadingWorker

    config = SpecConfig(target=daemon.target)
    plan = Plan.from_config(offloading_config(), config)
    kv = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=PAGE) for t in layers],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE)
                          for i in range(LAYERS)]])
    api = current()
    worker = HicachedOffloadingWorker(config, plan, 0, kv, api)

    def device(ids: list[int]) -> object:
        """The engine's blocks as this vLLM release's connector hands them to the worker."""
        return api.device_side(GPULoadStoreSpec(ids, [len(ids)], [0]), kv)

    try:
        end = time.monotonic() + 60
        while not worker.link.usable:
            assert time.monotonic() < end, "the worker's link never came up"
            time.sleep(0.05)
        assert worker.on_cuda
        keys = [os.urandom(32) for _ in range(N)]
        src, dst = list(range(N)), list(range(32, 32 + N))
        engine = torch.cuda.Stream()
        with torch.cuda.stream(engine):
            torch.cuda._sleep(200_000_000)  # the engine's stream busy: the blocks written late
            for t in layers:
                t[src] = torch.randint(-128, 128, (N, PAGE), dtype=torch.int8, device="cuda")
            worker.submit_store(1, device(src), HicachedLoadStoreSpec(keys))
        worker.wait({1})
        engine.synchronize()
        want = [t[src].clone() for t in layers]
        assert all(w.count_nonzero() > 0 for w in want)
        assert worker.stats["store_pages"] == N, worker.stats
        for t in layers:
            t.zero_()
        torch.cuda.synchronize()
        worker.submit_load(2, HicachedLoadStoreSpec(keys), device(dst))
        worker.wait({2})
        done = {r.job_id: r.success for r in worker.get_finished()}
        assert done == {1: True, 2: True}
        assert worker.stats["load_pages"] == N and worker.stats["load_failures"] == 0
        torch.cuda.synchronize()
        for t, w in zip(layers, want, strict=True):
            assert torch.equal(t[dst], w)  # the stored bytes, not the zeros the kernel preceded
            assert t[src].count_nonzero() == 0  # nothing landed anywhere else
        return str(worker._device.transport)
    finally:
        worker.shutdown()


def test_store_behind_a_running_kernel_and_load_back_exact(daemon: DaemonProc) -> None:
    """vLLM's KV cache from torch's caching allocator (vLLM 0.33, or 0.34 with its extensible
    cache off): shared over CUDA IPC."""
    layers = [torch.zeros(BLOCKS, PAGE, dtype=torch.int8, device="cuda") for _ in range(LAYERS)]
    assert round_trip(daemon, layers) == "cuda_ipc"


def extensible_kv_cache(export: bool) -> object:
    """vLLM 0.34's own extensible KV cache allocator (``vllm.utils.extensible_tensor``): one
    segment per layer, committed (each segment mapped by its own physical allocation), created
    exportable as POSIX file descriptors as vLLM does when a connector declares
    ``EXPORTS_FD`` (``kv_cache_export_handle_types``), or not."""
    require_module("vllm", "vLLM's extensible KV cache allocator (scripts/gpu/vllm_subset.py)")
    from vllm.utils.extensible_tensor import ExtensibleTensor
    from vllm.utils.vmm_driver import MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR

    segment = BLOCKS * PAGE
    buf = ExtensibleTensor(LAYERS * segment, device="cuda",
                           segment_capacities=[segment] * LAYERS,
                           export_handle_types=MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                           if export else 0)
    buf.resize_segments_([segment] * LAYERS, zero_new=True)
    assert all(buf.segments_backed_by_one_chunk([segment] * LAYERS))
    return buf


def test_vllms_extensible_kv_cache_goes_to_the_daemon_by_fd_and_round_trips(
        daemon: DaemonProc) -> None:
    """vLLM 0.34's default GPU KV cache (virtual memory from cuMemCreate, which CUDA IPC cannot
    share), exportable as HicachedOffloadingConnector's EXPORTS_FD has vLLM make it: the
    worker hands its segments' fds to the daemon, which imports and maps them; exact."""
    buf = extensible_kv_cache(export=True)
    try:
        layers = [buf.segment_view(i).view(torch.int8).view(BLOCKS, PAGE)  # type: ignore[attr-defined]
                  for i in range(LAYERS)]
        assert round_trip(daemon, layers) == "cuda_vmm"
    finally:
        torch.cuda.synchronize()
        buf.free()  # type: ignore[attr-defined]


def test_an_extensible_kv_cache_not_made_exportable_is_refused_saying_how(
        daemon: DaemonProc) -> None:
    """The same cache under vLLM's plain OffloadingConnector (it declares nothing, so vLLM
    does not make it exportable): the worker refuses at start, naming the fixes."""
    from hicache.errors import BufferNotShareable

    buf = extensible_kv_cache(export=False)
    try:
        layers = [buf.segment_view(i).view(torch.int8).view(BLOCKS, PAGE)  # type: ignore[attr-defined]
                  for i in range(LAYERS)]
        with pytest.raises(BufferNotShareable) as got:
            round_trip(daemon, layers)
        assert "EXPORTS_FD" in str(got.value)
        assert "--no-enable-extensible-kv-cache" in str(got.value)
    finally:
        buf.free()  # type: ignore[attr-defined]
