"""hicache_client: the worker-side library of hicached.

- ``HiCacheClient``: typed methods mirroring the ``hicache.v1.HostCache`` RPCs; index tensors
  in and out; errors raised as the daemon's domain classes (``hicached.errors``) carrying
  reason, metadata, violations and ``grpc_code``; reconnect with backoff for idempotent calls.
- ``ShmDeviceBuffers``: device KV buffers for CPU workers, backed by shared-memory files that the
  daemon maps.
- ``WorkerSession``: an open session with a heartbeat thread.
"""

from hicache_client.client import HiCacheClient, PoolInfo, TransferStats, WorkerSession
from hicache_client.shm import ShmDeviceBuffers

__all__ = ["HiCacheClient", "PoolInfo", "ShmDeviceBuffers", "TransferStats", "WorkerSession"]
