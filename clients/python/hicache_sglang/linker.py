"""``HicachedLinker``: SGLang's unified-cache external linker, backed by the hicached sidecar.

SGLang loads it by dotted path (``--unified-cache-external-linker-backend dynamic``,
``{"linker": "HicachedLinker", "linker_module_path": "hicache_sglang.linker",
"linker_extra_config": {...}}``; the extra config is ``hicache_sglang.config.LinkerConfig``) and
drives it from ``UnifiedCacheLinkerWrapper``: match -> ``lookup``, load-back -> ``load`` +
``start_layer_wise_loading`` + the forward's layer waits + ``finish_layer_wise_loading``,
write-through -> ``offload`` + ``num_completed_offloads`` / ``pop_completed_offload``.

What each call becomes:

- ``lookup``: one ``Lookup`` with a short deadline; every prefix of the hit is restorable.
- ``load`` queues; ``start_layer_wise_loading`` starts one ``LoadKeys`` for the whole batch on
  the load thread. On GPUs the daemon records one interprocess event per layer group and the
  forward's ``wait_until(layer)`` makes the current stream wait on that layer's event; on CPU
  the call returns when the bytes are in place and every layer completes at once.
- ``offload``: records the ready event (GPU: after the forward stream's KV writes), then
  ``store_async``; results are handed back in submission order, as SGLang commits them.
- ``reset``: quiesce, then ``ClearPool`` (the writer rank); ``close``: quiesce and end the
  session; the keys stay cached for the next worker.

Failure semantics: nothing raises into the scheduler. With the daemon down, restarting or
refusing, ``lookup`` reports no hit, ``load`` declines (SGLang recomputes), ``offload`` is
dropped and counted, a load that fails aborts only the requests of its batch (SGLang's
``finish_loads``), and the link reconnects in the background (``hicache_sglang.link``).
Counters are in ``stats`` and logged at ``close``.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import socket
import threading
from concurrent.futures import Future
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
    LayerWiseLoadCounter,
    UnifiedCacheLinker,
)

from hicache.errors import HiCacheError, SpecInvalid, Unavailable
from hicache_client.results import StoreResult
from hicache_sglang.config import LinkerConfig
from hicache_sglang.device_pool import DevicePool
from hicache_sglang.link import DaemonLink, Handover
from hicache_sglang.namespace import Shard, pool_name

log = logging.getLogger("hicache_sglang")

_STATS = ("lookups", "lookup_hit_pages", "lookup_failures", "loads", "load_pages",
          "load_failures", "loads_declined", "offloads", "offload_pages", "offloads_dropped",
          "offload_failures", "offload_no_space")


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
        self.spec = dp.pool_spec(name, cfg.pool_size_tokens, cfg.pool_size_bytes)
        self.stats = dict.fromkeys(_STATS, 0)

        self.on_cuda = dp.device.type == "cuda"
        self._shm = None
        self._events: Any = None
        self._ready: Any = None
        if self.on_cuda:
            from hicache import layer_groups
            from hicache_client.cuda import LayerEvents, ReadyEvent

            groups = cfg.layer_events or min(self.num_layers, 64)
            groups = -(-self.num_layers // layer_groups.layer_group_size(self.num_layers,
                                                                          groups))
            self._events = LayerEvents(groups, dp.device)
            self._ready = ReadyEvent(dp.device)
            handover = Handover(dp.cuda_descriptors(), self._events.handles,
                                self._ready.handle)
        else:
            # on the Unix socket: sealed memfds by fd; over TCP (tests, odd setups): files
            self._shm = dp.rehome_to_shm(self.spec, cfg.shm_dir,
                                         sealed=cfg.target.startswith("unix:"))
            handover = Handover(self._shm.descriptors, fds=self._shm.fds)
        self.layer_done_counter = LayerWiseLoadCounter(
            self.num_layers, self._wait_layer_event if self.on_cuda else None)

        worker_id = cfg.worker_id or (f"sglang-{socket.gethostname()}-{os.getpid()}-"
                                      f"tp{self.shard.tp_rank}")
        self.link = DaemonLink(cfg, self.spec, handover, worker_id)
        self._pending: dict[str, tuple[list[str], torch.Tensor]] = {}
        self._offloads: collections.deque[Future[StoreResult]] = collections.deque()
        self._loads: queue.Queue[tuple[int, list[tuple[list[str], torch.Tensor]]] | None] = \
            queue.Queue()
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
        kv = _kv(transfers)
        client = self.link.client
        if kv is None or not kv.keys or client is None:
            return []
        self.stats["lookups"] += 1
        try:
            hit = client.lookup(self.spec.name, list(kv.keys),
                                timeout=self.config.lookup_timeout_s).hit_prefix
        except HiCacheError as exc:
            self.stats["lookup_failures"] += 1
            self.link.report(exc)
            log.debug("lookup for %s failed: %s", rid, exc)
            return []
        self.stats["lookup_hit_pages"] += hit
        return list(range(1, hit + 1))

    # -- load ------------------------------------------------------------------------------

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        kv = _kv(transfers)
        if (kv is None or not kv.keys or kv.device_indices is None or rid in self._pending
                or len(kv.device_indices) != len(kv.keys) * self.page_size
                or not self.link.up):
            self.stats["loads_declined"] += 1
            return False
        self._pending[rid] = (list(kv.keys), kv.device_indices)
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        return self._pending.pop(rid, None) is not None

    def start_layer_wise_loading(self) -> int:
        if not self._pending:
            return -1
        batch, self._pending = list(self._pending.values()), {}
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

    def _load_batch(self, index: int, batch: list[tuple[list[str], torch.Tensor]]) -> None:
        keys = [k for ks, _ in batch for k in ks]
        slots = torch.cat([d.to(torch.int64).cpu() for _, d in batch])
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
                self.link.report(exc)
            log.warning("hicached load of %d pages failed (%s: %s); SGLang aborts the "
                        "batch's %d loading request(s)", len(keys), type(exc).__name__, exc,
                        len(batch))
            self.layer_done_counter.fail(index, exc)
            return
        self.stats["load_pages"] += len(keys)
        for layer in range(self.num_layers):
            self.layer_done_counter.complete(index, layer)

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
            done: Future[StoreResult] = Future()
            done.set_result(StoreResult(0, len(kv.keys), 0, b"", 0, 0.0))
            self._offloads.append(done)
            return True
        session = self.link.session
        if session is None or len(self._offloads) >= self.config.max_inflight_offloads:
            self.stats["offloads_dropped"] += 1
            return False
        if self.on_cuda:
            stream = torch.cuda.current_stream()
            for event in self.record_offload_ready():
                stream.wait_event(event)
            self._ready.record(stream)
        try:
            future = session.store_async(list(kv.keys), kv.device_indices.to(torch.int64).cpu())
        except (HiCacheError, ValueError) as exc:
            self.stats["offloads_dropped"] += 1
            self.link.report(exc)
            return False
        self.stats["offloads"] += 1
        self._offloads.append(future)
        return True

    def num_completed_offloads(self) -> int:
        n = 0
        for future in self._offloads:
            if not future.done():
                break
            n += 1
        return n

    def pop_completed_offload(self) -> bool:
        future = self._offloads.popleft()
        try:
            result = future.result(timeout=self.config.rpc_timeout_s)
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
        self._pending.clear()
        self._loads.join()
        while self._offloads:
            try:
                self._offloads.popleft().result(timeout=self.config.rpc_timeout_s)
            except BaseException:  # a failed store leaves nothing behind
                pass
        self.layer_done_counter.reset()

    def reset(self) -> None:
        self._quiesce()
        client = self.link.client
        if client is None or not self.shard.writer:
            return
        try:
            removed = client.clear_pool(self.spec.name)
            log.info("hicached pool %s cleared (%d keys)", self.spec.name, removed)
        except HiCacheError as exc:
            self.link.report(exc)
            log.warning("could not clear hicached pool %s: %s", self.spec.name, exc)

    def close(self) -> None:
        self._quiesce()
        self._loads.put(None)
        self._load_thread.join(timeout=10)
        self.link.close()
        if self._shm is not None:
            self._shm.close()  # unlinks the files; SGLang's tensors keep their mapping
        log.info("hicached linker stats: %s", self.stats)
