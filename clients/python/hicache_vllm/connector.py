"""``HicachedOffloadingConnector``: vLLM's ``OffloadingConnector`` with its load-error path and,
on vLLM 0.34, the GPU KV cache declared exportable.

vLLM 0.33's ``OffloadingConnector`` cannot be told that a load failed (its worker asserts each
job's success, and it does not implement ``get_block_ids_with_load_errors``); 0.34's takes a
failed asynchronous load (``TransferResult.success = False``) but not a synchronous one, whose
request already ran on the blocks. vLLM's scheduler can be told in both: a connector that
reports the engine blocks a load did not fill has them recomputed, or fails only the requests
that needed them (``kv_load_failure_policy``: "recompute" or, vLLM's default, "fail"), the
rest of the batch untouched. This connector is vLLM's own with that one method added: the
spec's worker (``hicache_vllm.worker``) reports the job done and names its blocks here, in the
step that reports the job, wherever vLLM does not take the failure itself. It also hands the
manager each new request (``follow``), so that the pages stored are told with their tokens
and parent key (routers that match tokens find them), answers vLLM 0.34's
``kv_cache_access`` (on GPUs the KV cache is handed to the daemon, another process:
``EXPORTS_FD``, or ``LEGACY_IPC`` with ``cuda_sharing`` ``legacy_ipc``) and, with lookahead
block hashes (``num_hash_lookahead_tokens`` > 0: EAGLE / MTP with prefix caching; vLLM asks
``supports_lookahead_block_hashes``, True as for vLLM's own), tells the manager how many
tokens after each block its hash covers (``hash_lookahead``): the stores say them too.
Loaded by module path::

    --kv-transfer-config '{"kv_connector": "HicachedOffloadingConnector",
      "kv_connector_module_path": "hicache_vllm.connector", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {...}}'

``spec_name`` / ``spec_module_path`` default to ``HicachedOffloadingSpec`` /
``hicache_vllm.spec``; another spec is refused (``SPEC_INVALID``).

Primitives: ``HicachedOffloadingConnector``.
"""

from __future__ import annotations

# isort: off
import hicache_vllm.served  # noqa: F401  (first: a vLLM hicached does not serve stops here)

# isort: on
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from hicache.errors import SpecInvalid
from hicache_vllm.config import SpecConfig
from hicache_vllm.manager import HicachedOffloadingManager
from hicache_vllm.spec import HicachedOffloadingSpec
from hicache_vllm.vllm_api import current
from hicache_vllm.worker import HicachedOffloadingWorker

SPEC = {"spec_name": "HicachedOffloadingSpec", "spec_module_path": "hicache_vllm.spec"}


class HicachedOffloadingConnector(OffloadingConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        kv = vllm_config.kv_transfer_config
        if kv.kv_connector_extra_config is None:
            kv.kv_connector_extra_config = {}
        for k, v in SPEC.items():
            kv.kv_connector_extra_config.setdefault(k, v)
        super().__init__(vllm_config, role, kv_cache_config)
        spec = self.connector_worker.spec if self.connector_worker is not None else None
        manager = (self.connector_scheduler.manager if self.connector_scheduler is not None
                   else None)
        if (spec is not None and not isinstance(spec, HicachedOffloadingSpec)) or (
                manager is not None and not isinstance(manager, HicachedOffloadingManager)):
            raise SpecInvalid("HicachedOffloadingConnector serves hicache_vllm.spec's "
                              "HicachedOffloadingSpec only",
                              metadata={"spec_name": str(kv.kv_connector_extra_config.get(
                                  "spec_name"))[:64]})
        if isinstance(spec, HicachedOffloadingSpec):
            spec.report_load_errors = True  # before vLLM asks it for its worker
        if isinstance(manager, HicachedOffloadingManager):  # (0 on 0.33: a KV connector
            # keeps its legacy hashes there)
            manager.hash_lookahead(getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0)

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM 0.34's question, asked before it allocates the KV cache: on GPUs the spec's
        workers hand it to the daemon in another process, as file descriptors of its
        physical allocations (``EXPORTS_FD``: vLLM keeps its extensible KV cache, one
        exportable allocation per segment) or, with ``cuda_sharing`` ``legacy_ipc``, as CUDA
        IPC handles (``LEGACY_IPC``: vLLM turns the extensible cache off). On the CPU the
        workers copy through their own staging buffers (``IN_PROCESS``)."""
        config = SpecConfig.from_extra(kv_transfer_config.kv_connector_extra_config)
        return current().kv_cache_access(config)

    def on_new_request(self, request: Any) -> None:
        """vLLM's: the manager follows the request too (its stores then say their pages'
        tokens and parent: what routers that match tokens need)."""
        cs = self.connector_scheduler
        if cs is not None and isinstance(cs.manager, HicachedOffloadingManager):
            cs.manager.follow(request)
        super().on_new_request(request)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Engine blocks of loads given up (reported done in this step or before): vLLM
        recomputes them or fails the requests that needed them."""
        cw = self.connector_worker
        worker = cw.worker if cw is not None else None
        if isinstance(worker, HicachedOffloadingWorker):
            return worker.take_load_errors()
        return set()
