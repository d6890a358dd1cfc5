"""One worker's link to the daemon: its pool and session, re-established in the background.

The scheduler must never wait for, nor see an exception from, a daemon that is down, restarting
or draining. ``DaemonLink`` keeps that promise for the linker: ``session`` is the open session
or None, and every failure that means "the daemon or my session is gone" flips the link down
and wakes a background thread that sets everything up again (GetInfo, CreatePool with the same
spec, OpenSession with the same device buffers and events) every ``reconnect_interval_s``.

Primitives:

- ``Handover``: what ``OpenSession`` sends (descriptors, layer-event and ready-event handles,
  memfds).
- ``DaemonLink(config, spec, handover, worker_id)``: ``start()`` tries once at once, then in the
  background; ``session`` (None while down); ``report(exc)`` classifies a failed call and
  returns True when it took the link down; ``up`` / ``generation`` (bumped per new session);
  ``close()`` ends the session and the channel.
- ``is_link_failure(exc)``: the errors that mean the daemon or the session is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from hicache.buffers import DeviceBufferSpec
from hicache.errors import (
    HiCacheError,
    PoolClosed,
    PoolNotFound,
    PoolSpecConflict,
    SessionNotFound,
    Unavailable,
)
from hicache.specs import PoolSpec
from hicache_client.client import HiCacheClient
from hicache_client.session import WorkerSession
from hicache_sglang.config import LinkerConfig

log = logging.getLogger("hicache_sglang")

_LINK_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
               grpc.StatusCode.CANCELLED)


def is_link_failure(exc: BaseException) -> bool:
    """True for "the daemon or my session is gone"; False for a refusal of one request."""
    if isinstance(exc, Unavailable | SessionNotFound | PoolNotFound | PoolClosed):
        return True
    if isinstance(exc, HiCacheError):
        return exc.grpc_code in _LINK_CODES and not exc.from_daemon
    return isinstance(exc, ValueError | RuntimeError)  # a closed channel, a torn-down stub


@dataclass(frozen=True)
class Handover:
    buffers: Sequence[DeviceBufferSpec]
    layer_events: Sequence[bytes] = ()
    ready_event: bytes = b""
    fds: Sequence[int] = ()
    """Sealed memfds of ``memfd`` buffers (passed over the identity socket on every open)."""


@dataclass
class _State:
    client: HiCacheClient | None = None
    session: WorkerSession | None = None
    generation: int = 0
    last_error: str = ""


class DaemonLink:
    def __init__(self, config: LinkerConfig, spec: PoolSpec, handover: Handover,
                 worker_id: str) -> None:
        self.config = config
        self.spec = spec
        self.handover = handover
        self.worker_id = worker_id
        self._lock = threading.Lock()
        self._state = _State()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    # -- state -----------------------------------------------------------------------------

    @property
    def session(self) -> WorkerSession | None:
        s = self._state.session
        if s is not None and isinstance(s.heartbeat_error, SessionNotFound | PoolNotFound):
            self.report(s.heartbeat_error)  # the daemon restarted under a quiet worker
            return None
        return s

    @property
    def client(self) -> HiCacheClient | None:
        return self._state.client if self._state.session is not None else None

    @property
    def up(self) -> bool:
        return self.session is not None

    @property
    def generation(self) -> int:
        return self._state.generation

    def start(self) -> bool:
        """Try once now; keep trying in the background. True when the link is up."""
        ok = self._connect()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="hicache-sglang-link")
        self._thread.start()
        return ok

    def report(self, exc: BaseException) -> bool:
        """A call failed with ``exc``: take the link down if that is what it means."""
        if not is_link_failure(exc):
            return False
        with self._lock:
            session, self._state.session = self._state.session, None
        if session is not None:
            session.stop_heartbeat()
            log.warning("hicached link down (%s: %s); reconnecting every %.1fs",
                        type(exc).__name__, exc, self.config.reconnect_interval_s)
        self._wake.set()
        return True

    # -- setting up ------------------------------------------------------------------------

    def _connect(self) -> bool:
        cfg = self.config
        client = self._state.client
        if client is None:
            client = HiCacheClient(cfg.target, timeout=cfg.rpc_timeout_s, reconnect_seconds=0,
                                   spin_us=cfg.poll_us)
            self._state.client = client
        try:
            client.get_info()
            self._create_pool(client)
            session = client.open_session(
                self.spec.name, self.worker_id, self.handover.buffers, lease_ms=cfg.lease_ms,
                layer_events=self.handover.layer_events, ready_event=self.handover.ready_event,
                fds=self.handover.fds)
        except HiCacheError as exc:
            text = f"{type(exc).__name__}: {exc}"
            if text != self._state.last_error:  # log a new cause once, not every retry
                log.warning("hicached at %s not usable for pool %s: %s", cfg.target,
                            self.spec.name, text)
            self._state.last_error = text
            return False
        with self._lock:
            if self._closed.is_set():
                session.stop_heartbeat()
                return False
            self._state.session = session
            self._state.generation += 1
            self._state.last_error = ""
        log.info("hicached link up: pool %s, session %s (generation %d)", self.spec.name,
                 session.session_id[:8], self._state.generation)
        return True

    def _create_pool(self, client: HiCacheClient) -> None:
        """Create the pool, or use the one there if it differs in size only: instances of a
        model whose device pools differ in size (memory fractions) still share one pool."""
        try:
            # a large pool may take minutes to build: wait a deadline's worth, then leave it
            # to the background thread (POOL_NOT_READY) rather than hold SGLang's start
            client.create_pool(self.spec, wait_seconds=self.config.rpc_timeout_s)
        except PoolSpecConflict:
            there = client.get_pool(self.spec.name).spec
            sized = dataclasses.replace(self.spec, size_tokens=there.size_tokens,
                                        size_bytes=there.size_bytes)
            if there != sized:
                raise
            log.info("using pool %s as created (%d tokens) by another worker",
                     self.spec.name, there.resolved_size_tokens())

    def _run(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(self.config.reconnect_interval_s)
            self._wake.clear()
            if self._closed.is_set():
                return
            if self._state.session is None:
                self._connect()

    def close(self) -> None:
        """End the session (its keys stay cached) and the channel; idempotent."""
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            session, self._state.session = self._state.session, None
            client, self._state.client = self._state.client, None
        if session is not None:
            try:
                session.close()
            except HiCacheError as exc:
                log.info("closing session %s: %s", session.session_id[:8], exc)
        if client is not None:
            client.close()
