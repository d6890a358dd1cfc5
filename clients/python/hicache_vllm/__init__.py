"""vLLM integration: ``hicache_vllm.spec.HicachedOffloadingSpec``, an offloading spec for
vLLM 0.33's ``OffloadingConnector`` backed by the hicached daemon.

- ``hicache_vllm.spec``: the spec vLLM loads by module path.
- ``hicache_vllm.connector``: ``HicachedOffloadingConnector``, vLLM's ``OffloadingConnector``
  with its load-error path (a load given up is recomputed, not decoded on).
- ``hicache_vllm.config``: ``SpecConfig``, the ``kv_connector_extra_config`` keys, checked.
- ``hicache_vllm.namespace``: which pools an engine's blocks live in (``Plan``).
- ``hicache_vllm.promises``: batched, held lookups (a HIT is a promise).
- ``hicache_vllm.manager``: the scheduler-side manager.
- ``hicache_vllm.stats``: the manager's counts as vLLM's offloading metrics.
- ``hicache_vllm.blocks``: the blocks of one transfer.
- ``hicache_vllm.worker``: the worker-side transfers (CUDA IPC on GPUs, staging on CPU).
- ``hicache_vllm.vllm_api``: one adapter per vLLM release line (what 0.33 and 0.34 differ in).
- ``hicache_vllm.served``: imported first: a vLLM release hicached does not serve stops at
  start-up.

Importing this package does not import vLLM, torch or gRPC; the modules above do (config and
namespace import neither vLLM nor torch).
"""
