"""Stand-in for ``sgl_kernel`` in a CPU SGLang server started by the tests: the two ops SGLang
0.5.23 imports at module level on its CPU path (``SGLANG_USE_CPU_ENGINE=1``), in plain torch.

``sgl_kernel``'s wheel is CUDA-built (its CPU ops ship only in a source build), so a CPU host
has none. ``sitecustomize.py`` beside this file loads it as ``sgl_kernel`` where the real
package is missing. Everything else SGLang takes from ``sgl_kernel`` on CPU is behind
``cpu_has_amx_support()``, which asks ``torch.ops.sgl_kernel`` for ``convert_weight_packed``:
no op is registered here, so SGLang takes its native torch paths. Any other name is an
``AttributeError`` (an ``ImportError`` for ``from sgl_kernel import ...``).

SGLang's speculative-decoding kernel modules also import their CPU ops at module level
(``sglang.kernels.ops.speculative``), and the scheduler imports those modules whether or not
speculative decoding is on: those names exist here but raise when called (the tests never
turn speculative decoding on).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, NoReturn

import torch

SPECULATIVE = ("build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu",
               "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu",
               "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",
               "rotate_input_ids_cpu")
__all__ = ["assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu", *SPECULATIVE]


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """For each request ``i`` of the batch: ``req_to_token[req_pool_indices[i],
    start_offset[i]:end_offset[i]]`` takes the next ``end - start`` entries of
    ``out_cache_loc``, which holds the requests' new slots back to back (SGLang's Triton
    kernel ``assign_req_to_token_pool`` and sgl-kernel's CPU op do the same)."""
    del pool_len  # the row length of req_to_token, which the tensor knows
    rows = req_pool_indices.tolist()
    starts, ends = start_offset.tolist(), end_offset.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset:offset + n].to(
                req_to_token.dtype)
        offset += n


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor,
                                tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """In every KV buffer ``b`` (its base address ``data_ptrs[b]``, its row stride
    ``strides[b]`` bytes), copy row ``src_loc[i]`` to row ``tgt_loc[i]`` for every ``i``:
    SGLang's slot moves (``copy_all_layer_kv_cache_tiled``). All sources are read before any
    target is written, so overlapping moves are safe, as in the real kernel."""
    if tgt_loc.numel() == 0:
        return
    src = src_loc.to(torch.int64)
    tgt = tgt_loc.to(torch.int64)
    rows = int(max(int(src.max()), int(tgt.max()))) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        raw = (ctypes.c_uint8 * (rows * int(stride))).from_address(int(ptr))
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(rows, int(stride))
        buf[tgt] = buf[src]  # the gather is a copy: safe in place


def _unserved(name: str) -> Callable[..., NoReturn]:
    def op(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"sgl_kernel.{name}: speculative decoding is not served by "
                                  "the tests' CPU stand-in (tests/sglang_server)")

    op.__name__ = op.__qualname__ = name
    return op


for _name in SPECULATIVE:
    globals()[_name] = _unserved(_name)
