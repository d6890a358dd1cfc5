"""``HicachedOffloadingSpec``: hicached as vLLM's KV offloading backend.

vLLM (0.33 or 0.34: ``hicache.engines``; any other stops here with ``SPEC_INVALID``) loads it
by module path, into ``hicache_vllm.connector``'s connector (vLLM's own
``OffloadingConnector`` with its load-error path: a load that fails is recomputed)::

    --kv-transfer-config '{"kv_connector": "HicachedOffloadingConnector",
      "kv_connector_module_path": "hicache_vllm.connector", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"spec_name": "HicachedOffloadingSpec",
                                    "spec_module_path": "hicache_vllm.spec"}}'

or into vLLM's ``OffloadingConnector`` itself, which has no such path (a load given up then
stops the engine: ``hicache_vllm.worker``).

and asks it for a manager on the scheduler's side (``hicache_vllm.manager``) and a worker on
each rank (``hicache_vllm.worker``). The extra config's other keys are ``SpecConfig``'s
(``hicache_vllm.config``), checked when vLLM builds the spec: an unknown key or a bad value
stops vLLM's start with ``SPEC_INVALID`` naming it. The pools are named in
``hicache_vllm.namespace``.
"""

from __future__ import annotations

# isort: off
import hicache_vllm.served  # noqa: F401  (first: a vLLM hicached does not serve stops here)

# isort: on
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)

from hicache_vllm.config import SpecConfig
from hicache_vllm.manager import HicachedOffloadingManager
from hicache_vllm.namespace import Plan
from hicache_vllm.stats import definitions
from hicache_vllm.vllm_api import current
from hicache_vllm.worker import HicachedOffloadingWorker


class HicachedOffloadingSpec(OffloadingSpec):
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """The manager's metrics (``hicache_vllm.stats``), on vLLM's Prometheus endpoint."""
        return definitions()

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.api = current()
        """vLLM's release line, as the manager and the workers use it."""
        self.spec_config = SpecConfig.from_extra(self.extra_config)
        self.plan = Plan.from_config(config, self.spec_config)
        self.replicated_layout = self.plan.replicated  # rank 0 alone stores MLA blocks
        self._manager: HicachedOffloadingManager | None = None
        self._worker: HicachedOffloadingWorker | None = None
        self.report_load_errors = False
        """Set by ``HicachedOffloadingConnector`` before the worker is made: it tells vLLM of
        the blocks of a load given up."""

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = HicachedOffloadingManager(
                self.spec_config, self.plan, self.kv_events_config.enable_kv_cache_events,
                self.api)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = HicachedOffloadingWorker(self.spec_config, self.plan,
                                                    int(self.config.parallel.rank), kv_caches,
                                                    self.api, self.report_load_errors)
        return self._worker
