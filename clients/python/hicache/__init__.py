"""hicache: the light API package of hicached, imported by the daemon and by workers alike.

It holds only what the contract needs, and importing it loads neither gRPC, nor torch, nor any
part of the daemon:

- ``hicache.v1``: the generated protobuf / gRPC stubs of ``hicache.v1.HostCache``.
- ``errors``: the domain error tree; every class has a stable reason code (docs/api.md).
- ``specs``: pool kinds, dtypes, layouts, geometry and ``PoolSpec`` (validated dataclasses).
- ``buffers``: a worker's device buffers: rows, shapes, strides, ``DeviceBufferSpec``.
- ``indices``: index batches and their little-endian int64 wire form.
- ``keys``: cache keys (1..64 bytes, checked per batch) and SGLang's chained page hashes.
- ``layer_groups``: which per-layer event covers which layers of a load.
- ``codec``: wire messages <-> the domain objects above and ``PoolInfo`` (imports protobuf).
- ``error_mapping``: the one table from domain errors to gRPC codes, and the rich
  ``google.rpc.Status`` they travel as (imports gRPC).
- ``paths``: the default socket of a local daemon.
- ``cuda_driver``: the CUDA driver API through ctypes, loaded on first use only (workers export
  IPC handles with it, the daemon opens them).
- ``engines``: the engine releases hicached serves, one table, and the start-up check of each
  integration.
- ``pools``: ``PoolInfo``, a pool as the service reports it (one definition for the daemon
  and its clients; deprecated names derived; ``codec`` maps it to the wire).
- ``calls``: the calls' typed requests, shared by the client's codecs and the daemon's method
  table.
- ``fast_wire``: the fast path's framing: hello, headers, bodies, ``FrameSocket``.
- ``identity``: a session's id (the capability its worker holds) and its public name.
- ``polling``: poll before sleeping: the fast path's adaptive window.
- ``log_limit``: ``LimitedLog``: log lines rate-limited per reason, suppressions said.
- ``seams``: named points between racing steps, where a test stops one side.
- ``locks``: every lock of the daemon, the workers' libraries and this package, made by name
  in one written order, and the checker of that order.
"""

from hicache.errors import HiCacheError
from hicache.specs import (
    ANCHOR,
    CanarySpec,
    DType,
    KVGeometry,
    Layout,
    MemberSpec,
    PoolKind,
    PoolSpec,
    Role,
)

__version__ = "0.1.0"

__all__ = [
    "ANCHOR",
    "CanarySpec",
    "DType",
    "HiCacheError",
    "KVGeometry",
    "Layout",
    "MemberSpec",
    "PoolKind",
    "PoolSpec",
    "Role",
    "__version__",
]
