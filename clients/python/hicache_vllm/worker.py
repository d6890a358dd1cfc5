"""``HicachedOffloadingWorker``: vLLM's worker-side transfers, moved by the hicached daemon.

vLLM's ``OffloadingConnector`` hands each worker (one per rank) its KV cache as canonical
tensors (per layer, ``(num_blocks, page_bytes)`` bytes) and then jobs: ``submit_store`` (engine
blocks -> pages, by key) and ``submit_load`` (pages -> engine blocks), each answered later by
``get_finished``; ``wait`` blocks until given jobs are done (preemption flushes, loads the
step needs now). Submitting never waits: jobs queue for two threads, one for stores and one
for loads (expedited loads first).

Where the bytes go:

- GPU (CUDA IPC): the daemon copies straight between its pool and the engine's blocks, on its
  own stream; a store first waits for what the engine's stream enqueued before it was
  submitted (the session's ready event, recorded at ``submit_store``), a load's call returns
  once its copies are done. One engine block per page (``blocks_per_chunk`` 1).
- CPU: the engine's KV is private memory the daemon cannot map, so the worker keeps a staging
  area of sealed memfds (``staging_blocks`` pages for stores, as many for loads): a store
  gathers the blocks into it and the daemon copies them into its pool; a load is the reverse.

Failure semantics: vLLM 0.33 cannot be told that a job failed (its connector asserts
success), so every job is reported done. A store that fails (daemon down, no space) is
dropped and counted: a later lookup misses. A load only follows a lookup the daemon holds, so
it fails only if the daemon dies or the keys are removed by someone during it: it is retried
(the link reconnecting, the restarted daemon re-attaching its pool) for ``load_retry_s``; past
that it is counted (``load_failures``) and logged as an error: those blocks hold what they held
before, and the request's output is not to be trusted.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from hicache.errors import HiCacheError, SpecInvalid, Unavailable
from hicache.specs import PoolSpec, Role
from hicache_client.link import DaemonLink, Handover
from hicache_vllm.blocks import HicachedLoadStoreSpec, Job, JobRound
from hicache_vllm.config import SpecConfig
from hicache_vllm.namespace import Plan

log = logging.getLogger("hicache_vllm")

_STATS = ("stores", "store_pages", "stores_dropped", "store_no_space", "loads", "load_pages",
          "load_retries", "load_failures", "waits")


def canonical_layers(kv_caches: CanonicalKVCaches, plan: Plan) -> list[torch.Tensor]:
    """Each layer's ``(num_blocks, layer_block_bytes)`` int8 view, checked against ``plan``."""
    if len(kv_caches.group_data_refs) != 1:
        raise SpecInvalid("hicached serves one KV cache group",
                          metadata={"groups": len(kv_caches.group_data_refs)})
    refs = kv_caches.group_data_refs[0]
    idx = [r.tensor_idx for r in refs]
    if len(refs) != plan.layers or len(set(idx)) != len(idx):
        raise SpecInvalid(f"{len(refs)} layer buffers ({len(set(idx))} distinct) for "
                          f"{plan.layers} layers: layers sharing a buffer are not served",
                          metadata={"layers": plan.layers, "buffers": len(set(idx))})
    out = []
    for r in refs:
        t = kv_caches.tensors[r.tensor_idx].tensor
        if r.page_size_bytes != plan.layer_block_bytes or t.dim() != 2 or t.stride(1) != 1:
            raise SpecInvalid(f"layer page of {r.page_size_bytes} bytes (tensor {tuple(t.shape)}"
                              f") is not the {plan.layer_block_bytes} bytes the plan says",
                              metadata={"page_bytes": r.page_size_bytes})
        out.append(t[:, :plan.layer_block_bytes].view(torch.int8))
    return out


class HicachedOffloadingWorker(OffloadingWorker):
    def __init__(self, config: SpecConfig, plan: Plan, rank: int,
                 kv_caches: CanonicalKVCaches) -> None:
        self.config = config
        self.plan = plan
        self.rank = rank
        self.layers = canonical_layers(kv_caches, plan)
        num_blocks = int(self.layers[0].shape[0])
        self.on_cuda = self.layers[0].device.type == "cuda"
        size = config.pool_size_tokens or (0 if config.pool_size_bytes else
                                           num_blocks * plan.block_tokens)
        self.pool: PoolSpec = plan.pool_spec(rank, size, config.pool_size_bytes)
        self.stats: dict[str, int] = dict.fromkeys(_STATS, 0)
        self._ready: Any = None
        self._staging: Any = None
        self._slots = config.staging_blocks
        if self.on_cuda:
            handover = self._cuda_handover()
        else:
            from hicache_client.shm import ShmDeviceBuffers

            self._staging = ShmDeviceBuffers.create(
                self.pool, 2 * self._slots * plan.page_tokens, config.shm_dir,
                prefix="hicache-vllm-staging", sealed=config.target.startswith("unix:"))
            rows = 2 * self._slots * plan.blocks_per_chunk
            self._stage = [t.view(-1)[:rows * plan.layer_block_bytes].view(torch.int8)
                           .view(rows, plan.layer_block_bytes)
                           for t in self._staging.layers("kv", Role.KV)]
            handover = Handover(self._staging.descriptors, fds=self._staging.fds)
        worker_id = config.worker_id or f"vllm-{socket.gethostname()}-{os.getpid()}-rank{rank}"
        self.link = DaemonLink(config, self.pool, handover, worker_id)
        self._cv = threading.Condition()
        self._stores: collections.deque[tuple[int, Job]] = collections.deque()
        self._loads: collections.deque[tuple[int, Job]] = collections.deque()
        self._finished: list[TransferResult] = []
        self._open: set[int] = set()
        self._closed = False
        self._threads = [threading.Thread(target=self._run, args=(q, store), daemon=True,
                                          name=f"hicache-vllm-{'store' if store else 'load'}")
                         for q, store in ((self._stores, True), (self._loads, False))]
        for t in self._threads:
            t.start()
        self.link.start()
        log.info("hicached offloading worker: rank %d, pool %s, %s", rank, self.pool.name,
                 "cuda_ipc" if self.on_cuda else f"staging {self._slots} pages each way")

    def _cuda_handover(self) -> Handover:
        from hicache_client.cuda import CudaDeviceBuffers, ReadyEvent

        if self.plan.blocks_per_chunk != 1:
            raise SpecInvalid("on GPUs an offloaded block is one engine block "
                              "(blocks_per_chunk 1)",
                              metadata={"blocks_per_chunk": self.plan.blocks_per_chunk})
        views = []
        for t in self.layers:
            if t.stride(0) != self.plan.layer_block_bytes:
                raise SpecInvalid("padded or packed KV pages cannot be shared with the daemon",
                                  metadata={"stride": t.stride(0)})
            views.append(t.view(torch.uint8).reshape(-1, 1, self.plan.row_bytes))
        self._ready = ReadyEvent(self.layers[0].device)
        buffers = CudaDeviceBuffers.from_tensors({"kv": {Role.KV: views}})
        return Handover(buffers.descriptors, ready_event=self._ready.handle)

    # -- vLLM's OffloadingWorker ------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
                     ) -> bool:
        assert isinstance(dst_spec, HicachedLoadStoreSpec)
        job = Job.of(dst_spec.keys, src_spec, self.plan.blocks_per_chunk)
        if self._ready is not None:
            self._ready.record()  # the daemon's copy waits for what the engine enqueued
        return self._submit(self._stores, job_id, job, False)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        assert isinstance(src_spec, HicachedLoadStoreSpec)
        job = Job.of(src_spec.keys, dst_spec, self.plan.blocks_per_chunk)
        return self._submit(self._loads, job_id, job, expedited)

    def _submit(self, q: collections.deque[tuple[int, Job]], job_id: int, job: Job,
                first: bool) -> bool:
        with self._cv:
            self._open.add(job_id)
            if first:
                q.appendleft((job_id, job))
            else:
                q.append((job_id, job))
            self._cv.notify_all()
        return True

    def get_finished(self) -> list[TransferResult]:
        with self._cv:
            out, self._finished = self._finished, []
            busy = bool(self._open)
        if busy:
            # the engine's thread calls this every step and may step without pause (requests
            # only waiting for loads): a yield lets the transfer threads take the interpreter
            # lock now, where they would wait up to its switch interval (5 ms) each time
            time.sleep(0)
        return out

    def wait(self, job_ids: set[int]) -> None:
        self.stats["waits"] += 1
        with self._cv:
            self._cv.wait_for(lambda: self._closed or not (job_ids & self._open))

    def shutdown(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=self.config.rpc_timeout_s + 1)
        self.link.close()
        if self._staging is not None:
            self._staging.close()
        log.info("hicached offloading worker stats (rank %d): %s", self.rank, self.stats)

    # -- the transfer threads ---------------------------------------------------------------

    def _run(self, q: collections.deque[tuple[int, Job]], store: bool) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or bool(q))
                if not q:
                    return
                job_id, job = q.popleft()
            start = time.monotonic()
            moved = 0
            try:
                moved = self._store(job) if store else self._load(job)
            except Exception:  # never into vLLM's worker: counted, logged
                self.stats["load_failures" if not store else "stores_dropped"] += 1
                log.exception("hicached %s job %d failed", "store" if store else "load",
                              job_id)
            with self._cv:
                self._open.discard(job_id)
                self._finished.append(TransferResult(job_id, True, moved,
                                                     time.monotonic() - start))
                self._cv.notify_all()

    def _tokens(self, first_page: int, pages: int) -> np.ndarray:
        pt = self.plan.page_tokens
        return np.arange(first_page * pt, (first_page + pages) * pt, dtype=np.int64)

    def _device_tokens(self, r: JobRound) -> np.ndarray:
        """GPU: the engine blocks' own token rows (one block per page)."""
        bt = self.plan.block_tokens
        return (r.block_ids[:, None] * bt + np.arange(bt, dtype=np.int64)).ravel()

    def _store(self, job: Job) -> int:
        session = self.link.session
        if session is None or not self.link.usable or not job.whole:
            self.stats["stores_dropped"] += 1
            return 0
        moved = 0
        page_bytes = self.pool.page_bytes
        for r in job.rounds(len(job.keys) if self.on_cuda else self._slots):
            if self.on_cuda:
                tokens = self._device_tokens(r)
            else:
                ids = torch.from_numpy(r.block_ids)
                n = len(r.block_ids)
                for canon, stage in zip(self.layers, self._stage, strict=True):
                    torch.index_select(canon, 0, ids, out=stage[:n])
                tokens = self._tokens(0, len(r.keys))
            try:
                res = session.store(r.keys, tokens)
            except HiCacheError as exc:
                self.stats["stores_dropped"] += 1
                self.link.report(exc)
                log.debug("store of %d pages dropped: %s", len(r.keys), exc)
                return moved
            self.stats["stores"] += 1
            self.stats["store_pages"] += res.stored
            self.stats["store_no_space"] += res.no_space
            moved += res.stored * page_bytes
        return moved

    def _load(self, job: Job) -> int:
        moved = 0
        for r in job.rounds(len(job.keys) if self.on_cuda else self._slots):
            self._load_round(r)
            moved += len(r.block_ids) * self.plan.layer_block_bytes * self.plan.layers
        self.stats["loads"] += 1
        self.stats["load_pages"] += len(job.keys)
        return moved

    def _load_round(self, r: JobRound) -> None:
        tokens = (self._device_tokens(r) if self.on_cuda
                  else self._tokens(self._slots, len(r.keys)))
        give_up = time.monotonic() + self.config.load_retry_s
        while True:
            session = self.link.session
            try:
                if session is None or not self.link.usable:
                    raise Unavailable("hicached is not connected")
                session.load_keys(r.keys, tokens, timeout=self.config.rpc_timeout_s)
                break
            except HiCacheError as exc:
                if session is not None:
                    self.link.report(exc)
                if time.monotonic() >= give_up or self._closed:
                    self.stats["load_failures"] += 1
                    log.error("hicached load of %d pages failed for %.0fs (%s: %s): vLLM "
                              "cannot be told; those blocks keep what they held",
                              len(r.keys), self.config.load_retry_s, type(exc).__name__, exc)
                    return
                self.stats["load_retries"] += 1
                time.sleep(min(self.config.reconnect_interval_s / 4, 0.25))
        if self.on_cuda:
            return
        base = self._slots * self.plan.blocks_per_chunk
        lo = base + int(r.rows[0])
        ids = torch.from_numpy(r.block_ids)
        for canon, stage in zip(self.layers, self._stage, strict=True):
            canon.index_copy_(0, ids, stage[lo:lo + len(r.block_ids)])
