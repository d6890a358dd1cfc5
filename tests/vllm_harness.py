"""A vLLM 0.33 engine without a model: its real ``Scheduler`` and ``OffloadingConnector`` (both
roles) with ``hicache_vllm.spec``, and a stand-in forward that writes known KV.

Run in a subprocess with vLLM's code on the path (``.vllm-0.33.0``, ``VLLM_TARGET_DEVICE=cpu``,
``HF_HUB_OFFLINE=1``): ``python -m tests.vllm_harness <scenario> '<json args>'`` (a function of
``tests.scenarios_vllm``) prints one line, ``RESULT`` and the JSON of what the scenario saw.
The model directory holds a tiny Llama ``config.json`` only (``skip_tokenizer_init``); vLLM's
``_C`` is never loaded.

The forward writes, for each token the scheduler computes, rows derived from the request's
whole prefix up to that token (a rolling hash) and the layer: a block loaded from the daemon
holds exactly those bytes only if the right pages came back into the right blocks. Tokens a
load supplies are never written by the forward.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
         "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
         "rms_norm_eps": 1e-5, "torch_dtype": "float32", "head_dim": 16}


def model_dir(root: Path, **over: Any) -> Path:
    d = root / "tiny-llama"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**LLAMA, **over}))
    return d


class Engine:
    """One engine: the scheduler and one worker-side connector (rank 0 of 1)."""

    def __init__(self, model: str, target: str, *, block_size: int = 16, num_blocks: int = 64,
                 extra: dict[str, Any] | None = None, events: bool = False) -> None:
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVEventsConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        extra = {"spec_name": "HicachedOffloadingSpec", "spec_module_path": "hicache_vllm.spec",
                 "target": target, **(extra or {})}
        mc = ModelConfig(model=model, skip_tokenizer_init=True, dtype="float32",
                         max_model_len=2048, seed=0)
        self.config = VllmConfig(
            model_config=mc,
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512,
                                             max_model_len=2048, is_encoder_decoder=False,
                                             enable_chunked_prefill=True),
            kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector",
                                                kv_role="kv_both",
                                                kv_connector_extra_config=extra),
            kv_events_config=KVEventsConfig(enable_kv_cache_events=events, publisher="null")
            if events else None,
            device_config=DeviceConfig("cpu"))
        self.block_size = block_size
        self.layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=16,
                                 dtype=torch.float32)
        page = spec.page_size_bytes
        self.kv_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[KVCacheTensor(size=page * num_blocks * len(self.layers),
                                            layers=list(self.layers),
                                            layer_stride=page * num_blocks, block_stride=page)],
            kv_cache_groups=[KVCacheGroupSpec(self.layers, spec)])
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(block_size, sha256)
        self.config.cache_config.num_gpu_blocks = num_blocks
        # as vLLM starts: the workers register their KV caches, then the scheduler is built
        backing = torch.zeros(len(self.layers), num_blocks, 2, block_size, 2, 16)
        self.kv = {n: backing[i] for i, n in enumerate(self.layers)}  # layer-outermost
        self.worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER,
                                                          self.kv_config)
        self.worker.register_kv_caches(self.kv)
        self.scheduler = Scheduler(self.config, self.kv_config,
                                   StructuredOutputManager(self.config), block_size=block_size,
                                   log_stats=True)
        self.tokens: dict[str, list[int]] = {}
        self.loaded_tokens: dict[str, int] = {}
        self.written: dict[str, set[int]] = {}
        self._blocks: dict[str, list[int]] = {}
        self.results: dict[str, dict[str, Any]] = {}
        """Each finished request's check, made as it finished."""

    # -- requests and steps ---------------------------------------------------------------

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 1) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(req_id, list(tokens), sp, None, block_hasher=self.hasher)
        self.tokens[req_id] = list(tokens)
        self.written[req_id] = set()
        self.scheduler.add_request(req)

    def step(self) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        w = self.worker
        w.bind_connector_metadata(meta)
        w.handle_preemptions(meta)
        w.start_load_kv(None)
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        for r in out.scheduled_new_reqs:
            self.loaded_tokens.setdefault(r.req_id, r.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            starts[rid] = cached.num_computed_tokens[i]
        sampled: dict[str, list[int]] = {}
        for rid, n in out.num_scheduled_tokens.items():
            self._forward(rid, starts[rid], n)
            req = self.scheduler.requests[rid]
            if starts[rid] + n >= req.num_tokens:  # the prompt (or the last token) is in
                sampled[rid] = [7]
        w.wait_for_save()
        sending, recving = w.get_finished(out.finished_req_ids)
        wmeta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        mro = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[sampled.get(r, []) for r in ids],
            kv_connector_output=KVConnectorOutput(finished_sending=sending or None,
                                                  finished_recving=recving or None,
                                                  kv_connector_worker_meta=wmeta))
        self.scheduler.update_from_output(out, mro)
        for rid in list(self.tokens):
            if rid not in self.scheduler.requests and rid not in self.results:
                # finished: its blocks are freed, but none is reused before the next step
                self.results[rid] = self.check_finished(rid)
        return out

    def _forward(self, rid: str, start: int, n: int) -> None:
        blocks = list(self.scheduler.kv_cache_manager.get_block_ids(rid)[0])
        self._blocks[rid] = blocks
        toks = self.tokens[rid] + [7] * 4096
        for pos in range(start, start + n):
            b, off = blocks[pos // self.block_size], pos % self.block_size
            for li, name in enumerate(self.layers):
                self.kv[name][b, :, off] = expected_rows(toks[:pos + 1], li)
            self.written[rid].add(pos)

    def run(self, until_idle: float = 10.0) -> None:
        """Step until every request is done and no transfer is in flight."""
        end = time.monotonic() + until_idle
        sched = self.scheduler
        while time.monotonic() < end:
            self.step()
            if not sched.has_unfinished_requests() and not sched.has_finished_requests():
                conn = sched.connector
                busy = conn is not None and (conn.has_pending_push_work()
                                             or _has_jobs(conn))
                if not busy:
                    return
            time.sleep(0.002)
        raise TimeoutError("the engine did not go idle")

    # -- checks ---------------------------------------------------------------------------

    def check_finished(self, rid: str) -> dict[str, Any]:
        """Compare every prompt token's rows (but the last) with what the forward would have
        written for that prefix, in the blocks the request had."""
        blocks = self._blocks[rid]
        toks = self.tokens[rid]
        bad = []
        for pos in range(len(toks) - 1):
            b, off = blocks[pos // self.block_size], pos % self.block_size
            for li, name in enumerate(self.layers):
                if not torch.equal(self.kv[name][b, :, off], expected_rows(toks[:pos + 1], li)):
                    bad.append(pos)
                    break
        return {"bad": bad[:20], "n_bad": len(bad)}

    @property
    def scheduler_side(self) -> Any:
        return self.scheduler.connector.connector_scheduler

    def manager_stats(self) -> dict[str, int]:
        m = self.scheduler_side.manager
        return {**m.stats, **m.promises.stats}

    def links_up(self) -> bool:
        links = [*self.scheduler_side.manager.links, self.worker.connector_worker.worker.link]
        return all(link.usable for link in links)

    def worker_stats(self) -> dict[str, int]:
        return dict(self.worker.connector_worker.worker.stats)

    def zero(self) -> None:
        for t in self.kv.values():
            t.zero_()

    def close(self) -> None:
        self.worker.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()


def _has_jobs(conn: Any) -> bool:
    return bool(conn.connector_scheduler._jobs)


def expected_rows(prefix: list[int], layer: int) -> torch.Tensor:
    """K and V rows of the last token of ``prefix`` at ``layer``: shape (2, 2, 16)."""
    h = 1469598103
    for t in prefix:
        h = (h * 1099511 + t + 1) % 2147483629
    base = torch.arange(64, dtype=torch.int64) + (h % 100003) * 64 + layer * 7919
    return (base % 65521).to(torch.float32).view(2, 2, 16)


if __name__ == "__main__":
    from tests import scenarios_vllm

    name, args = sys.argv[1], json.loads(sys.argv[2])
    result = getattr(scenarios_vllm, name)(**args)
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)
