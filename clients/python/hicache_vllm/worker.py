"""``HicachedOffloadingWorker``: vLLM's worker-side transfers, moved by the hicached daemon.

vLLM's ``OffloadingConnector`` hands each worker (one per rank) its KV cache as canonical
tensors (per layer, ``(num_blocks, page_bytes)`` bytes) and then jobs: ``submit_store`` (engine
blocks -> pages, by key) and ``submit_load`` (pages -> engine blocks), each answered later by
``get_finished``; ``wait`` blocks until given jobs are done (preemption flushes, loads the
step needs now). A job's engine blocks come as vLLM's release line hands them (block ids on
0.33, pointers on 0.34: ``hicache_vllm.vllm_api``). Submitting never waits: jobs queue for
two threads, one for stores and one for loads (expedited loads first).

Where the bytes go:

- GPU: the daemon copies straight between its pool and the engine's blocks, on its own
  stream; a store first waits for what the engine's stream enqueued before it was submitted
  (the session's ready event, recorded at ``submit_store``), a load's call returns once its
  copies are done. One engine block per page (``blocks_per_chunk`` 1). The KV cache reaches
  the daemon as CUDA IPC handles, or, where vLLM 0.34 allocated it as virtual memory (its
  extensible KV cache, exportable because ``HicachedOffloadingConnector`` declares
  ``EXPORTS_FD``), as file descriptors of its physical allocations passed over the Unix
  socket (``hicache_client.cuda``); the worker keeps them for re-opened sessions and closes
  them at ``shutdown``.
- CPU: the engine's KV is private memory the daemon cannot map, so the worker keeps a staging
  area of sealed memfds (``staging_blocks`` pages for stores, as many for loads): a store
  gathers the blocks into it and the daemon copies them into its pool; a load is the reverse.

Failure semantics: every job is reported done. A store that fails (daemon down, no space) is
dropped and counted: a later lookup misses; where vLLM takes failures (0.34) the job is
reported failed, so vLLM announces none of its blocks. A load only follows a lookup the
daemon holds, so it fails only if the daemon dies, hangs or restarts under it, or the keys are
removed: it is tried again (the link re-opening a session the daemon dropped, reconnecting to
a restarted daemon that re-attached its pool) until it is loaded, or given up: at once when
the daemon answers that the keys are not there (or refuses the call for good), else once its
window has passed since its first try. A load given up never passes for loaded (its blocks
hold what they held before):

- where vLLM takes a failed load (0.34, a load not waited for within the step) it is reported
  failed (``TransferResult.success = False``): vLLM recomputes the request or fails it (its
  ``kv_load_failure_policy``); the window is ``load_retry_s``;
- else with ``report_load_errors`` (``hicache_vllm.connector.HicachedOffloadingConnector``,
  which adds vLLM's block-level load-error path: every load on 0.33, the waited-for ones on
  0.34) its engine blocks are reported (``take_load_errors``, in the step whose
  ``get_finished`` reports the job): vLLM recomputes them or fails that request; the window
  is ``load_retry_s``;
- else (vLLM's own ``OffloadingConnector``, which cannot be told) the window is the longer of
  ``load_retry_s`` and the hold (``lookup_hold_ms``), and then ``get_finished`` raises
  ``LoadFailed``: the engine's step fails and vLLM stops, rather than decode on those blocks.

A load whose call timed out may still be copying on a paused daemon: the round (loaded on a
later try, or given up) is reported done, and its staging slots used again, only once no copy
of that session can land (the link's fence: ``DaemonLink.suspect`` / ``fenced``; counted in
``load_fence_waits`` when it had to wait), so neither vLLM's recompute of those blocks nor
the next round's bytes can be overwritten by it.

Primitives: ``HicachedOffloadingWorker``, ``LoadFailed``, ``canonical_layers``.
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
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from hicache.errors import Aborted, HiCacheError, Overloaded, SpecInvalid, Unavailable
from hicache.locks import condition
from hicache.specs import PoolSpec, Role
from hicache_client.link import DaemonLink, Handover, is_gone, is_late, is_link_failure
from hicache_client.pool_setup import BudgetShare
from hicache_vllm.blocks import HicachedLoadStoreSpec, Job, JobRound
from hicache_vllm.config import SpecConfig
from hicache_vllm.namespace import Plan
from hicache_vllm.vllm_api import Api

log = logging.getLogger("hicache_vllm")

_STATS = ("stores", "store_pages", "stores_dropped", "store_no_space", "loads", "load_pages",
          "load_retries", "load_failures", "load_error_blocks", "load_fence_waits", "waits")

RETRY_PAUSE_S = 0.25
"""The longest a failed load waits for its link before it tries again."""


class LoadFailed(RuntimeError):
    """A load was given up and vLLM's connector cannot be told (vLLM's own
    ``OffloadingConnector``): raised out of ``get_finished`` so that the engine stops instead
    of decoding on blocks that hold something else. ``HicachedOffloadingConnector`` reports
    such blocks to vLLM instead (recomputed, or the one request failed)."""


def _retryable(exc: HiCacheError) -> bool:
    """A load that failed this way may succeed if tried again: the link's trouble (late,
    down, a session or pool the daemon lost), or a refusal of the moment."""
    return is_late(exc) or is_link_failure(exc) or isinstance(exc, Overloaded | Aborted)


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
                 kv_caches: CanonicalKVCaches, api: Api,
                 report_load_errors: bool = False) -> None:
        self.config = config
        self.plan = plan
        self.rank = rank
        self.api = api
        """vLLM's release line: how jobs name their blocks, which failures it takes."""
        self.report_load_errors = report_load_errors
        """The connector reports the blocks of loads given up to vLLM (``take_load_errors``)
        where vLLM does not take a failed load itself; else such a load given up stops the
        engine (``LoadFailed``)."""
        self.kv_caches = kv_caches
        self.layers = canonical_layers(kv_caches, plan)
        num_blocks = int(self.layers[0].shape[0])
        self.on_cuda = self.layers[0].device.type == "cuda"
        derived = not (config.pool_size_tokens or config.pool_size_bytes)
        size = config.pool_size_tokens or (
            int(config.pool_size_ratio * num_blocks * plan.block_tokens) if derived else 0)
        self.pool: PoolSpec = plan.pool_spec(rank, size, config.pool_size_bytes)
        self.stats: dict[str, int] = dict.fromkeys(_STATS, 0)
        self._ready: Any = None
        self._staging: Any = None
        self._device: Any = None
        """GPU: the KV cache's descriptors (and the fds of virtual memory) handed over."""
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
        self.link = DaemonLink(config, self.pool, handover, worker_id,
                               budget_share=BudgetShare(len(plan.pool_names))
                               if derived else None)
        self._cv = condition("vllm.worker")
        self._stores: collections.deque[tuple[int, Job]] = collections.deque()
        self._loads: collections.deque[tuple[int, Job]] = collections.deque()
        self._finished: list[TransferResult] = []
        self._failed: dict[int, tuple[list[int], str]] = {}
        """Jobs given up, not yet reported: their engine blocks and why."""
        self._load_errors: set[int] = set()
        """Engine blocks of loads given up that ``get_finished`` has reported done."""
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
        self._device = CudaDeviceBuffers.from_tensors({"kv": {Role.KV: views}})
        return Handover(self._device.descriptors, fds=self._device.fds,
                        ready_event=self._ready.handle)

    # -- vLLM's OffloadingWorker ------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: LoadStoreSpec) -> bool:
        """``src_spec``: the engine's blocks as vLLM's line names them (0.33: a
        ``GPULoadStoreSpec``, 0.34: ``DevicePointers``)."""
        assert isinstance(dst_spec, HicachedLoadStoreSpec)
        job = Job.of(dst_spec.keys, self.api.device_blocks(src_spec, self.kv_caches),
                     self.plan.blocks_per_chunk, getattr(dst_spec, "chain", None))
        if self._ready is not None:
            self._ready.record()  # the daemon's copy waits for what the engine enqueued
        return self._submit(self._stores, job_id, job, False)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: Any,
                    expedited: bool = False) -> bool:
        """``dst_spec``: the engine's blocks (as for ``submit_store``); ``expedited``: vLLM
        waits for it within this step."""
        assert isinstance(src_spec, HicachedLoadStoreSpec)
        job = Job.of(src_spec.keys, self.api.device_blocks(dst_spec, self.kv_caches),
                     self.plan.blocks_per_chunk, sync=expedited)
        return self._submit(self._loads, job_id, job, expedited)

    def retry_window_s(self, job: Job) -> float:
        """How long after its first try a failed load is given up (the keys gone: at once):
        ``load_retry_s`` where vLLM is told of it, else at least the hold."""
        if self.report_load_errors or self.api.takes_failure(store=False, sync=job.sync):
            return self.config.load_retry_s
        return max(self.config.load_retry_s, self.config.lookup_hold_ms / 1000)

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
            failed = [self._failed.pop(r.job_id) for r in out if r.job_id in self._failed]
        if failed:
            blocks = sorted({b for ids, _ in failed for b in ids})
            if not self.report_load_errors:
                raise LoadFailed(
                    f"hicached: {len(failed)} load(s) of {len(blocks)} engine block(s) given "
                    f"up ({failed[0][1]}); vLLM's OffloadingConnector cannot be told, and the "
                    "blocks hold other KV: stopping rather than decoding on them (use "
                    "hicache_vllm.connector.HicachedOffloadingConnector: vLLM recomputes)")
            with self._cv:
                self._load_errors.update(blocks)
        if busy:
            # the engine's thread calls this every step and may step without pause (requests
            # only waiting for loads): a yield lets the transfer threads take the interpreter
            # lock now, where they would wait up to its switch interval (5 ms) each time
            time.sleep(0)
        return out

    def take_load_errors(self) -> set[int]:
        """Engine blocks of loads given up, reported done by ``get_finished`` (this call or
        an earlier one) and not yet taken: vLLM's ``get_block_ids_with_load_errors``."""
        with self._cv:
            out, self._load_errors = self._load_errors, set()
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
        if self._device is not None:
            self._device.close()
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
            stored = True
            failed: tuple[list[int], str] | None = None
            try:
                if store:
                    moved, stored = self._store(job)
                else:
                    moved, failed = self._load(job)
            except Exception as exc:  # never into vLLM's worker: counted, logged
                self.stats["load_failures" if not store else "stores_dropped"] += 1
                log.exception("hicached %s job %d failed", "store" if store else "load",
                              job_id)
                stored = False
                if not store:  # nothing of it is known to be loaded
                    failed = ([int(b) for b in job.block_ids], f"{type(exc).__name__}: {exc}")
            # a failure goes to vLLM where its line takes it; else a load's blocks are told
            # through the load-error path (or stop the engine: get_finished)
            success = True
            if (not stored or failed is not None) and self.api.takes_failure(store, job.sync):
                success, failed = False, None
            with self._cv:
                if failed is not None:
                    self._failed[job_id] = failed
                self._open.discard(job_id)
                self._finished.append(TransferResult(job_id, success, moved,
                                                     time.monotonic() - start))
                self._cv.notify_all()

    def _tokens(self, first_page: int, pages: int) -> np.ndarray:
        pt = self.plan.page_tokens
        return np.arange(first_page * pt, (first_page + pages) * pt, dtype=np.int64)

    def _device_tokens(self, r: JobRound) -> np.ndarray:
        """GPU: the engine blocks' own token rows (one block per page)."""
        bt = self.plan.block_tokens
        return (r.block_ids[:, None] * bt + np.arange(bt, dtype=np.int64)).ravel()

    def _store(self, job: Job) -> tuple[int, bool]:
        """Bytes moved, and whether every round was stored (else it was dropped)."""
        if not job.whole or not self._link_for_store():
            self.stats["stores_dropped"] += 1
            return 0, False
        moved = 0
        page_bytes = self.pool.page_bytes
        per = len(job.keys) if self.on_cuda else self._slots
        for at, r in enumerate(job.rounds(per)):
            chain = (job.chain.of_round(job.keys, at * per, at * per + len(r.keys))
                     if job.chain is not None else None)
            if self.on_cuda:
                tokens = self._device_tokens(r)
            else:
                ids = torch.from_numpy(r.block_ids)
                n = len(r.block_ids)
                for canon, stage in zip(self.layers, self._stage, strict=True):
                    torch.index_select(canon, 0, ids, out=stage[:n])
                tokens = self._tokens(0, len(r.keys))
            for attempt in (0, 1):
                session = self.link.session if self._link_for_store() else None
                if session is None:
                    self.stats["stores_dropped"] += 1
                    return moved, False
                try:
                    res = session.store(r.keys, tokens,
                                        token_ids=chain.token_ids if chain else None,
                                        parent_key=chain.parent_key if chain else b"",
                                        lora_name=chain.lora_name if chain else "",
                                        cache_salt=chain.cache_salt if chain else "",
                                        lookahead_token_ids=chain.lookahead if chain
                                        else None)
                    break
                except HiCacheError as exc:
                    self.link.report(exc, session=session)
                    if attempt or not is_gone(exc):  # (gone: stored again in a new session)
                        self.stats["stores_dropped"] += 1
                        log.debug("store of %d pages dropped: %s", len(r.keys), exc)
                        return moved, False
            self.stats["stores"] += 1
            self.stats["store_pages"] += res.stored
            self.stats["store_no_space"] += res.no_space
            moved += res.stored * page_bytes
        return moved, True

    def _link_for_store(self) -> bool:
        """The link is usable, or becomes so: a session the daemon dropped is being
        re-opened (waited for, up to ``rpc_timeout_s``, once per re-open)."""
        return self.link.usable or self.link.wait_usable(self.config.rpc_timeout_s,
                                                         reopening_only=True)

    def _load(self, job: Job) -> tuple[int, tuple[list[int], str] | None]:
        """Bytes moved, and the engine blocks not loaded (with why) if the load was given
        up: the round that failed and every one after it (vLLM recomputes from the first
        block that failed anyway)."""
        moved = 0
        window = self.retry_window_s(job)
        rounds = list(job.rounds(len(job.keys) if self.on_cuda else self._slots))
        for i, r in enumerate(rounds):
            why = self._load_round(r, window)
            if why is not None:
                blocks = [int(b) for later in rounds[i:] for b in later.block_ids]
                self.stats["load_failures"] += 1
                self.stats["load_error_blocks"] += len(blocks)
                told = self.report_load_errors or self.api.takes_failure(False, job.sync)
                log.error("hicached load of %d pages given up (%s): %s", len(job.keys), why,
                          "vLLM is told (it recomputes or fails the request)" if told
                          else "vLLM cannot be told; the engine is stopped")
                return moved, (blocks, why)
            moved += len(r.block_ids) * self.plan.layer_block_bytes * self.plan.layers
        self.stats["loads"] += 1
        self.stats["load_pages"] += len(job.keys)
        return moved, None

    def _load_round(self, r: JobRound, window: float) -> str | None:
        """Load one round, trying again while it may still succeed; None when loaded, else
        why it was given up."""
        tokens = (self._device_tokens(r) if self.on_cuda
                  else self._tokens(self._slots, len(r.keys)))
        suspects: set[str] = set()
        """Sessions an attempt timed out on: a copy of theirs may still land in these blocks
        (or staging slots), so neither goes back to use before their fence."""
        try:
            why = self._attempts(r, tokens, suspects, window)
        finally:
            self._await_fences(suspects)
        if why is not None or self.on_cuda:
            return why
        base = self._slots * self.plan.blocks_per_chunk
        lo = base + int(r.rows[0])
        ids = torch.from_numpy(r.block_ids)
        for canon, stage in zip(self.layers, self._stage, strict=True):
            canon.index_copy_(0, ids, stage[lo:lo + len(r.block_ids)])
        return None

    def _attempts(self, r: JobRound, tokens: np.ndarray, suspects: set[str],
                  window: float) -> str | None:
        """Try the round until it loads (None) or is given up (why)."""
        give_up = time.monotonic() + window
        while True:
            session = self.link.session
            exc: HiCacheError
            if session is None or not self.link.usable:  # (the link knows: not reported)
                exc = Unavailable("hicached is not connected")
            else:
                try:
                    session.load_keys(r.keys, tokens, timeout=self.config.rpc_timeout_s)
                    return None
                except HiCacheError as failed:
                    if is_late(failed) and failed.reason not in ("DEADLINE_PASSED",
                                                                 "SESSION_ENDING"):
                        suspects.add(session.session_id)
                        self.link.suspect(session.session_id)
                    self.link.report(failed, session=session)
                    exc = failed
            if not _retryable(exc):  # the keys are not there, or never will load
                return f"{type(exc).__name__}: {exc}"
            left = give_up - time.monotonic()
            if left <= 0 or self._closed:
                return (f"not loaded within {window:.1f}s; last "
                        f"{type(exc).__name__}: {exc}")
            self.stats["load_retries"] += 1
            if self.link.usable:  # a refusal of the moment: a pause before the next try
                time.sleep(min(0.01, left))
            else:  # the link comes back (probed, re-opened, reconnected): try then
                self.link.wait_usable(min(left, RETRY_PAUSE_S))

    def _await_fences(self, suspects: set[str]) -> None:
        """Until no copy of ``suspects`` can land (``DaemonLink.fenced``), however long the
        daemon takes to say so: blocks reported done, or staging used again, before that
        could receive a late copy's bytes. Only the worker's closing cuts it short."""
        for sid in suspects:
            waited = False
            while not self.link.fenced(sid, 0.5):
                if self._closed:
                    return
                if not waited:
                    waited = True
                    self.stats["load_fence_waits"] += 1
                    log.warning("hicached load on session %s timed out: its blocks wait until "
                                "no copy of that session can land", sid[:8])
