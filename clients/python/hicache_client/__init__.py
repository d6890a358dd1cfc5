"""hicache_client: the worker-side library of hicached.

It depends on the light API package ``hicache`` only: importing it loads no part of the daemon,
no native extension of ours, and not torch (imported when tensors are made).

- ``HiCacheClient``: typed methods mirroring the ``hicache.v1.HostCache`` RPCs; index tensors
  in and out; errors raised as the domain classes of ``hicache.errors`` carrying reason,
  metadata, violations and ``grpc_code``; reconnect with backoff for idempotent calls.
- ``ShmDeviceBuffers``: device KV buffers for CPU workers, backed by shared-memory files that the
  daemon maps.
- ``WorkerSession``: an open session with a heartbeat thread (raw backup / load, keyed store /
  load_keys, owned alloc).
- ``LookupResult``, ``StoreResult``, ``CacheEvent``, ``PoolInfo``, ``TransferStats``: replies.
- Modules: ``client`` (``HiCacheClient``), ``session`` (``WorkerSession``), ``results`` (the
  replies), ``codecs`` (a typed request onto either wire; ``HiCacheClient.call`` picks the
  path), ``fast_path`` (the fast path's connections), ``shm`` (``ShmDeviceBuffers``),
  ``identity`` (the identity socket: who this worker is, memfds handed over).
- The engine kit both integrations (SGLang's linker, vLLM's spec) are built on:
  ``engine_config`` (their shared settings), ``pool_names`` (one naming rule), ``link`` (the
  pool and session kept up, late or down), ``pool_setup`` (a pool's size), ``hold_book`` (the
  holds: freshness, claims, releases).
- ``hicache_client.cuda``: GPU workers' buffers as CUDA IPC handles or VMM chunk fds, and
  their events.
- ``hicache_client.cli``: ``hicachectl``.
"""

from hicache_client.client import EventStream, HiCacheClient
from hicache_client.results import (
    CacheEvent,
    LookupResult,
    PoolInfo,
    StoreResult,
    TransferStats,
)
from hicache_client.session import WorkerSession
from hicache_client.shm import ShmDeviceBuffers

__all__ = ["CacheEvent", "EventStream", "HiCacheClient", "LookupResult", "PoolInfo",
           "ShmDeviceBuffers", "StoreResult", "TransferStats", "WorkerSession"]
