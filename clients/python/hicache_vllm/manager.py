"""``HicachedOffloadingManager``: vLLM's scheduler-side offloading manager, backed by hicached.

vLLM's ``OffloadingConnector`` calls it on the scheduler's thread (under ``lock``):

- ``lookup(key)``: the daemon's answer for the block, read from local books
  (``hicache_vllm.promises``): HIT only for a block every rank's pool holds *for this manager*
  (a ``Lookup`` with ``hold_ms`` on the manager's own session per pool, of the request's keys
  from the first one asked on, which vLLM records before it looks any up), MISS, or RETRY for
  a key outside that answer until the step's end (``on_schedule_end``) has asked for it.
- ``prepare_load(keys)``: the blocks' spec for the workers (``HicachedLoadStoreSpec``); the
  holds stay until ``complete_load`` and the request's end (``on_request_finished``) release
  them: vLLM's "protected from eviction until complete_load".
- ``touch(keys)``: the blocks count as used now in every rank's pool (a ``Lookup`` with
  ``touch``, coalesced, on the hold book's thread: never the scheduler's).
- ``follow(request)``: vLLM's ``Request`` (``HicachedOffloadingConnector`` hands it over):
  its stores carry their pages' tokens and parent key (``blocks.Chain``), what routers that
  match tokens need (Dynamo's indexer); under vLLM's plain ``OffloadingConnector`` no request
  is followed and the pages are told without. With vLLM 0.34's lookahead block hashes
  (``hash_lookahead``: vLLM's ``num_hash_lookahead_tokens`` L > 0, EAGLE / MTP with prefix
  caching; the connector says it) a block's hash covers the L tokens after it too, and each
  page's store carries them (one row per page: the L tokens after the page's end, what vLLM's
  own events say for the page's key, its last block): a router that hashes tokens as vLLM
  does needs them.
- ``prepare_store(keys)``: every block is offered (the daemon stores what it lacks and has room
  for, and evicts by its own LRU: ``evicted_keys`` is empty); with the daemon down the store is
  dropped (None, counted).
- ``complete_store`` / ``take_events``: vLLM's ``BlockStored`` / ``BlockRemoved`` events for
  what this engine stored and reset (the daemon's own stream tells every tier exactly).
- ``get_stats``: what changed since vLLM's last step, as vLLM's offloading metrics
  (``hicache_vllm.stats``: the blocks held for this engine, its misses, its stores dropped,
  its links up).
- ``reset_cache``: this engine's own state dropped: its answers, the lookups it queued and
  the holds no load in flight claims (released off the scheduler's thread). The pools are
  shared with every engine of the model: nothing in them is removed (emptying one is an
  operator's act, ``hicachectl clear-pool``).

Failure semantics: nothing raises into the scheduler, and its thread waits on the daemon only
in lookups (a request's first ``lookup``, ``on_schedule_end``), each at most
``lookup_timeout_s`` over every pool; one that misses it makes the link late, and a late or
down link is not called (misses at once) until it answers again. A link whose session the
daemon said is gone (its lease ran out while it hung, a restart) is re-opened at once, and a
lookup waits for that within its deadline (once per re-open) and asks again, so the first
request after the daemon is back is answered and its blocks are offered for storing.
With the daemon down, restarting, refusing or slow, lookups are misses, stores are dropped
(counted in ``stats``), and the links reconnect by themselves (``hicache_client.link``).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from hicache.errors import HiCacheError
from hicache.keys import MAX_LOOKAHEAD_TOKENS
from hicache.locks import lock
from hicache_client.hold_book import HoldBook
from hicache_client.link import DaemonLink, Handover
from hicache_client.shm import ShmDeviceBuffers
from hicache_vllm.blocks import Chain, HicachedLoadStoreSpec
from hicache_vllm.config import SpecConfig
from hicache_vllm.namespace import Plan
from hicache_vllm.promises import Promises
from hicache_vllm.stats import Reporter
from hicache_vllm.vllm_api import Api

log = logging.getLogger("hicache_vllm")

_STATS = ("stores_offered", "stores_dropped", "store_blocks", "loads", "load_blocks",
          "lookups_down", "resets", "reset_failures", "reset_holds_released",
          "touched_blocks", "touches_dropped")

MAX_FOLLOWED = 65536
"""vLLM requests whose tokens the manager keeps for their stores' events (``follow``)."""
MAX_TOUCHES = 65536
"""The most touched blocks waiting to be sent; more are dropped (counted): a touch is a hint."""


class HicachedOffloadingManager(OffloadingManager):
    def __init__(self, config: SpecConfig, plan: Plan, enable_events: bool, api: Api) -> None:
        self.config = config
        self.plan = plan
        self.api = api
        """vLLM's release line (how its events are made)."""
        self.stats: dict[str, int] = dict.fromkeys(_STATS, 0)
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._events_lock = lock("vllm.manager.events")
        sealed = config.target.startswith("unix:")
        self._buffers: list[ShmDeviceBuffers] = []
        self.links: list[DaemonLink] = []
        worker_id = config.worker_id or f"vllm-{socket.gethostname()}-{os.getpid()}-scheduler"
        for rank in range(len(plan.pool_names)):
            spec = plan.pool_spec(rank, config.pool_size_tokens, config.pool_size_bytes)
            # a page of staging: the daemon opens sessions on buffers; this one holds only
            buf = ShmDeviceBuffers.create(spec, spec.page_size, config.shm_dir,
                                          prefix="hicache-vllm-scheduler", sealed=sealed)
            self._buffers.append(buf)
            self.links.append(DaemonLink(config, spec, Handover(buf.descriptors, fds=buf.fds),
                                         worker_id, create_pool=False))
        self.holds = HoldBook(config.lookup_hold_ms, self._release, "hicache-vllm-holds")
        """The holds this manager's lookups took, and the one thread that lets them go."""
        self.promises = Promises(self.holds, self._lookup)
        self._touch_lock = lock("vllm.manager.touch")
        self._touched: dict[bytes, None] = {}
        """Blocks touched since the last send, in order (sent by one ``_send_touches``)."""
        self._touch_queued = False
        self._requests: dict[str, Any] = {}
        self._stats_lock = lock("vllm.manager.stats")
        """vLLM's ``Request`` of each request followed (``follow``), by id: its tokens and
        block hashes name what its stores are."""
        self._reporter = Reporter()
        self.lookahead_tokens = 0
        """vLLM's ``num_hash_lookahead_tokens`` (``hash_lookahead``; 0: plain block hashes)."""
        self._chains = True
        """Whether stores carry their chain (not with more lookahead than the daemon takes)."""
        for link in self.links:
            link.start()
        log.info("hicached offloading manager: pools %s (%d layers, %d tokens per page)",
                 plan.pool_names, plan.layers, plan.page_tokens)

    # -- the daemon (lookups on the caller's thread, releases on the hold book's) ---------

    def _lookup(self, keys: list[bytes]) -> int:
        """Hold ``keys`` in every pool; the leading run every pool holds. One deadline for
        all of them (``lookup_timeout_s``): the scheduler's thread waits no longer with many
        ranks' pools than with one. Holds beyond what every pool holds, or taken before a
        later pool failed, are let go on the hold book's thread (this one never waits)."""
        answers: list[tuple[DaemonLink, int]] = []
        deadline = time.monotonic() + self.config.lookup_timeout_s
        try:
            for link in self.links:
                answers.append((link, self._lookup_on(link, keys, deadline)))
        except Exception:
            self._let_go(answers, keys, 0)
            raise
        held = min((got for _, got in answers), default=0)
        self._let_go(answers, keys, held)
        return held

    def _lookup_on(self, link: DaemonLink, keys: list[bytes], deadline: float) -> int:
        """One pool's promised prefix of ``keys`` (held in host memory, then kept on the disk
        or in the cluster and promoted for the load, as the daemon says), by ``deadline``,
        through the link's gate (a session the daemon says is gone is re-opened and asked
        again, within the deadline)."""
        return link.call(deadline, lambda client, session, left: int(client.lookup(
            session.pool, keys[:link.max_keys or None], timeout=left,
            session_id=session.session_id, hold_ms=self.config.lookup_hold_ms).promised))

    def _let_go(self, answers: list[tuple[DaemonLink, int]], keys: list[bytes],
                held: int) -> None:
        for link, got in answers:
            if got > held:
                self.holds.release(keys[held:got], functools.partial(self._release_on, link))

    def _release(self, keys: list[bytes]) -> None:
        for link in self.links:
            self._release_on(link, keys)

    def _release_on(self, link: DaemonLink, keys: Sequence[bytes]) -> None:
        session = link.session
        if session is None or not keys:
            return
        try:
            session.release_holds(list(keys), timeout=self.config.rpc_timeout_s)
        except HiCacheError as exc:  # holds expire by themselves
            log.debug("releasing %d hold(s) failed: %s", len(keys), exc)

    # -- vLLM's OffloadingManager -----------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def _ready(self) -> bool:
        """Every link's gate open (a re-open under way waited for, once per re-open, within
        the lookup deadline)."""
        end = time.monotonic() + self.config.lookup_timeout_s
        return all(link.gate(max(end - time.monotonic(), 0)) is not None
                   for link in self.links)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self._ready():
            self._count("lookups_down", 1)
            return LookupResult.MISS
        got = self.promises.answer(req_context.req_id, bytes(key),
                                   lambda: _following(req_context, key))
        if got is None:
            return LookupResult.RETRY
        return LookupResult.HIT if got else LookupResult.MISS

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext
                     ) -> HicachedLoadStoreSpec:
        ks = [bytes(k) for k in keys]
        self.promises.loading(req_context.req_id, ks)
        self._count("loads", 1)
        self._count("load_blocks", len(ks))
        return HicachedLoadStoreSpec(ks)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.promises.loaded(req_context.req_id)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """The blocks are in use (vLLM's own cache hit them): their pages in every rank's
        pool count as used now, so the daemon evicts others first. Sent off this thread (a
        ``Lookup`` with ``touch`` per pool, on the hold book's thread); touches made while
        one is waiting join it."""
        if not keys:
            return
        with self._touch_lock:
            room = MAX_TOUCHES - len(self._touched)
            for k in list(keys)[:max(room, 0)]:
                self._touched[bytes(k)] = None
            if len(keys) > room:
                self._count("touches_dropped", len(keys) - max(room, 0))
            if self._touch_queued:
                return
            self._touch_queued = True
        self.holds.later(self._send_touches)

    def _send_touches(self) -> None:
        with self._touch_lock:
            keys, self._touched = list(self._touched), {}
            self._touch_queued = False
        sent = False
        for link in self.links:
            session = link.session
            if session is None or not link.usable:
                continue
            step = link.max_keys or len(keys)
            try:
                for at in range(0, len(keys), step):
                    session.lookup(keys[at:at + step], touch=True,
                                   timeout=self.config.rpc_timeout_s)
                sent = True
            except HiCacheError as exc:  # a hint: not retried
                link.report(exc, session=session)
                log.debug("touching %d block(s) in %s failed: %s", len(keys), session.pool,
                          exc)
        self._count("touched_blocks" if sent else "touches_dropped", len(keys))

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext
                      ) -> PrepareStoreOutput | None:
        ks = [bytes(k) for k in keys]
        self._count("stores_offered", 1)
        # a link being re-opened takes the store (the worker waits for its own link)
        if not all(link.usable or link.reopening for link in self.links):
            self._count("stores_dropped", 1)
            return None
        return PrepareStoreOutput(keys_to_store=list(keys),
                                  store_spec=HicachedLoadStoreSpec(ks, self._chain(ks,
                                                                                   req_context)),
                                  evicted_keys=[])

    def follow(self, request: Any) -> None:
        """vLLM's ``Request`` (its connector's ``on_new_request``): the stores of it say what
        their pages are (``Chain``), so that routers that match tokens find them. At most
        ``MAX_FOLLOWED`` are kept (a request vLLM never reports finished goes, oldest
        first: its later stores carry no tokens)."""
        self._requests[request.request_id] = request
        if len(self._requests) > MAX_FOLLOWED:
            for req_id in list(self._requests)[:len(self._requests) - MAX_FOLLOWED]:
                self._requests.pop(req_id, None)

    def hash_lookahead(self, tokens: int) -> None:
        """vLLM's ``num_hash_lookahead_tokens`` (``HicachedOffloadingConnector`` says it from
        vLLM's config: 0 without EAGLE / MTP, and on 0.33, which keeps the legacy hashes under
        any KV connector): each block's hash covers that many
        tokens after it, so the stores say them. More than the daemon takes a page
        (``MAX_LOOKAHEAD_TOKENS``): the stores carry no chain (their tokens alone would hash
        to other blocks), said once here."""
        self.lookahead_tokens = int(tokens)
        self._chains = self.lookahead_tokens <= MAX_LOOKAHEAD_TOKENS
        if not self._chains:
            log.warning("vLLM hashes %d lookahead tokens into each block, more than the "
                        "daemon takes (%d): stores are told to routers without their tokens",
                        self.lookahead_tokens, MAX_LOOKAHEAD_TOKENS)

    def _chain(self, keys: list[bytes], req_context: ReqContext) -> Chain | None:
        """The tokens of ``keys`` (consecutive pages of the request, each ending where vLLM
        recorded it), the key of the page before them and, with lookahead hashes, the
        ``lookahead_tokens`` after each page; None where they are not that, or not all
        known yet."""
        req = self._requests.get(req_context.req_id)
        if req is None or not keys or not self._chains:
            return None
        per = self.plan.page_tokens
        ends = [req_context.get_offload_key_position(k) for k in keys]  # type: ignore[arg-type]
        first = ends[0]
        if first is None or any(e != first + i * per for i, e in enumerate(ends)):
            return None
        ahead, count = self.lookahead_tokens, len(keys)
        tokens = req.all_token_ids[first - per:first + (count - 1) * per + ahead]
        if len(tokens) != count * per + ahead:
            return None
        lookahead = None
        if ahead:  # page i's row: the tokens after its end (vLLM's for its last block)
            span = np.asarray(tokens, dtype=np.int64)
            tokens = span[:count * per]
            lookahead = span[per * np.arange(1, count + 1)[:, None] + np.arange(ahead)]
        parent = b""
        n = first // per  # the first page is the request's n-th
        if n > 1:
            bpc = self.plan.blocks_per_chunk
            hashes = req.block_hashes
            if len(hashes) < bpc * (n - 1):
                return None
            parent = bytes(hashes[bpc * (n - 1) - 1]) + keys[0][-4:]  # its group, as vLLM
        lora = getattr(req, "lora_request", None)
        return Chain(np.asarray(tokens, dtype=np.int64), parent,
                     str(getattr(lora, "lora_name", "") or "") if lora is not None else "",
                     str(getattr(req, "cache_salt", None) or ""), lookahead)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        if success:
            self.promises.stored()
            self._count("store_blocks", len(keys))
            self._stored_event(list(keys), req_context)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.promises.finished(req_context.req_id)
        self._requests.pop(req_context.req_id, None)

    def on_schedule_end(self, context: Any) -> None:
        self.promises.flush()

    def has_pending_work(self) -> bool:
        return self.promises.pending

    def _count(self, name: str, n: int = 1) -> None:
        """Add to a counter: the scheduler's thread and the hold book's both count (one lock,
        so no increment is lost and no counter ever reads lower than before)."""
        with self._stats_lock:
            self.stats[name] += n

    def get_stats(self) -> Any:
        """vLLM's ``OffloadingConnectorStats`` of what changed since the last call (counters)
        and the links up now (a gauge); read from local counts, no call to the daemon."""
        with self._stats_lock:
            mine = dict(self.stats)
        return self._reporter.collect({**mine, **self.promises.stats},
                                      sum(link.usable for link in self.links))

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events is None:
            return ()
        with self._events_lock:
            out, self._events = self._events, []
        return out

    def _stored_event(self, keys: list[OffloadKey], req_context: ReqContext) -> None:
        if self._events is not None and keys:
            event = self.api.stored_event(keys, Medium.CPU, req_context)
            with self._events_lock:
                self._events.append(event)

    def reset_cache(self) -> None:
        """This engine's state dropped: answers, queued lookups, and the holds no load in
        flight claims (released off this thread: the daemon may be slow or down). The pools
        are every engine's: nothing is removed from them (``hicachectl clear-pool`` does)."""
        keys = self.promises.forget_all()
        self._count("resets", 1)
        if keys:
            self.holds.release(keys, self._reset_release)

    def _reset_release(self, keys: list[bytes]) -> None:
        for link in self.links:
            session = link.session
            if session is None:  # the daemon has ended them with the session
                continue
            try:
                n = session.release_holds(keys, timeout=self.config.rpc_timeout_s)
                self._count("reset_holds_released", n)
            except HiCacheError as exc:  # holds expire by themselves
                self._count("reset_failures", 1)
                link.report(exc, session=session)
                log.warning("releasing this engine's holds in %s failed: %s", session.pool,
                            exc)

    def shutdown(self) -> None:
        self.holds.close()
        for link in self.links:
            link.close()
        for buf in self._buffers:
            buf.close()
        log.info("hicached offloading manager stats: %s %s", self.stats, self.promises.stats)


MAX_PROBE_KEYS = 16384
"""The most keys a request's first lookup asks at once (the rest, if any, a step later)."""


def _following(req_context: ReqContext, key: OffloadKey) -> list[bytes]:
    """The request's keys from ``key`` on, in prefix order: vLLM's connector records each key
    of the request with its end token (``set_offload_key_position``) before it looks any up."""
    positions = getattr(req_context, "_offload_key_positions", None)
    if not isinstance(positions, dict) or (at := positions.get(key)) is None:
        return [bytes(key)]
    later = sorted((p, k) for k, p in positions.items() if p >= at)
    return [bytes(k) for _, k in later[:MAX_PROBE_KEYS]]
