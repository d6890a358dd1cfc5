"""hicached: a host-memory daemon for hierarchical KV caches in LLM serving.

The core engine (no RPC inside): ``geometry`` (pool kinds, dtypes, layouts, specs), ``errors``
(domain errors with reason codes), ``validation`` (vectorized batch checks), ``memory`` (mapped,
prefaulted, optionally pinned host memory), ``allocator`` (pages), ``pool`` (host pools),
``devicekv`` (a worker's device buffers), ``copyplan`` / ``transfer`` (the copy engine) and
``canary`` (per-page fingerprints).
"""

from hicached.devicekv import DeviceKV
from hicached.geometry import (
    CanarySpec,
    DType,
    KVGeometry,
    Layout,
    MemberSpec,
    PoolKind,
    PoolSpec,
    Role,
)
from hicached.pool import HostPool, MemoryOptions
from hicached.transfer import Op, TransferEngine, TransferResult

__version__ = "0.1.0"

__all__ = [
    "CanarySpec",
    "DType",
    "DeviceKV",
    "HostPool",
    "KVGeometry",
    "Layout",
    "MemberSpec",
    "MemoryOptions",
    "Op",
    "PoolKind",
    "PoolSpec",
    "Role",
    "TransferEngine",
    "TransferResult",
    "__version__",
]
