"""What one daemon process serves, and the flows its RPCs run: no gRPC in here.

Primitives:

- ``Daemon``: the pool table, sessions, transports, copy engine and metrics of one process,
  with its drain state.
- ``enter(creates_work)`` / ``leave()`` / ``wait_idle(timeout)``: the drain gate. While
  draining, work-creating calls are refused with ``DRAINING``; the rest still answer.
- ``watch_slot()``: one of ``max_watchers`` event streams, or ``TOO_MANY_WATCHERS``.
- ``open_session(pool, worker_id, buffers, layer_events, ready_event, lease, peer_token)``: the
  OpenSession flow (access checked before anything is mapped; rolled back on failure).
- ``attach(buffers, layer_events, ready_event, fds)``: the transport a session's buffers need
  (all ``shm`` / ``memfd``, all ``cuda_ipc``, or all ``cuda_vmm`` with the fds of their
  chunks), refusing mixtures, CUDA events on shm sessions, and CUDA buffers where the CUDA
  driver has no device (``TRANSPORT_UNAVAILABLE``).
- ``transfer(op, session_id, host, device, layers, layer_events)``: one backup or load on a
  session's buffers; a load with layer events keeps the session's mappings until its GPU
  copies land.
- ``alloc(pool, tokens, session_id)``: raw pages, owned by a session when one is named (freed
  when it ends: ``session_ended``).
- ``lookup(pool, keys, session_id, hold_ms)`` -> (hit prefix, tiers, held): with a session of
  the pool and ``hold_ms``, the hit is held for it (``cache.holds``); ``release_holds``;
  ``expire_holds()`` (the session reaper's tick).
- ``store(session_id, keys, device)`` / ``load_keys(...)``: the keyed flows (``PageIds``:
  device page ids, as the fast path sends them, not token indices): the whole batch is
  validated first, then the cache commits (pages found, read-held, taken or evicted; the
  session's holds consumed), the copy engine moves the bytes, and the cache finishes (keys
  become ready, readers end).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from hicache import seams
from hicache.buffers import DeviceBufferSpec
from hicache.cuda_driver import driver_problem
from hicache.errors import (
    DeadlinePassed,
    Draining,
    HiCacheError,
    SpecInvalid,
    TooManyWatchers,
    TransportUnavailable,
)
from hicache.indices import IndexArray, PageIds
from hicache.keys import check_chain, check_keys, check_lookahead, check_namespace
from hicache.layer_groups import check_layer_events
from hicache.locks import lock
from hicached.cache.holds import Holder
from hicached.cache.index_types import StoreTicket
from hicached.copy.engine import Op, TransferEngine, TransferResult
from hicached.cuda.runner import CudaRunner
from hicached.service.identity import AccessRule, Grant, Redeemer, check_access
from hicached.service.pool_table import PoolTable
from hicached.service.sessions import Session, SessionManager
from hicached.transport.base import Attachment
from hicached.transport.cuda_ipc import CudaIpcTransport
from hicached.transport.shm import ShmTransport

log = logging.getLogger(__name__)


class FlowMetrics(Protocol):
    """What the flows count (``hicached.server.metrics.Metrics`` is one)."""

    def transfer(self, pool: str, op: str, nbytes: int, pages: int, seconds: float) -> None:
        """One copy: its bytes and pages, how long it took."""

    def promoted(self, pool: str, n: int) -> None:
        """``n`` keys were read up into host memory from a tier below for a LoadKeys."""


def check_deadline(deadline_ns: int, op: str = "load",
                   outcome: str = "before its copy could begin; nothing was copied") -> None:
    """``DEADLINE_PASSED`` once ``deadline_ns`` (Unix ns; 0 = none) has passed."""
    if not deadline_ns:
        return
    now = time.time_ns()
    if now > deadline_ns:
        late_ms = (now - deadline_ns) // 10**6
        raise DeadlinePassed(
            f"the {op}'s deadline passed {late_ms} ms {outcome}",
            metadata={"deadline_unix_ns": deadline_ns, "late_ms": late_ms})


@dataclass
class Daemon:
    pools: PoolTable
    """Named pools under the memory budget."""
    sessions: SessionManager
    """Open worker sessions and their leases."""
    shm: ShmTransport
    """Attaches shared-memory buffers."""
    engine: TransferEngine
    """Runs backups and loads."""
    metrics: FlowMetrics
    """Counters and the scrape-time collector."""
    cuda: CudaIpcTransport | None = None
    """The CUDA IPC transport; None on hosts without a usable CUDA driver."""
    cuda_driver: str = ""
    """The driver library the daemon was configured with ('' = the default)."""
    metrics_port: int = 0
    """The bound Prometheus port (0 = off)."""
    kv_events: tuple[str, str, str] = ("", "", "")
    """The KV event stream as bound: PUB endpoint, replay endpoint, topic ("" = off)."""
    pool_streams: Callable[[str], tuple[str, str]] = lambda name: ("", "")
    """A pool's own KV event stream: (endpoint, replay endpoint), "" where none."""
    draining: threading.Event = field(default_factory=threading.Event)
    """Set once shutdown began: new work is refused."""
    in_flight: int = 0
    """RPCs being handled now."""
    max_watchers: int = 4
    """WatchEvents streams served at once (each holds an RPC thread)."""
    access: tuple[AccessRule, ...] = ()
    """Who may open sessions on which pools."""
    identities: list[Redeemer] = field(default_factory=list)
    """The identity sockets beside the Unix API sockets (tokens for OpenSession)."""
    fast_paths: list[str] = field(default_factory=list)
    """The fast path's sockets (``<socket>.fast``), beside the Unix API sockets."""
    watchers: int = 0
    """WatchEvents streams open now."""
    max_keys_per_call: int = 65_536
    """Keys one Lookup, Store, LoadKeys or RemoveKeys may name (``TOO_MANY_KEYS``)."""
    begin_drain: Callable[[float], float] | None = None
    """The process's graceful shutdown, begun in the background (the Drain RPC): takes the
    grace period asked for (0: the configured one), returns the one that applies. None (a
    daemon without a process around it): a drain only refuses new work."""
    _lock: threading.Lock = field(default_factory=lambda: lock("daemon.gate"))

    def identify(self, token: str) -> Grant | None:
        """What a token from an identity socket was issued for: the peer and the fds it handed
        over (the caller closes them). None: no, used or stale token."""
        if not token:
            return None
        for channel in self.identities:
            grant = channel.redeem(token)
            if grant is not None:
                return grant
        return None

    # -- drain gate ------------------------------------------------------------------------

    def enter(self, creates_work: bool) -> None:
        with self._lock:
            if creates_work and self.draining.is_set():
                raise Draining("the daemon is shutting down; retry on its successor")
            self.in_flight += 1

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self.in_flight == 0:
                    return True
            time.sleep(0.01)
        return False

    @contextmanager
    def watch_slot(self) -> Iterator[None]:
        """One of ``max_watchers`` slots for an event stream, or ``TOO_MANY_WATCHERS``."""
        with self._lock:
            if self.watchers >= self.max_watchers:
                raise TooManyWatchers(
                    f"{self.watchers} event streams are open, the limit is {self.max_watchers}; "
                    f"close one or raise max_watchers",
                    metadata={"watchers": self.watchers, "limit": self.max_watchers})
            self.watchers += 1
        try:
            yield
        finally:
            with self._lock:
                self.watchers -= 1

    # -- flows -----------------------------------------------------------------------------

    def open_session(self, pool_name: str, worker_id: str,
                     buffers: Callable[[], list[DeviceBufferSpec]], layer_events: list[bytes],
                     ready_event: bytes, lease_seconds: float, peer_token: str = "") -> Session:
        """OpenSession: who asks (``peer_token``, from the identity socket, with its fds) is
        checked against the access rules before anything is mapped; then the layer events
        are bounded, ``buffers()`` decoded (a bad spec refuses here, nothing mapped), the
        buffers attached and checked against the pool's geometry, and the session opened.
        Whatever fails after the attach releases it."""
        pool = self.pools.get(pool_name)
        grant = self.identify(peer_token)
        try:
            peer = grant.peer if grant is not None else None
            check_access(self.access, pool_name, peer)  # before anything is mapped
            check_layer_events(len(layer_events), pool.spec.max_layers)
            attachment = self.attach(buffers(), layer_events, ready_event,
                                     grant.fds if grant else ())
        finally:
            if grant is not None:
                grant.close()  # mapped (the mappings hold the memory) or refused
        try:
            assert attachment.buffers is not None
            tokens = attachment.buffers.check_against(pool.spec)
            return self.sessions.open(pool_name, pool, worker_id, attachment, tokens,
                                      lease_seconds, peer)
        except BaseException:
            attachment.release()
            raise

    def attach(self, buffers: list[DeviceBufferSpec], layer_events: list[bytes],
               ready_event: bytes, fds: Sequence[int] = ()) -> Attachment:
        kinds = {b.transport for b in buffers}
        if kinds in ({"cuda_ipc"}, {"cuda_vmm"}):
            (kind,) = kinds
            if self.cuda is None:
                raise TransportUnavailable(
                    f"{kind} buffers cannot be attached: {driver_problem(self.cuda_driver)}",
                    metadata={"transport": kind, "buffers": len(buffers)})
            return self.cuda.attach(buffers, layer_events, ready_event,
                                    fds if kind == "cuda_vmm" else ())
        if len(kinds) > 1:
            raise SpecInvalid("a session's buffers use one transport: shm, memfd, cuda_ipc or "
                              "cuda_vmm", metadata={"transports": ",".join(sorted(kinds))})
        if layer_events or ready_event:
            raise SpecInvalid("layer_events and ready_event are CUDA events; shm sessions "
                              "complete every transfer before replying",
                              metadata={"layer_events": len(layer_events)})
        return self.shm.attach(buffers, fds)

    @staticmethod
    def _check_layer_events(layer_events: bool, runner: object) -> None:
        if layer_events and not (isinstance(runner, CudaRunner) and runner.layer_events):
            raise SpecInvalid("COMPLETION_LAYER_EVENTS needs a CUDA session opened with "
                              "layer_events", metadata={"completion": "COMPLETION_LAYER_EVENTS"})

    def _held_load(self, s: Session, op: str,
                   start: Callable[[Callable[[], None]], TransferResult],
                   release: Callable[[], None] = lambda: None, deadline_ns: int = 0
                   ) -> TransferResult:
        """Run a load that may outlive its call (layer events): the session's mappings, and
        whatever ``release`` frees, are kept until the bytes landed. ``start`` gets the callback
        to run then and returns the engine's result; it is not called once ``deadline_ns``
        (Unix ns, 0 = none) has passed (``DEADLINE_PASSED``). The load counts in the session's
        ``loads`` until its bytes landed, and is recorded in the metrics then: with layer
        events, its duration runs to the last layer's landing."""
        self.sessions.begin_copy(s)
        with s.lock:
            s.loads += 1
        t0 = time.perf_counter()
        landing = lock("daemon.landing")
        pending: list[TransferResult] = []
        landed_at: list[float] = []

        def landed() -> None:
            try:
                release()
            finally:
                with s.lock:
                    s.loads -= 1
                self.sessions.end_copy(s)
                with landing:
                    landed_at.append(time.perf_counter())
                    r = pending[0] if pending else None
                if r is not None:
                    self.metrics.transfer(s.pool_name, op, r.bytes, r.pages, landed_at[0] - t0)

        try:
            check_deadline(deadline_ns)
            r = start(landed)
        except BaseException:
            landed()
            raise
        if not r.pending:
            landed()
            self.metrics.transfer(s.pool_name, op, r.bytes, r.pages, r.seconds)
            return r
        with landing:  # the GPU may have finished already: then record here
            pending.append(r)
            done = landed_at[0] if landed_at else None
        if done is not None:
            self.metrics.transfer(s.pool_name, op, r.bytes, r.pages, done - t0)
        return r

    def transfer(self, op: Op, session_id: str, host: IndexArray | PageIds,
                 device: IndexArray | PageIds, layers: tuple[int, int], layer_events: bool,
                 deadline_ns: int = 0) -> TransferResult:
        """One backup or load; with ``layer_events`` a load returns once enqueued. ``host``
        and ``device``: token indices, or ``PageIds`` (the fast path). A load whose
        copy would begin after ``deadline_ns`` (Unix ns) is refused: ``DEADLINE_PASSED``."""
        if op is Op.BACKUP and layer_events:
            raise SpecInvalid("backups always complete before the reply; "
                              "COMPLETION_LAYER_EVENTS is for loads",
                              metadata={"completion": "COMPLETION_LAYER_EVENTS"})
        with self.sessions.transfer(session_id) as s:
            buffers = s.attachment.buffers
            runner = s.attachment.runner
            assert buffers is not None, "a session in use keeps its mappings"
            if op is Op.BACKUP:
                r = self.engine.backup(s.pool, buffers, host, device, *layers, runner=runner)
                self.metrics.transfer(s.pool_name, op.value, r.bytes, r.pages, r.seconds)
                return r
            self._check_layer_events(layer_events, runner)
            return self._held_load(s, op.value, lambda landed: self.engine.load(
                s.pool, buffers, host, device, *layers, runner=runner,
                wait=not layer_events, on_complete=landed),
                deadline_ns=deadline_ns)

    def alloc(self, pool_name: str, num_tokens: int, session_id: str = "") -> IndexArray:
        owner = self._session_of(session_id, pool_name).owner if session_id else 0
        return self.pools.cache(pool_name).alloc_raw(num_tokens, owner)

    def session_ended(self, s: Session) -> None:
        """Free the raw pages the session owned (a copy still holding one frees it later)
        and end its holds."""
        freed = s.pool.allocator.free_owned(s.owner)
        if freed:
            log.info("session %s ended: freed %d raw page(s) it owned", s.public_id, freed)
        try:
            cache = self.pools.cache(s.pool_name)
        except HiCacheError:  # the pool went first
            return
        if cache.pool is s.pool:
            cache.holds.end(s.owner)

    # -- holds ------------------------------------------------------------------------------

    def lookup(self, pool: str, keys: list[bytes], session_id: str = "", hold_ms: int = 0,
               touch: bool = False) -> tuple[int, bytes, int, int]:
        """Lookup, holding the hit for ``session_id`` when it and ``hold_ms`` are given: (hit
        prefix, tiers, held, promised: ``TierStack.lookup``); ``touch``: the hit's host pages
        count as used now."""
        keys = check_keys(keys, limit=self.max_keys_per_call)
        stack = self.pools.stack(pool)
        if not session_id or hold_ms <= 0:
            return stack.lookup(keys, touch=touch)
        s = self._session_of(session_id, pool)
        policy = self.pools.cache(pool).holds.policy
        return stack.lookup(keys, Holder(s.owner, policy.seconds(hold_ms), lambda: s.ended),
                            touch=touch)

    def release_holds(self, session_id: str, keys: list[bytes] | None) -> int:
        """End the session's holds of ``keys`` (none: all of them); returns how many."""
        s = self.sessions.get(session_id)
        keys = check_keys(keys, limit=self.max_keys_per_call) if keys else None
        return self.pools.cache(s.pool_name).holds.release(s.owner, keys)

    def remove_keys(self, pool: str, keys: list[bytes]) -> int:
        """RemoveKeys: ``keys`` leave every tier of ``pool``; returns how many were there."""
        return self.pools.stack(pool).remove(check_keys(keys, limit=self.max_keys_per_call))

    def expire_holds(self) -> None:
        for _, cache in self.pools.entries():
            cache.holds.expire()

    def _session_of(self, session_id: str, pool: str) -> Session:
        s = self.sessions.get(session_id)
        if s.pool_name != pool:
            raise SpecInvalid(f"session {s.public_id} belongs to pool {s.pool_name}, not "
                              f"{pool}", metadata={"field": "session_id", "pool": s.pool_name})
        return s

    def store(self, session_id: str, keys: list[bytes], device: IndexArray | PageIds,
              layers: tuple[int, int],
              token_ids: Sequence[int] | np.ndarray | bytes | None = None,
              parent_key: bytes = b"", deadline_ns: int = 0, lora_name: str = "",
              cache_salt: str = "", lookahead_tokens: int = 0,
              lookahead_token_ids: Sequence[int] | np.ndarray | bytes | None = None
              ) -> tuple[StoreTicket, TransferResult | None]:
        """``token_ids`` (``page_size`` per key) and ``parent_key`` say what chain the keys
        are (``hicache.keys.check_chain``), ``lookahead_token_ids`` (``lookahead_tokens`` per
        key: ``check_lookahead``) the tokens after each page its key's hash covers, and
        ``lora_name`` and ``cache_salt`` their namespace (``check_namespace``): what the
        pool's events publish of them. Past
        ``deadline_ns`` (Unix ns, 0 = none) its caller has given up and may be reusing the
        device pages it named: no copy begins then, and a copy that ends then keeps none of
        its pages (``DEADLINE_PASSED`` either way)."""
        keys = check_keys(keys, "keys", unique=True, limit=self.max_keys_per_call)
        with self.sessions.transfer(session_id) as s:
            buffers = s.attachment.buffers
            assert buffers is not None, "a session in use keeps its mappings"
            device_pages, all_layers = self.engine.check_keyed(
                Op.BACKUP, s.pool, buffers, len(keys), device, *layers)
            tokens, parent = check_chain(len(keys), s.pool.page_size, token_ids, parent_key)
            ahead = check_lookahead(len(keys), lookahead_tokens, lookahead_token_ids,
                                    tokens is not None)
            namespace = check_namespace(lora_name, cache_salt)
            cache = self.pools.cache(s.pool_name)
            check_deadline(deadline_ns, "store")
            cache.events.chains.note(keys, parent, tokens, namespace,
                                     (lookahead_tokens, ahead) if ahead is not None else None)
            ticket = cache.begin_store(keys)
            result, ok = None, False
            try:
                seams.reached("store.taken")
                if ticket.pages.size:
                    result = self.engine.transfer_pages(
                        Op.BACKUP, s.pool, buffers, ticket.pages, device_pages[ticket.positions],
                        all_layers, s.attachment.runner)
                seams.reached("store.copied")
                check_deadline(deadline_ns, "store",
                               "while its pages were copied; none of them was kept")
                ok = True
            finally:
                cache.finish_store(ticket, ok)
        if result is not None:
            self.metrics.transfer(s.pool_name, "store", result.bytes, result.pages,
                                  result.seconds)
        return ticket, result

    def load_keys(self, session_id: str, keys: list[bytes], device: IndexArray | PageIds,
                  layers: tuple[int, int], layer_events: bool, deadline_ns: int = 0
                  ) -> TransferResult:
        keys = check_keys(keys, "keys", limit=self.max_keys_per_call)
        with self.sessions.transfer(session_id) as s:
            buffers = s.attachment.buffers
            runner = s.attachment.runner
            assert buffers is not None, "a session in use keeps its mappings"
            self._check_layer_events(layer_events, runner)
            device_pages, load_layers = self.engine.check_keyed(
                Op.LOAD, s.pool, buffers, len(keys), device, *layers)
            cache = self.pools.cache(s.pool_name)
            # keys on disk or in the cluster are read back first; KEY_NOT_FOUND: nothing
            # held, nothing moves
            held = self.pools.stack(s.pool_name).hold_for_load(
                keys, functools.partial(self.metrics.promoted, s.pool_name), owner=s.owner)
            seams.reached("load_keys.resolved")
            return self._held_load(s, "load_keys", lambda landed: self.engine.transfer_pages(
                Op.LOAD, s.pool, buffers, held, device_pages, load_layers, runner,
                wait=not layer_events, on_complete=landed),
                release=functools.partial(cache.finish_load, held), deadline_ns=deadline_ns)

