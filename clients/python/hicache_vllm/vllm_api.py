"""vLLM's offloading API as hicached uses it: one adapter per release line, chosen once.

Where vLLM 0.33 and 0.34 differ, the difference lives here and nowhere else:

- **A job's device side.** 0.33's worker gets the engine's block ids (``GPULoadStoreSpec``:
  ids in group order, ``group_sizes``, the logical index of each group's first block); 0.34's
  gets ``DevicePointers``, resolved by its connector from those blocks: per group, per data
  reference (a canonical tensor), per block, a pointer and a size. Both become
  ``GroupBlocks``: per group, the engine block ids and the first one's logical index. A
  pointer is turned back into its block only where it is exactly one: inside the group's
  canonical tensor, on a block boundary, with the data reference's page size, the same block
  for every data reference of the group; anything else refuses the job (``ValueError``).
- **Failures.** 0.33's connector asserts that every job succeeded: a failure is never
  ``TransferResult.success = False`` there (the spec's own load-error path tells vLLM).
  0.34's takes ``success = False`` for a store (its chunks are dropped, never announced) and
  for an asynchronous load (the request is recomputed or failed, by
  ``kv_load_failure_policy``); a synchronous load that fails still stops its engine, so
  there the load-error path stays (``takes_failure``).
- **The GPU KV cache.** 0.34 allocates it by default as virtual memory (``cuMemCreate``),
  which legacy CUDA IPC cannot share; a connector that declares ``KVCacheAccess.EXPORTS_FD``
  gets it exportable as POSIX file descriptors, one physical allocation per segment
  (``kv_cache_access``). 0.33 has no such cache and no such declaration.
- **The manager.** 0.33's scheduler calls ``touch`` for blocks its own prefix cache hit; 0.34
  does not. 0.34's ``OffloadingEvent`` names the request it came from (``req_context``).

Primitives:

- ``GroupBlocks(group, block_ids, first)``: one KV cache group's blocks of a job.
- ``Api``: what every line provides: ``line`` (the ``hicache.engines.Line``),
  ``device_blocks(device, kv_caches)`` (and ``device_side(spec, kv_caches)``, the other way,
  as vLLM's connector does it), ``takes_failure(store, sync)``,
  ``kv_cache_access(config)``, ``stored_event(keys, medium, req_context)``; ``Api033``,
  ``Api034``.
- ``current()``: the adapter of the installed vLLM, checked against ``hicache.engines``
  (``SPEC_INVALID`` naming its version when it is not served). This module imports vLLM only
  in the adapters' methods, so the check comes before anything a release may lack.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache import engines
from hicache.errors import SpecInvalid
from hicache_vllm.config import SpecConfig


@dataclass(frozen=True)
class GroupBlocks:
    """The blocks of one KV cache group a job moves."""

    group: int
    """The KV cache group (vLLM's group index)."""
    block_ids: np.ndarray
    """Engine block ids (int64), in the request's order."""
    first: int
    """The logical index of the first block in the request's blocks of this group."""


class Api:
    """What hicached needs of one vLLM release line."""

    line: engines.Line

    def device_blocks(self, device: Any, kv_caches: Any) -> list[GroupBlocks]:
        """The groups with blocks in a job's device side (what vLLM's worker connector hands
        ``submit_store`` / ``submit_load``), over the worker's ``CanonicalKVCaches``."""
        raise NotImplementedError

    def device_side(self, spec: Any, kv_caches: Any) -> Any:
        """What this line's worker connector hands the worker for the blocks of ``spec`` (a
        ``GPULoadStoreSpec``): for benchmarks and tests that drive the worker without vLLM's
        connector."""
        return spec

    def takes_failure(self, store: bool, sync: bool) -> bool:
        """Whether vLLM's connector handles ``TransferResult.success = False`` for such a job
        (else it asserts success, or stops the engine)."""
        raise NotImplementedError

    def kv_cache_access(self, config: SpecConfig) -> Any:
        """What the connector declares to vLLM (``KVConnectorBase_V1.kv_cache_access``) for
        the spec's ``cuda_sharing``; None where the line has no such declaration."""
        return None

    def stored_event(self, keys: list[Any], medium: Any, req_context: Any) -> Any:
        """vLLM's ``OffloadingEvent`` for blocks this engine stored."""
        from vllm.v1.kv_offload.base import OffloadingEvent

        return OffloadingEvent(keys=keys, medium=medium, removed=False)


class Api033(Api):
    line = engines.lines("vllm")[0]

    def device_blocks(self, device: Any, kv_caches: Any) -> list[GroupBlocks]:
        ids = np.asarray(device.block_ids, dtype=np.int64)
        sizes = list(getattr(device, "group_sizes", None) or (len(ids),))
        firsts = list(getattr(device, "block_indices", None) or (0,) * len(sizes))
        if sum(sizes) != len(ids) or len(firsts) != len(sizes):
            raise ValueError(f"{len(ids)} engine blocks are not the groups' {sizes}")
        out, at = [], 0
        for group, (n, first) in enumerate(zip(sizes, firsts, strict=True)):
            if n:
                out.append(GroupBlocks(group, ids[at:at + n], int(first)))
            at += n
        return out

    def takes_failure(self, store: bool, sync: bool) -> bool:
        return False


class Api034(Api):
    line = engines.lines("vllm")[1]

    def device_blocks(self, device: Any, kv_caches: Any) -> list[GroupBlocks]:
        ptrs = np.asarray(device.ptrs, dtype=np.uint64)
        sizes = np.asarray(device.sizes, dtype=np.uint64)
        counts = tuple(int(n) for n in device.group_block_counts)
        refs_per = tuple(int(n) for n in device.group_data_ref_counts)
        firsts = tuple(int(n) for n in device.block_indices)
        groups = kv_caches.group_data_refs
        if not (len(counts) == len(refs_per) == len(firsts) == len(groups)):
            raise ValueError(f"pointers for {len(counts)} groups, the KV cache has "
                             f"{len(groups)}")
        if len(ptrs) != len(sizes) or len(ptrs) != sum(
                n * r for n, r in zip(counts, refs_per, strict=True)):
            raise ValueError(f"{len(ptrs)} pointers and {len(sizes)} sizes for groups of "
                             f"{counts} blocks and {refs_per} data references")
        out, at = [], 0
        for group, (n, r, first) in enumerate(zip(counts, refs_per, firsts, strict=True)):
            if not n:
                continue
            refs = groups[group]
            if r != len(refs):
                raise ValueError(f"group {group}: pointers for {r} data references, the KV "
                                 f"cache has {len(refs)}")
            ids = None
            for ref in refs:
                got = _blocks_of(ptrs[at:at + n], sizes[at:at + n],
                                 kv_caches.tensors[ref.tensor_idx].tensor,
                                 int(ref.page_size_bytes), group)
                if ids is None:
                    ids = got
                elif not np.array_equal(ids, got):
                    raise ValueError(f"group {group}: its data references' pointers name "
                                     "different blocks")
                at += n
            assert ids is not None
            out.append(GroupBlocks(group, ids, first))
        return out

    def device_side(self, spec: Any, kv_caches: Any) -> Any:
        from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

        return resolve_device_pointers(spec, kv_caches)

    def takes_failure(self, store: bool, sync: bool) -> bool:
        return store or not sync

    def kv_cache_access(self, config: SpecConfig) -> Any:
        from vllm.config.kv_transfer import KVCacheAccess
        from vllm.platforms import current_platform

        if not current_platform.is_cuda():  # CPU: the KV cache is the engine's own memory
            return KVCacheAccess.IN_PROCESS
        if config.cuda_sharing == "legacy_ipc":
            return KVCacheAccess.LEGACY_IPC
        if not config.target.startswith("unix:"):
            raise SpecInvalid(
                f"{config.SECTION}.cuda_sharing \"fd\" hands vLLM's KV cache to the daemon "
                "as file descriptors, which travel only over its Unix socket; target "
                f"{config.target[:200]!r} is not one: set \"cuda_sharing\": \"legacy_ipc\" "
                "(vLLM then turns its extensible KV cache off), or reach the daemon on its "
                "Unix socket", metadata={"field": "cuda_sharing", "target": config.target[:200]})
        return KVCacheAccess.EXPORTS_FD

    def stored_event(self, keys: list[Any], medium: Any, req_context: Any) -> Any:
        from vllm.v1.kv_offload.base import OffloadingEvent

        return OffloadingEvent(keys=keys, medium=medium, removed=False, req_context=req_context)


def _blocks_of(ptrs: np.ndarray, sizes: np.ndarray, tensor: Any, page_bytes: int,
               group: int) -> np.ndarray:
    """The block ids ``ptrs`` point at in ``tensor`` (``(num_blocks, ...)`` bytes), each
    exactly one block's start with ``page_bytes`` to copy."""
    base = int(tensor.data_ptr())
    stride = int(tensor.stride(0)) * int(tensor.element_size())
    blocks = int(tensor.shape[0])
    if stride <= 0:
        raise ValueError(f"group {group}: a canonical tensor with block stride {stride}")
    if np.any(sizes != np.uint64(page_bytes)):
        bad = int(sizes[sizes != np.uint64(page_bytes)][0])
        raise ValueError(f"group {group}: a copy of {bad} bytes, the layer's page is "
                         f"{page_bytes}")
    offs = ptrs.astype(np.int64) - np.int64(base)  # (a pointer below base goes negative)
    ids = offs // stride
    if np.any(offs < 0) or np.any(offs % stride) or np.any(ids >= blocks):
        raise ValueError(f"group {group}: a pointer that is not a block of its KV cache "
                         f"tensor ({blocks} blocks of {stride} bytes)")
    return ids


_ADAPTERS: dict[str, type[Api]] = {"0.33": Api033, "0.34": Api034}
assert sorted(_ADAPTERS) == sorted(x.line for x in engines.lines("vllm")), \
    "every vLLM line of hicache.engines has its adapter here"


@functools.cache
def current() -> Api:
    """The adapter of the installed vLLM (``SPEC_INVALID`` when its version is not served)."""
    return _ADAPTERS[engines.check("vllm").line]()


def adapters() -> Sequence[Api]:
    """One adapter per line served (for the tests)."""
    return [cls() for cls in _ADAPTERS.values()]
