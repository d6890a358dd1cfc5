"""The SGLang modules the GPU tests load, imported as on a GPU host: SGLang decides at import
time what to load by whether CUDA is there (its quantization and MoE layers import
``sgl_kernel`` then), so torch is made to report a CUDA device first. Nothing touches a GPU;
exit status 0 when every module imported. Run by tests/repo/test_gpu_check.py."""

from __future__ import annotations

import importlib

import torch

torch.version.cuda = "13.0"  # type: ignore[misc]
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # type: ignore[assignment]
torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H200"  # type: ignore[assignment]

from tests.sglang_harness import install_stand_ins  # noqa: E402

install_stand_ins()
for name in ("sglang.srt.mem_cache.allocator", "sglang.srt.mem_cache.cache_init_params",
             "sglang.srt.mem_cache.memory_pool", "sglang.srt.mem_cache.registry",
             "sglang.srt.managers.schedule_batch", "sglang.srt.mem_cache.radix_cache",
             "sglang.srt.sampling.sampling_params", "hicache_sglang.linker",
             "hicache_client.cuda"):
    importlib.import_module(name)
    print("imported", name)
