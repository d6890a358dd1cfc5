"""``HicachedLinker``: SGLang's unified-cache external linker, backed by the hicached sidecar.

SGLang loads it by dotted path (``--unified-cache-external-linker-backend dynamic``,
``{"linker": "HicachedLinker", "linker_module_path": "hicache_sglang.linker",
"linker_extra_config": {...}}``; the extra config is ``hicache_sglang.config.LinkerConfig``) and
drives it from ``UnifiedCacheLinkerWrapper``: match -> ``lookup``, load-back -> ``load`` +
``start_layer_wise_loading`` + the forward's layer waits + ``finish_layer_wise_loading``,
write-through -> ``offload`` + ``num_completed_offloads`` / ``pop_completed_offload``.

What each call becomes:

- ``lookup``: one ``Lookup`` with a short deadline that holds the hit for this worker's
  session (``lookup_hold_ms``): the hit is a promise, its pages cannot be evicted before the
  load. Every prefix of the promised hit is restorable. A request SGLang cannot admit yet is
  matched on every scheduler loop: while its answer is fresh it is told it again
  (``lookups_reused``, ``hicache_sglang.answers``): a ``Lookup`` per hold, not per loop.
- ``load`` queues what its lookup promised (a request whose promise is gone, or older than
  the hold, is declined: SGLang recomputes it); ``cancel_queued_load`` releases its holds
  (off the scheduler's thread). ``start_layer_wise_loading`` starts one ``LoadKeys`` for the
  whole batch on the load thread; it consumes the holds. On GPUs the daemon records one
  interprocess event per layer group and the forward's ``wait_until(layer)`` makes the current
  stream wait on that layer's event; on CPU the call returns when the bytes are in place.
- ``offload``: a ``Store`` that never waits for the GPU on the scheduler's thread
  (``hicache_sglang.offloads``); results are handed back in submission order, as SGLang
  commits them. Each carries the tree node's tokens and the key of the page before
  (``hicache_sglang.origins``: SGLang does not pass them), so routers following the daemon's
  KV events match requests to these pages.
- ``reset`` (SGLang's ``/flush_cache``): quiesce, forget every answer and let go of every hold
  of this worker's session. The pool's pages stay: other instances share them and may be
  hitting them; emptying a shared pool is an operator's act (``hicachectl clear-pool``).
  ``close``: quiesce, end the session (the keys stay cached).

Failure semantics: nothing raises into the scheduler, and nothing on its thread waits past a
deadline: ``lookup`` at most ``lookup_timeout_s``, a load in flight at most ``rpc_timeout_s``.
With the daemon down, restarting, refusing, paused or slow, ``lookup`` reports no hit, ``load``
declines (SGLang recomputes), ``offload`` is dropped and counted, and the link recovers by
itself (``hicache_client.link``: a daemon that was only late keeps its session). SGLang 0.5.23
judges a batch's load as one (``finish_layer_wise_loading``: every request of the batch is
aborted when it is False), so the linker makes a batch's load unable to fail for one request:
every key it loads is held for it. A load that timed out may still be copying: its device
slots are withheld from SGLang's allocator until the daemon shows no copy of this session in
flight (``hicache_sglang.quarantine``). Counters are in ``stats`` and logged at ``close``.
"""

from __future__ import annotations

# isort: off
import hicache_sglang.served  # noqa: F401  (first: an SGLang hicached does not serve stops here)

# isort: on
import logging
import os
import queue
import socket
import threading
import time
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
    LayerWiseLoadCounter,
    UnifiedCacheLinker,
)

from hicache.errors import HiCacheError, SpecInvalid, Unavailable
from hicache_client import HiCacheClient, LookupResult, WorkerSession
from hicache_client.hold_book import HoldBook
from hicache_client.link import DaemonLink, Handover, Skipped, is_late
from hicache_client.pool_setup import BudgetShare
from hicache_sglang.answers import Answers
from hicache_sglang.config import LinkerConfig
from hicache_sglang.device_pool import DevicePool
from hicache_sglang.namespace import Shard, pool_name
from hicache_sglang.offloads import Offloads
from hicache_sglang.origins import NodeOrigins
from hicache_sglang.quarantine import SlotQuarantine

log = logging.getLogger("hicache_sglang")

_STATS = ("lookups", "lookups_reused", "lookup_hit_pages", "lookup_held_pages",
          "lookup_failures", "lookups_skipped", "resets", "reset_failures", "loads",
          "load_pages", "load_failures", "loads_declined", "loads_cancelled",
          "load_slots_withheld", "offloads", "offload_pages", "offloads_dropped",
          "offload_failures", "offload_no_space", "offloads_without_tokens")
def _kv(transfers: list[PoolTransfer]) -> PoolTransfer | None:
    return next((t for t in transfers if t.name == PoolName.KV), None)


def _shard(params: Any, replicated: bool) -> Shard:
    tp_rank, tp_size = 0, 1
    group = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group",
                                                                    None)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        tp_rank = torch.distributed.get_rank(group=group)
        tp_size = torch.distributed.get_world_size(group=group)
    return Shard(tp_rank=tp_rank, tp_size=tp_size, cp_rank=int(params.attn_cp_rank),
                 pp_rank=int(params.pp_rank), replicated=replicated)


def _model_path(server_args: Any) -> str:
    """The model as SGLang resolved it (what its own storage backends key pages on)."""
    try:
        from sglang.srt.runtime_context import get_model

        path = get_model().model_path
    except Exception:  # no published context (an embedding without the runtime)
        path = None
    return str(path or server_args.model_path)


class HicachedLinker(UnifiedCacheLinker):
    def __init__(self, server_args: Any, params: Any, *, components: Any,
                 extra_config: dict[str, Any] | None = None,
                 forward_stream: Any = None) -> None:
        unsupported = sorted(c.name for c in set(components) - {ComponentType.FULL})
        if unsupported:
            raise SpecInvalid("HicachedLinker serves full-attention KV only; unsupported "
                              f"components: {unsupported}",
                              metadata={"components": ",".join(unsupported)})
        self.config = cfg = LinkerConfig.from_extra(extra_config)
        self.forward_stream = forward_stream
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        self.device_pool = dp = DevicePool.from_kvcache(kvcache)
        if int(params.page_size) != dp.page_size:
            raise SpecInvalid(f"cache page_size {params.page_size} != pool page_size "
                              f"{dp.page_size}")
        self.page_size = dp.page_size
        self.pools = {PoolName.KV: kvcache}
        self.num_layers = dp.geometry.layer_num
        self.shard = _shard(params, replicated=dp.is_mla)
        name = pool_name(cfg.pool_prefix, _model_path(server_args), dp.geometry,
                         dp.page_size, self.shard,
                         revision=str(getattr(server_args, "revision", None) or ""),
                         namespace=cfg.namespace,
                         format_tag=getattr(kvcache, "storage_format_tag", None))
        self.spec = dp.pool_spec(name, cfg.pool_size_tokens, cfg.pool_size_bytes,
                                 cfg.pool_size_ratio)
        self.stats = dict.fromkeys(_STATS, 0)

        self.on_cuda = dp.device.type == "cuda"
        self._shm = None
        self._events: Any = None
        self._ready: Any = None
        self._cuda: Any = None
        if self.on_cuda:
            from hicache import layer_groups
            from hicache_client.cuda import LayerEvents, ReadyEvent

            groups = cfg.layer_events or min(self.num_layers, 64)
            groups = -(-self.num_layers // layer_groups.layer_group_size(self.num_layers,
                                                                          groups))
            self._events = LayerEvents(groups, dp.device)
            self._ready = ReadyEvent(dp.device)
            self._cuda = dp.cuda_buffers()  # VMM chunks' fds, kept for every re-open
            handover = Handover(self._cuda.descriptors, self._events.handles,
                                self._ready.handle, fds=self._cuda.fds)
        else:
            # on the Unix socket: sealed memfds by fd; over TCP (tests, odd setups): files
            self._shm = dp.rehome_to_shm(self.spec, cfg.shm_dir,
                                         sealed=cfg.target.startswith("unix:"))
            handover = Handover(self._shm.descriptors, fds=self._shm.fds)
        self.layer_done_counter = LayerWiseLoadCounter(
            self.num_layers, self._wait_layer_event if self.on_cuda else None)

        worker_id = cfg.worker_id or (f"sglang-{socket.gethostname()}-{os.getpid()}-"
                                      f"tp{self.shard.tp_rank}")
        self.quarantine = SlotQuarantine(params.token_to_kv_pool_allocator, self.page_size)
        share = (None if cfg.pool_size_tokens or cfg.pool_size_bytes  # a size it set: as is
                 else BudgetShare(1 if dp.is_mla else self.shard.tp_size))
        self.link = DaemonLink(cfg, self.spec, handover, worker_id,
                               on_fenced=self.quarantine.release, budget_share=share)
        self._pending: dict[str, tuple[list[str], torch.Tensor]] = {}
        self._holds = HoldBook(cfg.lookup_hold_ms, self._release,
                               f"hicache-holds-tp{self.shard.tp_rank}")
        """Which requests count on which held keys; releases, on its thread (the scheduler
        never waits for them)."""
        self._answers = Answers(self._holds)
        """Each request's last lookup's answer: what ``load`` may count on, and what the
        request's next match is told while it is fresh."""
        self._loads: queue.Queue[tuple[int, list[tuple[str, tuple[list[str], torch.Tensor]]]]
                                 | None] = queue.Queue()
        self.origins = NodeOrigins(self, self.page_size)
        """The tokens and parent of each node SGLang offloads (for routers' events)."""
        self.offloads = Offloads(cfg.max_inflight_offloads,
                                 (dp.device, self._ready, self.record_offload_ready)
                                 if self.on_cuda else None)
        self._load_thread = threading.Thread(target=self._load_loop, daemon=True,
                                             name=f"hicache-load-tp{self.shard.tp_rank}")
        self._load_thread.start()
        self.link.start()
        log.info("hicached linker: pool %s (%s %s, %d layers, page %d, %s), rank %d/%d %s",
                 name, dp.geometry.kind.value, dp.geometry.dtype.value, self.num_layers,
                 self.page_size, "cuda_ipc" if self.on_cuda else "shm", self.shard.tp_rank,
                 self.shard.tp_size, "writes" if self.shard.writer else "reads only")

    # -- lookup ----------------------------------------------------------------------------

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        self.quarantine.hand_back()  # (the scheduler's thread: fenced slots go back here)
        kv = _kv(transfers)
        if kv is None or not kv.keys:
            return []
        link = self.link
        deadline = time.monotonic() + self.config.lookup_timeout_s
        if link.gate(self.config.lookup_timeout_s) is None:
            self.stats["lookups_skipped"] += 1
            return []
        keys = tuple(kv.keys)[:link.max_keys or None]  # past the daemon's limit: a prefix
        known = self._answers.reuse(rid, keys, link.session)
        if known is not None:
            self.stats["lookups_reused"] += 1  # a request SGLang could not admit yet
            return list(range(1, known.hit + 1))
        self.stats["lookups"] += 1
        hold_ms = self.config.lookup_hold_ms
        asked_on: list[WorkerSession] = []

        def ask(client: HiCacheClient, session: WorkerSession, left: float) -> LookupResult:
            asked_on.append(session)
            return client.lookup(self.spec.name, keys, timeout=left,
                                 session_id=session.session_id if hold_ms else "",
                                 hold_ms=hold_ms)

        try:
            r = link.call(deadline, ask)
        except Skipped:
            self.stats["lookups_skipped"] += 1
            return []
        except (HiCacheError, TimeoutError) as exc:  # reported to the link by its call
            self.stats["lookup_failures"] += 1
            log.debug("lookup for %s failed: %s", rid, exc)
            return []
        hit = r.promised if hold_ms else r.hit_prefix
        if hold_ms:
            for old in self._answers.record(rid, keys, hit, asked_on[-1]):
                if old not in self._pending:  # its answer forgotten: so are its claims
                    self._holds.drop(old)
            if hit:
                self._holds.claim(rid, keys[:hit])
                self.stats["lookup_held_pages"] += r.held
        self.stats["lookup_hit_pages"] += hit
        return list(range(1, hit + 1))

    # -- load ------------------------------------------------------------------------------

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        self.quarantine.hand_back()
        kv = _kv(transfers)
        answer = self._answers.take(rid)
        if (kv is None or not kv.keys or kv.device_indices is None or rid in self._pending
                or len(kv.device_indices) != len(kv.keys) * self.page_size
                or not self.link.usable
                or (self.config.lookup_hold_ms
                    and not self._answers.covers(answer, kv.keys, self.link.session))):
            self.stats["loads_declined"] += 1
            if rid not in self._pending:
                self._holds.drop(rid)  # what no other request counts on is let go
            return False
        self._pending[rid] = (list(kv.keys), kv.device_indices)
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        item = self._pending.pop(rid, None)
        if item is None:
            return False
        self.stats["loads_cancelled"] += 1
        self._holds.drop(rid)
        return True

    def _release(self, keys: list[Any]) -> None:
        """End this worker's holds of ``keys`` (the hold book's thread calls it for keys no
        request claims any more)."""
        session = self.link.session
        if session is not None:
            session.release_holds(keys, timeout=self.config.rpc_timeout_s)

    def start_layer_wise_loading(self) -> int:
        if not self._pending:
            return -1
        batch, self._pending = list(self._pending.items()), {}
        index: int = self.layer_done_counter.update_producer()
        if self.on_cuda:
            self._ready.record()  # the slots are allocated and every earlier use is ordered
        self._loads.put((index, batch))
        return index

    def _load_loop(self) -> None:
        while True:
            item = self._loads.get()
            try:
                if item is None:
                    return
                index, batch = item
                self._load_batch(index, batch)
            finally:
                self._loads.task_done()

    def _load_batch(self, index: int,
                    batch: list[tuple[str, tuple[list[str], torch.Tensor]]]) -> None:
        """One LoadKeys for the batch's requests; their claims end with it (the holds it
        used are consumed; a failed load's are let go)."""
        keys = [k for _, (ks, _) in batch for k in ks]
        slots = torch.cat([d.to(torch.int64).cpu() for _, (_, d) in batch])
        loaded = False
        try:
            loaded = self._load(index, keys, slots, len(batch))
        finally:
            for rid, (ks, _) in batch:
                self._holds.drop(rid, consumed=set(ks) if loaded else ())

    def _load(self, index: int, keys: list[str], slots: torch.Tensor, requests: int) -> bool:
        self.stats["loads"] += 1
        session = self.link.session
        try:
            if session is None:
                raise Unavailable("hicached is not connected")
            session.load_keys(keys, slots, layer_events=self.on_cuda,
                              timeout=self.config.rpc_timeout_s)
        except BaseException as exc:
            self.stats["load_failures"] += 1
            if isinstance(exc, HiCacheError):
                if (session is not None and is_late(exc)
                        and exc.reason not in ("DEADLINE_PASSED", "SESSION_ENDING")):
                    # the daemon may still be copying into these slots: they go back to
                    # SGLang once no copy of the session can land (its fence), not when it
                    # frees them now
                    sid = session.session_id
                    self.link.suspect(sid, then=lambda: self.quarantine.withhold(slots, sid))
                    self.stats["load_slots_withheld"] += len(slots) // self.page_size
                self.link.report(exc, session=session)
            log.warning("hicached load of %d pages failed (%s: %s); SGLang aborts the "
                        "batch's %d loading request(s)", len(keys), type(exc).__name__, exc,
                        requests)
            self.layer_done_counter.fail(index, exc)
            return False
        self.stats["load_pages"] += len(keys)
        for layer in range(self.num_layers):
            self.layer_done_counter.complete(index, layer)
        return True

    def _wait_layer_event(self, index: int, layer: int) -> None:
        """GPU: the forward's current stream waits for the daemon's copy of ``layer``."""
        self._events.wait(self._events.group_of(layer, self.num_layers))

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        landed: bool = self.layer_done_counter.finish(counter_index)
        if landed and self.on_cuda:
            for event in self._events.events:  # the copies have stopped writing
                event.synchronize()
        return landed

    # -- offload ---------------------------------------------------------------------------

    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        kv = _kv(transfers)
        if kv is None or not kv.keys or kv.device_indices is None:
            return False
        if not self.shard.writer:  # replicated KV: rank 0 stores it for every rank
            return self.offloads.skip(len(kv.keys))
        session = self.link.session
        if session is None or not self.link.usable or self.offloads.full:
            self.stats["offloads_dropped"] += 1
            return False
        keys = list(kv.keys)
        origin = self.origins.of(keys)  # reads the caller's frame: call it from here only
        if origin is None:
            self.stats["offloads_without_tokens"] += 1
        try:
            self.offloads.submit(session, keys, kv.device_indices, origin)
        except (HiCacheError, ValueError) as exc:
            self.stats["offloads_dropped"] += 1
            self.link.report(exc)
            return False
        self.stats["offloads"] += 1
        return True

    def num_completed_offloads(self) -> int:
        self.quarantine.hand_back()
        return self.offloads.completed()

    def pop_completed_offload(self) -> bool:
        try:
            result = self.offloads.pop()
        except BaseException as exc:
            self.stats["offload_failures"] += 1
            if isinstance(exc, HiCacheError):
                self.link.report(exc)
            log.debug("offload failed: %s", exc)
            return False
        if result.no_space:
            self.stats["offload_no_space"] += result.no_space
            return False
        self.stats["offload_pages"] += result.stored
        return True

    # -- lifecycle -------------------------------------------------------------------------

    def _quiesce(self) -> None:
        """Let queued and running loads and offloads end (each bounded by its deadline)."""
        self._pending.clear()
        self._loads.join()
        self.offloads.drain(self.config.rpc_timeout_s)
        self.layer_done_counter.reset()

    def reset(self) -> None:
        """SGLang's ``/flush_cache``: this worker forgets what it was told and lets go of its
        holds; the pool's pages stay for every instance that shares them."""
        self._quiesce()
        self._answers.clear()
        self._holds.drop_all(lambda rid: False)  # released below, all at once
        self.stats["resets"] += 1
        session = self.link.session
        if session is None or not self.config.lookup_hold_ms or not self.link.usable:
            return  # holds of a gone session are gone; a late link's expire by themselves
        try:  # before any later lookup: a hold taken after the reset is not let go
            session.release_holds(timeout=self.config.lookup_timeout_s)
        except HiCacheError as exc:
            self.stats["reset_failures"] += 1
            self.link.report(exc)
            log.warning("letting go of hicached holds at reset failed (they expire by "
                        "themselves): %s", exc)

    def close(self) -> None:
        self._quiesce()
        self._loads.put(None)
        self._load_thread.join(timeout=10)
        self._holds.close(timeout=self.config.rpc_timeout_s)
        self.offloads.close()
        self.link.close()
        self.quarantine.close()
        if self._shm is not None:
            self._shm.close()  # unlinks the files; SGLang's tensors keep their mapping
        if self._cuda is not None:
            self._cuda.close()  # the exported VMM chunks' fds (none for CUDA IPC)
        log.info("hicached linker stats: %s", self.stats)
