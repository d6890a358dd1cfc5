"""The SGLang linker on a real GPU: SGLang's own KV tensors exported over CUDA IPC, layer
events consumed by SGLang's layer waits, write-through with the ready event, and ``offload``
that never synchronizes the scheduler's thread with the GPU (``set_sync_debug_mode("error")``).

Skipped without a CUDA device (the CPU integration tests in test_sglang_linker.py run the same
scheduler steps on shared-memory buffers). Run by scripts/gpu_check.sh.
"""

from __future__ import annotations

import pytest
import torch

from tests.daemon_proc import DaemonProc, Daemons
from tests.helpers import require_module

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


@pytest.fixture
def daemon(daemons: Daemons) -> DaemonProc:
    # killed at the end: the checked drain is not yet verified on a GPU host
    return daemons.start("--memory-budget", "4GiB", checked=False)


@pytest.mark.parametrize("kind,dtype", [("mha", torch.bfloat16), ("mha", torch.float8_e4m3fn),
                                        ("mla", torch.bfloat16)])
def test_sglang_cuda_kv_round_trip_with_layer_events(daemon: DaemonProc, kind, dtype) -> None:
    require_module("sglang", "sglang==0.5.23 (scripts/setup.sh --test)")
    from tests.sglang_harness import SGLangCache, tokens_of

    cache = SGLangCache(daemon.target, daemon.shm_dir, kind=kind, dtype=dtype, device="cuda",
                        layers=8, heads=8, head_dim=128, page_size=16, size=4096)
    try:
        assert cache.linker.on_cuda and cache.linker.link.up
        tokens = tokens_of(100, 256)
        cache.prefill(tokens)
        torch.cuda.synchronize()
        cache.poll_offloads()
        assert cache.evict_all() == 256
        cache.zero_kv()
        torch.cuda.synchronize()
        hit, failed, slots = cache.hit_and_load(tokens)
        assert (hit, failed) == (256, []) and slots is not None
        for role in cache.roles:
            for layer in range(cache.layers):
                assert torch.equal(cache.layer_rows(role, layer, slots),
                                   cache.expected(tokens, role, layer)), (role, layer)
        assert cache.linker.stats["load_pages"] == 16
    finally:
        cache.close()


def test_offload_never_synchronizes_the_scheduler_thread(daemon: DaemonProc) -> None:
    """``offload`` runs on SGLang's scheduler thread: with CUDA's sync debug mode at "error",
    any wait for the GPU there (a ``.cpu()`` of device indices, a stream synchronize) raises.
    The offloaded pages must still land exactly."""
    require_module("sglang", "sglang==0.5.23 (scripts/setup.sh --test)")
    from tests.sglang_harness import SGLangCache, tokens_of

    cache = SGLangCache(daemon.target, daemon.shm_dir, device="cuda", layers=8, heads=8,
                        head_dim=128, page_size=16, size=4096)
    offload = cache.linker.offload
    calls = []

    def guarded(*args, **kwargs):  # type: ignore[no-untyped-def]
        torch.cuda.set_sync_debug_mode("error")
        try:
            return offload(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            calls.append(1)

    cache.linker.offload = guarded  # type: ignore[method-assign]
    try:
        tokens = tokens_of(500, 256)
        cache.prefill(tokens)
        cache.poll_offloads()
        assert calls and cache.linker.stats["offload_pages"] == 16, cache.linker.stats
        assert cache.evict_all() == 256
        cache.zero_kv()
        torch.cuda.synchronize()
        hit, failed, slots = cache.hit_and_load(tokens)
        assert (hit, failed) == (256, []) and slots is not None
        for role in cache.roles:
            for layer in range(cache.layers):
                assert torch.equal(cache.layer_rows(role, layer, slots),
                                   cache.expected(tokens, role, layer)), (role, layer)
    finally:
        cache.close()
