"""SGLang's device KV pool as hicached sees it: the pool spec, the per-layer tensors, the handover.

SGLang 0.5.23 resolves no pool view for plain MHA / MLA models, so the linker reads the pool
it gets from ``params.token_to_kv_pool_allocator.get_kvcache()`` directly:

- ``MHATokenToKVPool`` (NHD layout): ``k_buffer[layer]`` (size + page_size, heads, head_dim),
  ``v_buffer[layer]`` (..., v_head_dim) -> an ``MHA`` member with roles K and V.
- ``MLATokenToKVPool``: ``kv_buffer[layer]`` (size + page_size, 1, kv_cache_dim) -> an ``MLA``
  member with role KV. The row width is the buffer's real one (``kv_cache_dim`` can exceed
  kv_lora_rank + qk_rope_head_dim, e.g. packed fp8); hicached stores whole rows.

The dtype is the pool's *store* dtype (fp8 KV is stored as uint8 by SGLang, so by us too).

Primitives:

- ``DevicePool.from_kvcache(kvcache)``: geometry, dtype, page size, size and tensors; anything
  else (HND / vectorized layouts, hybrid SWA / Mamba / DSA pools, layer-sharded pools) is
  refused with ``SpecInvalid`` saying what is unsupported.
- ``DevicePool.pool_spec(name, size_tokens, size_bytes, ratio)``: the hicached ``PoolSpec``
  (by default ``ratio`` times the device pool, whole pages).
- ``DevicePool.rehome_to_shm(spec, shm_dir, sealed)``: CPU workers: move the pool's tensors into
  shared memory (sealed memfds, or files under ``shm_dir``; contents copied, SGLang's lists
  rebound in place) so the daemon can map them; returns the ``ShmDeviceBuffers`` whose
  descriptors and fds ``OpenSession`` takes.
- ``DevicePool.cuda_buffers()``: GPU workers: the tensors as they are, as CUDA IPC descriptors or
  VMM chunks' (``CudaDeviceBuffers``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hicache.errors import SpecInvalid
from hicache.specs import ANCHOR, DType, KVGeometry, Layout, PoolKind, PoolSpec, Role

if TYPE_CHECKING:
    import torch

    from hicache_client.cuda import CudaDeviceBuffers
    from hicache_client.shm import ShmDeviceBuffers


def _unsupported(kvcache: object, why: str) -> SpecInvalid:
    return SpecInvalid(f"hicached cannot serve SGLang's {type(kvcache).__name__}: {why}",
                       metadata={"pool_class": type(kvcache).__name__, "why": why})


@dataclass
class DevicePool:
    kvcache: Any
    """SGLang's pool object (tensors are rebound on it by ``rehome_to_shm``)."""
    geometry: KVGeometry
    """Kind, store dtype and dimensions per rank."""
    page_size: int
    size: int
    """SGLang's ``size``: device token slots (the buffers have page_size more rows)."""
    roles: dict[Role, str]
    """Which attribute of the pool holds each role's per-layer list."""

    @property
    def is_mla(self) -> bool:
        return self.geometry.kind is PoolKind.MLA

    @property
    def device(self) -> torch.device:
        return self.layers(next(iter(self.roles)))[0].device

    def layers(self, role: Role) -> list[torch.Tensor]:
        return list(getattr(self.kvcache, self.roles[role]))

    def tensors(self) -> dict[str, dict[Role, list[torch.Tensor]]]:
        return {ANCHOR: {role: self.layers(role) for role in self.roles}}

    @classmethod
    def from_kvcache(cls, kvcache: Any) -> DevicePool:
        """Describe SGLang's MHA or MLA device pool; refuse what hicached cannot hold."""
        import torch

        if getattr(kvcache, "layer_shard_enabled", False):
            raise _unsupported(kvcache, "layer-sharded pools are not supported")
        store = getattr(kvcache, "store_dtype", None)
        if not isinstance(store, torch.dtype):
            raise _unsupported(kvcache, "it has no store_dtype")
        dtype = DType.from_torch(store)
        page_size, size = int(kvcache.page_size), int(kvcache.size)
        if hasattr(kvcache, "k_buffer") and hasattr(kvcache, "v_buffer"):
            layout = getattr(kvcache, "kv_cache_layout", "nhd")
            if layout != "nhd":
                raise _unsupported(kvcache, f"KV layout {layout!r} (only 'nhd' is)")
            k, v = kvcache.k_buffer[0], kvcache.v_buffer[0]
            if k.dim() != 3 or v.dim() != 3 or k.shape[1] != v.shape[1]:
                raise _unsupported(kvcache, f"K/V buffers of shapes {tuple(k.shape)} / "
                                            f"{tuple(v.shape)}")
            geometry = KVGeometry(PoolKind.MHA, dtype, layer_num=len(kvcache.k_buffer),
                                  head_num=int(k.shape[1]), head_dim=int(k.shape[2]),
                                  v_head_dim=int(v.shape[2]) if v.shape[2] != k.shape[2] else 0)
            roles = {Role.K: "k_buffer", Role.V: "v_buffer"}
        elif hasattr(kvcache, "kv_buffer") and hasattr(kvcache, "kv_lora_rank"):
            if getattr(kvcache, "use_dsa", False):
                raise _unsupported(kvcache, "DSA (indexer) pools are not supported yet")
            kv = kvcache.kv_buffer[0]
            if kv.dim() != 3 or kv.shape[1] != 1:
                raise _unsupported(kvcache, f"MLA buffer of shape {tuple(kv.shape)}")
            width, rope = int(kv.shape[2]), int(kvcache.qk_rope_head_dim)
            rope = rope if 0 <= rope < width else 0
            geometry = KVGeometry(PoolKind.MLA, dtype, layer_num=len(kvcache.kv_buffer),
                                  kv_lora_rank=width - rope, qk_rope_head_dim=rope)
            roles = {Role.KV: "kv_buffer"}
        else:
            raise _unsupported(kvcache, "only MHATokenToKVPool and MLATokenToKVPool are "
                                        "supported (no hybrid SWA / Mamba pools yet)")
        pool = cls(kvcache, geometry, page_size, size, roles)
        for role in roles:
            for t in pool.layers(role):
                if t.shape[0] != size + page_size:
                    raise _unsupported(kvcache, f"a {role.value} buffer has {t.shape[0]} rows, "
                                                f"expected size + page_size = {size + page_size}")
        return pool

    def pool_spec(self, name: str, size_tokens: int = 0, size_bytes: int = 0,
                  ratio: float = 1.0) -> PoolSpec:
        """The host pool for these buffers; by default ``ratio`` times the tokens the device
        holds (whole pages, at least one)."""
        if not size_tokens and not size_bytes:
            pages = max(int(ratio * self.size) // self.page_size, 1)
            size_tokens = pages * self.page_size
        return PoolSpec(name=name, geometry=self.geometry, page_size=self.page_size,
                        layout=Layout.LAYER_FIRST, size_tokens=size_tokens,
                        size_bytes=size_bytes)

    def rehome_to_shm(self, spec: PoolSpec, shm_dir: str, sealed: bool = True
                      ) -> ShmDeviceBuffers:
        """Copy every layer into shared memory and rebind SGLang's lists to it: sealed memfds
        (handed over by fd; nothing can shrink them) or files under ``shm_dir``."""
        import torch

        from hicache_client.shm import ShmDeviceBuffers

        shm = ShmDeviceBuffers.create(spec, self.size, shm_dir=shm_dir, prefix="hicache-sglang",
                                      sealed=sealed)
        try:
            for role, attr in self.roles.items():
                new = shm.layers(ANCHOR, role)
                for dst, src in zip(new, self.layers(role), strict=True):
                    dst.copy_(src)
                getattr(self.kvcache, attr)[:] = new  # in place: other holders see it too
        except BaseException:
            shm.close()
            raise
        # kernels that take per-layer base pointers read these tables
        for table, role in (("k_data_ptrs", Role.K), ("v_data_ptrs", Role.V),
                            ("data_ptrs", Role.KV)):
            if role in self.roles and isinstance(getattr(self.kvcache, table, None),
                                                 torch.Tensor):
                setattr(self.kvcache, table, torch.tensor(
                    [t.data_ptr() for t in self.layers(role)], dtype=torch.uint64))
        return shm

    def cuda_buffers(self) -> CudaDeviceBuffers:
        """The tensors as they are, for the daemon: CUDA IPC descriptors, or VMM chunks'
        descriptors and fds (which the caller closes once no session will be opened again)."""
        from hicache_client.cuda import CudaDeviceBuffers

        return CudaDeviceBuffers.from_tensors(self.tensors())
