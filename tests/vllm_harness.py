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

The connector is vLLM's ``OffloadingConnector`` (``connector="plain"``) or
``hicache_vllm.connector.HicachedOffloadingConnector`` (``"hicached"``, with vLLM's
``kv_load_failure_policy``); a step reports what vLLM's model runner reports (its transfer
results and ``get_block_ids_with_load_errors``), and a request vLLM finished with an error is
recorded in ``finish_reasons``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

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


DEEPSEEK = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
            "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
            "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2,
            "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
            "torch_dtype": "float32", "kv_lora_rank": 16, "q_lora_rank": None,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
            "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
            "moe_layer_freq": 1, "first_k_dense_replace": 2, "routed_scaling_factor": 1.0,
            "n_group": 1, "topk_group": 1, "topk_method": "greedy", "rope_theta": 10000}
MLA_WIDTH = 24  # kv_lora_rank + qk_rope_head_dim


def mla_model_dir(root: Path) -> Path:
    d = root / "tiny-deepseek"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(DEEPSEEK))
    return d


class Engine:
    """One engine: the scheduler (rank 0) and one worker-side connector per rank. With
    ``tp`` 2 each rank is a process of its own, joined by a gloo group on loopback: rank 0
    schedules and sends each step's plan (vLLM's connector metadata, what to compute) to the
    others; every rank runs its connector and writes its own KV (MHA: its heads, so its rows
    differ per rank; MLA: the same rows on every rank); rank 0 gathers their outputs with
    vLLM's ``KVOutputAggregator``, as its executor does."""

    def __init__(self, model: str, target: str, *, block_size: int = 16, num_blocks: int = 64,
                 extra: dict[str, Any] | None = None, events: bool = False, tp: int = 1,
                 rank: int = 0, port: int = 0, mla: bool = False, layers: int = 2,
                 heads: int = 2, head_size: int = 16, dtype: torch.dtype = torch.float32,
                 connector: str = "plain", failure_policy: str = "fail",
                 lookahead: int = 0) -> None:
        """``lookahead``: vLLM 0.34's lookahead block hashes, ``num_hash_lookahead_tokens``
        resolved to that many tokens (``hash_lookahead``: why that is vLLM's own path)."""
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVEventsConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
            MLAAttentionSpec,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        from tests.vllm_cpu_platform import allow_without_triton

        allow_without_triton()
        self.tp, self.rank, self.mla = tp, rank, mla
        if tp > 1:
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=tp)
        extra = {"spec_name": "HicachedOffloadingSpec", "spec_module_path": "hicache_vllm.spec",
                 "target": target, **(extra or {})}
        mc = ModelConfig(model=model, skip_tokenizer_init=True, dtype="float32",
                         max_model_len=2048, seed=0)
        parallel = ParallelConfig(tensor_parallel_size=tp, rank=rank,
                                  distributed_executor_backend="mp" if tp > 1 else None)
        self.config = VllmConfig(
            model_config=mc, parallel_config=parallel,
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512,
                                             max_model_len=2048, is_encoder_decoder=False,
                                             enable_chunked_prefill=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector" if connector == "plain"
                else "HicachedOffloadingConnector",
                kv_connector_module_path=None if connector == "plain"
                else "hicache_vllm.connector",
                kv_role="kv_both", engine_id="engine-0", kv_connector_extra_config=extra,
                kv_load_failure_policy=failure_policy),  # type: ignore[arg-type]
            kv_events_config=KVEventsConfig(enable_kv_cache_events=events, publisher="null")
            if events else None,
            device_config=DeviceConfig("cpu"))
        self.block_size = block_size
        self.layers = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        if mla:
            spec: Any = MLAAttentionSpec(block_size=block_size, num_kv_heads=1,
                                         head_size=MLA_WIDTH, dtype=dtype)
            self.row_shape: tuple[int, ...] = (MLA_WIDTH,)
            shape: tuple[int, ...] = (num_blocks, block_size, MLA_WIDTH)
        else:
            heads //= tp
            spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads,
                                     head_size=head_size, dtype=dtype)
            self.row_shape = (2, heads, head_size)
            shape = (num_blocks, 2, block_size, heads, head_size)
        page = spec.page_size_bytes
        self.kv_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[KVCacheTensor(size=page * num_blocks * len(self.layers),
                                            layers=list(self.layers),
                                            layer_stride=page * num_blocks, block_stride=page)],
            kv_cache_groups=[KVCacheGroupSpec(self.layers, spec)],
            kv_tp_replicas=tp if mla else 1)
        self.config.cache_config.num_gpu_blocks = num_blocks
        if lookahead:
            hash_lookahead(self.config, lookahead)
        self.lookahead = lookahead
        init_none_hash(sha256)
        # as vLLM's EngineCore builds it, with the config's lookahead
        self.hasher = get_request_block_hasher(block_size, sha256,
                                               self.config.num_hash_lookahead_tokens)
        # as vLLM starts: the workers register their KV caches, then the scheduler is built
        backing = torch.zeros(len(self.layers), *shape, dtype=dtype)
        self.kv = {n: backing[i] for i, n in enumerate(self.layers)}  # layer-outermost
        self.worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER,
                                                          self.kv_config)
        self.worker.register_kv_caches(self.kv)
        self._barrier()
        self.scheduler: Any = None
        if rank == 0:
            self.scheduler = Scheduler(self.config, self.kv_config,
                                       StructuredOutputManager(self.config),
                                       block_size=block_size, log_stats=True)
            self.aggregator = KVOutputAggregator.from_connector(self.worker, tp)
        self.tokens: dict[str, list[int]] = {}
        self.loaded_tokens: dict[str, int] = {}
        self.connector_payloads: list[dict[str, Any]] = []
        """The connector's stats each step handed vLLM's metrics (``SchedulerStats``)."""
        self._blocks: dict[str, list[int]] = {}
        self.results: dict[str, dict[str, Any]] = {}
        """Each finished request's check, made as it finished."""
        self.finish_reasons: dict[str, str] = {}
        """How each finished request ended, as vLLM told its client ("length", "error")."""
        self.emitted: dict[str, int] = {}
        """Tokens vLLM gave each request's client."""
        self.invalid_blocks: list[int] = []
        """Every engine block a step reported as not loaded (``invalid_block_ids``)."""

    # -- the ranks ------------------------------------------------------------------------

    def _bcast(self, obj: Any) -> Any:
        if self.tp == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _gather(self, obj: Any) -> list[Any]:
        if self.tp == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.tp if self.rank == 0 else []
        dist.gather_object(obj, out if self.rank == 0 else None, dst=0)
        return out

    def _barrier(self) -> None:
        if self.tp > 1:
            import torch.distributed as dist

            dist.barrier()

    def follow(self) -> None:
        """Ranks other than 0: do what rank 0's plans say until it says stop."""
        while True:
            plan = self._bcast(None)
            if plan == "stop":
                return
            if plan == "zero":
                self.zero()
                continue
            mro = self._work(plan)
            if plan["done"] is None:
                self._gather(mro)

    def stop_followers(self) -> None:
        self._bcast("stop")

    # -- requests and steps ---------------------------------------------------------------

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 1,
            cache_salt: str | None = None) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(req_id, list(tokens), sp, None, block_hasher=self.hasher,
                      cache_salt=cache_salt)
        self.tokens[req_id] = list(tokens)
        self.scheduler.add_request(req)

    def offload_keys(self, tokens: list[int]) -> list[bytes]:
        """vLLM's ``OffloadKey`` of each whole block of ``tokens`` (group 0; with lookahead
        hashes, of each block the tokens after it are known of)."""
        from vllm import SamplingParams
        from vllm.v1.kv_offload.base import make_offload_key
        from vllm.v1.request import Request

        req = Request("keys", list(tokens), SamplingParams(max_tokens=1), None,
                      block_hasher=self.hasher)
        return [bytes(make_offload_key(h, 0)) for h in req.block_hashes]

    def step(self) -> Any:
        """Rank 0: one engine step over every rank."""
        out = self.scheduler.schedule()
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        for r in out.scheduled_new_reqs:
            self.loaded_tokens.setdefault(r.req_id, r.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            starts[rid] = cached.num_computed_tokens[i]
        work = []
        for rid, n in out.num_scheduled_tokens.items():
            blocks = list(self.scheduler.kv_cache_manager.get_block_ids(rid)[0])
            last = starts[rid] + n >= self.scheduler.requests[rid].num_tokens
            work.append((rid, starts[rid], n, blocks, self.tokens[rid], last))
        plan = {"meta": out.kv_connector_metadata, "work": work,
                "finished": out.finished_req_ids, "done": None}
        mro = self._work(self._bcast(plan))
        final = self.aggregator.aggregate(self._gather(mro)) if self.tp > 1 else mro
        kvo = final.kv_connector_output
        if kvo is not None:
            self.invalid_blocks.extend(sorted(kvo.invalid_block_ids))
        for outs in self.scheduler.update_from_output(out, final).values():
            stats = outs.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.connector_payloads.append(stats.kv_connector_stats)
            for o in outs.outputs:
                self.emitted[o.request_id] = (self.emitted.get(o.request_id, 0)
                                              + len(o.new_token_ids))
                if o.finish_reason is not None:
                    self.finish_reasons[o.request_id] = str(o.finish_reason)
        done = [r for r in self.tokens if r not in self.scheduler.requests
                and r not in self.results]
        if done:  # finished: blocks freed, none reused before the next step: check them now
            self._bcast({"meta": None, "work": [], "finished": set(), "done": done})
            self._check_done(done)
        return out

    def _work(self, plan: dict[str, Any]) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        if plan["done"] is not None:
            self._check_done(plan["done"])
            return None
        w = self.worker
        meta = plan["meta"]
        w.bind_connector_metadata(meta)
        w.handle_preemptions(meta)
        w.start_load_kv(None)
        sampled: dict[str, list[int]] = {}
        for rid, start, n, blocks, tokens, last in plan["work"]:
            self.tokens[rid] = tokens
            self._blocks[rid] = blocks
            self._forward(rid, start, n)
            if last:  # the prompt (or the last token) is in: one token sampled
                sampled[rid] = [7]
        w.wait_for_save()
        # as vLLM's model runner does (kv_connector_model_runner_mixin)
        transfers = w.get_transfer_results(plan["finished"])
        invalid = w.get_block_ids_with_load_errors()
        wmeta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        ids = [item[0] for item in plan["work"]]
        # vLLM 0.33's output indexes its requests (req_id_to_index); 0.34's does not
        index = ({"req_id_to_index": {r: i for i, r in enumerate(ids)}}
                 if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__ else {})
        return ModelRunnerOutput(
            req_ids=ids, **index, sampled_token_ids=[sampled.get(r, []) for r in ids],
            kv_connector_output=KVConnectorOutput(
                finished_sending=transfers.finished_sending or None,
                finished_recving=transfers.finished_recving or None,
                failed_recving=transfers.failed_recving, invalid_block_ids=invalid,
                kv_connector_worker_meta=wmeta))

    def _check_done(self, done: list[str]) -> None:
        for rid in done:
            self.results[rid] = self.check_finished(rid)

    def _salt(self, layer: int) -> int:
        return layer if self.mla else layer + 1000 * self.rank  # MLA: the same on every rank

    def _forward(self, rid: str, start: int, n: int) -> None:
        blocks = self._blocks[rid]
        toks = self.tokens[rid] + [7] * 4096
        for pos in range(start, start + n):
            b, off = blocks[pos // self.block_size], pos % self.block_size
            for li, name in enumerate(self.layers):
                self._rows(name, b, off).copy_(
                    expected_rows(toks[:pos + 1], self._salt(li), self.row_shape))

    def _rows(self, layer: str, block: int, off: int) -> torch.Tensor:
        t = self.kv[layer]
        return t[block, off] if self.mla else t[block, :, off]

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
        if rid not in self._blocks:  # never scheduled (failed while its load was waited for)
            return {"bad": [], "n_bad": 0, "ran": False}
        blocks = self._blocks[rid]
        toks = self.tokens[rid]
        bad = []
        for pos in range(len(toks) - 1):
            b, off = blocks[pos // self.block_size], pos % self.block_size
            for li, name in enumerate(self.layers):
                want = expected_rows(toks[:pos + 1], self._salt(li), self.row_shape)
                if not torch.equal(self._rows(name, b, off), want):
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
        """Every rank's KV zeroed (rank 0 tells the others)."""
        if self.rank == 0 and self.tp > 1:
            self._bcast("zero")
        for t in self.kv.values():
            t.zero_()

    def close(self) -> None:
        if self.rank == 0 and self.tp > 1:
            self.stop_followers()
        self.worker.shutdown()
        if self.scheduler is not None and self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()


def hash_lookahead(config: Any, tokens: int) -> None:
    """vLLM 0.34's lookahead block hashes, on vLLM's own path but for the drafter.

    vLLM resolves ``num_hash_lookahead_tokens`` once, in ``VllmConfig.__post_init__``
    (``_resolve_num_hash_lookahead_tokens``): with a speculative config that drops EAGLE's
    trailing block (EAGLE, EAGLE-3, MTP) and prefix caching, and a KV connector whose
    ``supports_lookahead_block_hashes`` says True (vLLM's ``OffloadingConnector``, hence
    ``HicachedOffloadingConnector``), it is the drafter's prefill lookahead,
    ``num_prefill_lookahead_tokens``: 1 for EAGLE's drafters, ``num_speculative_tokens`` for a
    multi-module MTP chain. A speculative config needs a draft model, which a CPU test has
    not: the value is set here as vLLM would have resolved it, after the connector's own
    answer is asked. Everything that hashes or offloads reads it from this config, as in an
    engine with a drafter: the request block hasher (built with it, as ``EngineCore``
    builds it), the ``Scheduler`` and its ``KVCacheManager`` and block pool (GPU events with
    ``lookahead_token_ids``), the offloading connector's scheduler (which offloads only
    hashed blocks) and its events tracker, and ``HicachedOffloadingConnector``, which hands
    it to the manager. Only the drafter's own forward, which no offloading path sees, does
    not run."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    kv = config.kv_transfer_config
    assert config.cache_config.enable_prefix_caching
    assert KVConnectorFactory.get_connector_class(kv).supports_lookahead_block_hashes(kv)
    config.num_hash_lookahead_tokens = tokens


def _has_jobs(conn: Any) -> bool:
    return bool(conn.connector_scheduler._jobs)


def expected_rows(prefix: list[int], salt: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The rows of the last token of ``prefix`` (``salt``: layer and rank) of ``shape``."""
    h = 1469598103
    for t in prefix:
        h = (h * 1099511 + t + 1) % 2147483629
    n = 1
    for d in shape:
        n *= d
    base = torch.arange(n, dtype=torch.int64) + (h % 100003) * 64 + salt * 7919
    return (base % 65521).to(torch.float32).view(shape)


def run_scenario(name: str, args: dict[str, Any]) -> NoReturn:
    """This engine process runs ``tests.scenarios_vllm.<name>(**args)``, prints ``RESULT``
    and its JSON, and exits (1 with the traceback on stderr where it raised)."""
    import faulthandler
    import traceback

    from tests import scenarios_vllm

    # a scenario stuck (a rank waiting on a peer that failed, a thread that never ends) shows
    # every thread's stack and ends before the test's own timeout, instead of hanging it
    faulthandler.dump_traceback_later(float(os.environ.get("HICACHED_ENGINE_TIMEOUT_S", "200")),
                                      exit=True)
    try:
        result = getattr(scenarios_vllm, name)(**args)
    except BaseException:  # the client's threads must not keep a failed engine alive
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    run_scenario(sys.argv[1], json.loads(sys.argv[2]))
