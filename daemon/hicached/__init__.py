"""hicached: the KV cache daemon of an inference node, and its engine for in-process use.

Layers, top uses bottom (import rules in pyproject.toml, checked by import-linter):

- ``server``: the process wiring: app (listeners, threads, start and drain), config, locks,
  metrics.
- ``frontends``: how calls arrive: the gRPC service and its interceptors, the fast path, the
  identity socket, each a codec over the method table; one envelope (errors, metrics, auth,
  access, admission, drain) for all of them.
- ``publish``: what the daemon tells others unasked: the KV event stream routers follow.
- ``service``: the application: the method table (``calls``), the daemon's flows, sessions,
  the pool table, admission, identity, request bounds (no gRPC, no wire format).
- ``transport``: attaching worker buffers (shared-memory files, sealed memfds, CUDA IPC).
- ``cuda``: the GPU runner, its copy segments, pinning through the driver.
- ``copy``: copy plans, the CPU runner with its native kernel, the transfer engine.
- ``tiers``: the disk and cluster (Mooncake Store) tiers below host memory.
- ``cache``: pages named by content keys: index, holds, removal, events, key slots.
- ``core``: validation, allocator, canary, host memory, pools, worker buffers.
- ``hicache`` (a separate, light package both sides import): stubs, errors, specs, codec.

The ``hicache-bench`` tool is a package of its own (``hicache_bench``), which the daemon never
imports.

The engine's main names are importable from here (loaded on first use, so that importing one
subpackage does not load the others): ``HostPool``, ``MemoryOptions``, ``WorkerBuffers``,
``TransferEngine``, ``Op``, ``TransferResult``, and the specs of ``hicache.specs``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hicache import __version__
from hicache.specs import (
    CanarySpec,
    DType,
    KVGeometry,
    Layout,
    MemberSpec,
    PoolKind,
    PoolSpec,
    Role,
)

if TYPE_CHECKING:
    from hicached.copy.engine import Op, TransferEngine, TransferResult
    from hicached.core.pool import HostPool, MemoryOptions
    from hicached.core.worker_buffers import WorkerBuffers

_LAZY = {
    "HostPool": "hicached.core.pool",
    "MemoryOptions": "hicached.core.pool",
    "WorkerBuffers": "hicached.core.worker_buffers",
    "TransferEngine": "hicached.copy.engine",
    "Op": "hicached.copy.engine",
    "TransferResult": "hicached.copy.engine",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hicached' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "CanarySpec",
    "DType",
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
    "WorkerBuffers",
    "__version__",
]
