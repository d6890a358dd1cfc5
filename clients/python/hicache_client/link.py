"""One worker's link to the daemon: its pool and session, kept up from a background thread.

An inference server's scheduler must not wait past a deadline for, nor see an exception
from, a daemon that is down, restarting, draining, paused or slow. ``DaemonLink`` keeps that
promise for the engine integrations (SGLang's linker, vLLM's offloading spec): whether the
daemon may be called is a read of local state (a late or down link is not called), the calls
the scheduler's thread makes itself (lookups) carry their deadline, and everything else that
waits on the daemon (setting up, probing, stopping an old session's heartbeat) happens on the
link's own thread.

States: *up* (``usable``), *late* (a call missed its deadline: the daemon is alive but not
answering in time; the session is kept, calls are skipped (no hits, loads declined, offloads
dropped) while the link's thread probes it with heartbeats, one always in flight), *down* (no
session: the thread sets everything up again, GetInfo, CreatePool with the same spec,
OpenSession with the same buffers and events, every ``reconnect_interval_s``), *re-opening*
(down because the daemon answered that the session or pool is gone: a lease that ran out while
it hung, a restart; a new session is opened at once, and callers may wait for it).

- A call's ``DEADLINE_EXCEEDED`` (or the daemon's ``DEADLINE_PASSED``) makes the link late,
  not down: a daemon paused for a moment comes back to the same session, its buffers mapped
  once. Calls that keep missing their deadlines for ``down_after_s`` take it down.
- ``UNAVAILABLE``, ``SESSION_NOT_FOUND``, ``POOL_NOT_FOUND``, ``POOL_CLOSED``, a closed
  channel and a heartbeat that finds the session gone (seen within ``PROBE_SECONDS``) take it
  down; the daemon's own "gone" answers re-open it. A failure of a session the link has
  already replaced changes nothing (a call from before a re-open must not end the new one).
- A late link is *fenced* before it is up again: a heartbeat must show no load of this session
  still copying (``loads_in_flight == 0``), then ``on_fenced(session_id)`` runs (the linker
  gives back the device slots of loads that timed out) and the link is up.
- A session a load timed out on is *suspected* (``suspect``): a copy of it may still land.
  The link's thread clears the suspicion on whichever way the link comes back: the probe
  above (the same session), or, for a session it has dropped, the daemon's word that it is
  gone (``SESSION_NOT_FOUND``: the daemon tells a session's end only once no copy of it
  runs, nor can start; ``SESSION_ENDING`` until then; the link asks by closing it, which a
  heartbeat would not), or no daemon listening for ``UNREACHABLE_FENCE_S`` without a break.
  Then ``on_fenced(session_id)`` runs and ``fenced(session_id)`` returns. A word of the
  daemon's fences only the suspicions recorded before it was asked (a load that times out
  while the probe's heartbeat is under way is not fenced by its answer); ``suspect``'s
  ``then`` and ``on_fenced`` never interleave.

Primitives: ``LinkSettings`` (what the link reads of an integration's config), ``Handover``
(what ``OpenSession`` sends: descriptors, event handles, memfds), ``DaemonLink(config, spec,
handover, worker_id, on_fenced, create_pool, budget_share)``: ``start()`` tries once at once,
then in the background (the pool as ``hicache_client.pool_setup`` creates, adopts or fits it);
``spec`` (the pool as on the daemon), ``session`` (None while down), ``client``, ``usable`` (up
and not late), ``up``,
``generation`` (bumped per new session), ``reopening``; ``report(exc, session)`` classifies a
failed call (True when it took the link down or made it late; ``session``: the one the call
used); ``wait_usable(t, reopening_only)``: up to ``t`` seconds until usable (only while a
re-open is under way, and once per re-open: one that stalls costs one caller ``t``);
``gate(t)`` / ``call(deadline, fn)``: the one gate both engine integrations' scheduler-side
calls go through (see ``call``); ``suspect(session_id)`` / ``fenced(session_id, t)`` /
``suspects``; ``close()``. ``Skipped``: the gate was closed.
``is_link_failure`` / ``is_late`` / ``is_gone``: the classification.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc

from hicache.buffers import DeviceBufferSpec
from hicache.errors import (
    DeadlinePassed,
    HiCacheError,
    PoolClosed,
    PoolNotFound,
    SessionEnding,
    SessionNotFound,
    Unavailable,
)
from hicache.locks import condition, lock
from hicache.specs import PoolSpec
from hicache_client.client import HiCacheClient
from hicache_client.pool_setup import BudgetShare, ensure_pool
from hicache_client.session import WorkerSession

log = logging.getLogger("hicache_client.link")

T = TypeVar("T")


class Skipped(Exception):
    """The link's gate was closed (down, late, or a re-open not done in time): the daemon was
    not called."""


class LinkSettings(Protocol):
    """What the link reads of an integration's (frozen, validated) config."""

    @property
    def target(self) -> str: ...
    @property
    def rpc_timeout_s(self) -> float: ...
    @property
    def reconnect_interval_s(self) -> float: ...
    @property
    def down_after_s(self) -> float: ...
    @property
    def lease_ms(self) -> int: ...
    @property
    def poll_us(self) -> int: ...

PROBE_SECONDS = 0.1
"""How often a late link probes the daemon (a heartbeat, at most a second each), and an up
link looks at its session's heartbeats (a session the daemon says is gone is re-opened)."""
UNREACHABLE_FENCE_S = 30.0
"""A suspected session the link dropped is fenced when no daemon has listened for this long
without a break: a daemon closes its sockets at the end of its drain, then waits for the
copies it still runs (at most 10 s per pool, the reaper's and budget's threads 5 s each) and
exits well within it."""


def is_late(exc: BaseException) -> bool:
    """The call ran out of time (the daemon may be alive, only slow or paused), or named a
    session that has ended while a copy of it still runs (``SESSION_ENDING``: "gone" comes
    once none does)."""
    if isinstance(exc, DeadlinePassed | SessionEnding):
        return True
    return (isinstance(exc, HiCacheError) and not exc.from_daemon
            and exc.grpc_code == grpc.StatusCode.DEADLINE_EXCEEDED)


def is_gone(exc: BaseException) -> bool:
    """The daemon answered that this link's session or pool is not there (any more): it is
    alive, and a new session can be opened at once."""
    return isinstance(exc, SessionNotFound | PoolNotFound | PoolClosed) and exc.from_daemon


def is_link_failure(exc: BaseException) -> bool:
    """True for "the daemon or my session is gone"; False for a refusal of one request and
    for a call that was only late (``is_late``)."""
    if isinstance(exc, Unavailable | SessionNotFound | PoolNotFound | PoolClosed):
        return True
    if isinstance(exc, HiCacheError):
        return (exc.grpc_code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
                and not exc.from_daemon)
    return isinstance(exc, ValueError | RuntimeError)  # a closed channel, a torn-down stub


@dataclass(frozen=True)
class Handover:
    buffers: Sequence[DeviceBufferSpec]
    layer_events: Sequence[bytes] = ()
    ready_event: bytes = b""
    fds: Sequence[int] = ()
    """Sealed memfds of ``memfd`` buffers, or the exported chunks of ``cuda_vmm`` ones
    (``CudaDeviceBuffers.fds``): passed over the identity socket on every open, so they stay
    open while the link does."""


@dataclass
class _Suspicion:
    """A session a copy of which may still land."""

    mark: int
    """The number of the latest ``suspect`` of it: a word of the daemon's asked for before
    that (``_mark``) does not fence it."""
    gone: bool = False
    """The daemon said the session is not there: no copy of it runs, or ever will."""
    unreachable_since: float | None = None
    """Since when no daemon listened when its end was asked for (None: one did)."""


@dataclass
class _State:
    client: HiCacheClient | None = None
    session: WorkerSession | None = None
    generation: int = 0
    last_error: str = ""
    late_since: float | None = None
    """When calls began to miss their deadlines (None: the link is not late)."""
    max_keys: int = 0
    """Keys the daemon takes per call (GetInfo's ``max_keys_per_call``; 0: not said)."""
    reopening: bool = False
    """Down because the daemon answered that the session is gone: a new one is on its way."""
    reopen_stalled: bool = False
    """A caller waited for this re-open in vain: others do not wait."""


class DaemonLink:
    def __init__(self, config: LinkSettings, spec: PoolSpec, handover: Handover,
                 worker_id: str, on_fenced: Callable[[str], object] = lambda sid: None,
                 create_pool: bool = True, budget_share: BudgetShare | None = None) -> None:
        self.config = config
        self.create_pool = create_pool
        """False: use the pool others create (``POOL_NOT_FOUND`` until then: the link stays
        down and retries), checking that it has this spec but for its size."""
        self.budget_share = budget_share
        """Set: the asked size is a default that gives way to the daemon's memory budget
        (``hicache_client.pool_setup``)."""
        self.asked = spec
        """The pool asked for at each (re)connect."""
        self.spec = spec
        """The pool as it is on the daemon (its size as created there)."""
        self.handover = handover
        self.worker_id = worker_id
        self._on_fenced = on_fenced
        self._lock = lock("link")
        self._state = _State()
        self._retired: list[WorkerSession] = []
        """Sessions the link dropped; their heartbeats are stopped on the link's thread."""
        self._wake = threading.Event()
        self._changed = condition(self._lock)
        """Notified when the link comes up or a re-open ends (``wait_usable``)."""
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._suspects: dict[str, _Suspicion] = {}
        """Sessions a copy of which may still land (a load timed out on them)."""
        self._marks = 0
        """``suspect`` calls so far (under ``_lock``): each suspicion's ``mark``."""
        self._fencing = lock("link.fencing")
        """Held while a suspicion is recorded with what goes with it (``suspect``'s
        ``then``) and while a fence is checked and given (``_fence``): neither sees half of
        the other. Taken before ``_lock``, and before whatever ``then`` and ``on_fenced``
        lock."""

    # -- state (read on the scheduler's thread: no waiting) ---------------------------------

    @property
    def session(self) -> WorkerSession | None:
        s = self._state.session
        if s is not None and isinstance(s.heartbeat_error, SessionNotFound | PoolNotFound):
            # the daemon restarted under a quiet worker, or its lease ran out while it hung
            self.report(s.heartbeat_error, session=s)
            return None
        return s

    @property
    def client(self) -> HiCacheClient | None:
        return self._state.client if self._state.session is not None else None

    @property
    def up(self) -> bool:
        return self.session is not None

    @property
    def late(self) -> bool:
        return self._state.late_since is not None

    @property
    def max_keys(self) -> int:
        """Keys the daemon takes per call (0: it did not say)."""
        return self._state.max_keys

    @property
    def usable(self) -> bool:
        """Up, and not late: calls may be made."""
        return self._state.late_since is None and self.session is not None

    @property
    def generation(self) -> int:
        return self._state.generation

    @property
    def reopening(self) -> bool:
        """Down, and a new session is being opened for a daemon that answered."""
        return self._state.reopening

    def wait_usable(self, timeout: float, reopening_only: bool = False) -> bool:
        """Wait up to ``timeout`` seconds for the link to be usable; True when it is. With
        ``reopening_only``, only while a re-open is under way, and not for one that a caller
        already waited for in vain."""
        end = time.monotonic() + timeout
        if self.usable:  # (reads the heartbeat's verdict: not under the lock)
            return True
        with self._changed:
            while not self._up_now():
                state, left = self._state, end - time.monotonic()
                if reopening_only and (not state.reopening or state.reopen_stalled):
                    return False
                if left <= 0 or self._closed.is_set():
                    state.reopen_stalled |= reopening_only and timeout > 0 and left <= 0
                    return False
                self._changed.wait(left)
        return self.usable

    def gate(self, timeout: float) -> tuple[HiCacheClient, WorkerSession] | None:
        """The client and session a scheduler-side call may use now: the link is usable, or a
        re-open under way ends within ``timeout`` (waited for once per re-open); None: skip
        the daemon (no hit, no load, nothing stored). Never waits for a late or down
        daemon."""
        if not self.usable and not self.wait_usable(timeout, reopening_only=True):
            return None
        client, session = self.client, self.session
        if client is None or session is None:
            return None
        return client, session

    def call(self, deadline: float,
             fn: Callable[[HiCacheClient, WorkerSession, float], T]) -> T:
        """``fn(client, session, seconds_left)`` through the gate, all of it by ``deadline``
        (``time.monotonic()``): a failure is reported (``report``) and raised; when the
        daemon answered that the session is gone (a lapsed lease, a restart), the link
        re-opens it and ``fn`` is asked once more on the new session, within the same
        deadline, so the first call after a re-open is answered. ``Skipped`` when the gate is
        closed; ``TimeoutError`` when the deadline passed before ``fn`` could be called."""
        for attempt in (0, 1):
            got = self.gate(max(deadline - time.monotonic(), 0.0))
            if got is None:
                raise Skipped("hicached is not connected" if not self.up
                              else "hicached is late")
            client, session = got
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the call's deadline passed before the daemon was asked")
            try:
                return fn(client, session, left)
            except HiCacheError as exc:
                self.report(exc, session=session)
                if attempt or not is_gone(exc):
                    raise
        raise AssertionError("unreachable")

    def _up_now(self) -> bool:  # ``usable`` without the heartbeat's verdict (under the lock)
        return self._state.session is not None and self._state.late_since is None

    def start(self) -> bool:
        """Try once now; keep trying in the background. True when the link is up."""
        ok = self._connect()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="hicache-link")
        self._thread.start()
        return ok

    def report(self, exc: BaseException, session: WorkerSession | None = None) -> bool:
        """A call failed with ``exc``: make the link late or take it down if that is what it
        means; True when it did. ``session``: the session the call used; a failure of one the
        link has already replaced changes nothing (False). Never waits."""
        if session is not None and session is not self._state.session:
            return False  # stale: the link has moved on (a call from before a re-open)
        if is_late(exc):
            with self._lock:
                state = self._state
                if state.session is None:
                    return False  # down already: the reconnects go on as they are
                now = time.monotonic()
                first = state.late_since is None
                if first:
                    state.late_since = now
                gone = now - (state.late_since or now) >= self.config.down_after_s
            if gone:
                return self._down(f"calls missed their deadlines for "
                                  f"{self.config.down_after_s:.0f}s ({exc})")
            if first:
                log.warning("hicached late (%s); skipping it while it is probed", exc)
            self._wake.set()
            return True
        if not is_link_failure(exc):
            return False
        return self._down(f"{type(exc).__name__}: {exc}", reopen=is_gone(exc),
                          gone=isinstance(exc, SessionNotFound) and exc.from_daemon)

    def _down(self, why: str, reopen: bool = False, gone: bool = False) -> bool:
        """``gone``: the daemon said the session is not there (it runs no copy of it)."""
        with self._lock:
            session, self._state.session = self._state.session, None
            if gone and session is not None and session.session_id in self._suspects:
                self._suspects[session.session_id].gone = True
            self._state.late_since = None
            if session is not None:
                self._retired.append(session)
                if reopen:  # the daemon answered: a new session at once, callers may wait
                    self._state.reopening = True
                    self._state.reopen_stalled = False
        if session is not None:
            log.warning("hicached link down (%s); %s", why, "opening a new session" if reopen
                        else f"reconnecting every {self.config.reconnect_interval_s:.1f}s")
        self._wake.set()
        return True

    # -- the link's thread -------------------------------------------------------------------

    def _connect(self) -> bool:
        cfg = self.config
        client = self._state.client
        if client is None:
            client = HiCacheClient(cfg.target, timeout=cfg.rpc_timeout_s, reconnect_seconds=0,
                                   spin_us=cfg.poll_us)
            self._state.client = client
        session: WorkerSession | None = None
        try:
            self._state.max_keys = client.get_info().max_keys_per_call
            self.spec = ensure_pool(client, self.asked, create=self.create_pool,
                                    wait_seconds=cfg.rpc_timeout_s, share=self.budget_share)
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
        with self._changed:
            self._state.reopening = False
            self._changed.notify_all()  # (the waiters see the session once this is left)
            if session is None:
                return False
            if self._closed.is_set():
                self._retired.append(session)
                return False
            self._state.session = session
            self._state.generation += 1
            self._state.last_error = ""
            self._state.late_since = None
        log.info("hicached link up: pool %s, session %s (generation %d)", self.spec.name,
                 session.session_id[:8], self._state.generation)
        return True

    def _probe(self) -> None:
        """A late link: is the daemon answering again, and has every copy of this session's
        loads ended? Then the fence (``on_fenced``) and the link is up again."""
        client, session = self._state.client, self._state.session
        if client is None or session is None:
            return
        mark = self._mark()
        try:
            s = client.heartbeat(session.session_id, timeout=min(self.config.rpc_timeout_s,
                                                                  1.0))
        except HiCacheError as exc:
            self.report(exc, session=session)
            return
        if s.loads_in_flight:
            return  # a load that timed out may still be copying: not yet
        if not self._fence(session.session_id, mark):
            return  # a load timed out after the heartbeat was sent: ask again
        with self._changed:
            if self._state.session is session:
                self._state.late_since = None
            self._changed.notify_all()
        log.info("hicached answering again: link up (session %s kept)",
                 session.session_id[:8])

    def _run(self) -> None:
        took = 0.0
        while not self._closed.is_set():
            up = self._state.session is not None
            # a probe that waited out its deadline is followed at once: while the daemon
            # hangs one is always in flight, and its answer is the first the daemon gives
            self._wake.wait(max(PROBE_SECONDS - took, 0) if up
                            else self.config.reconnect_interval_s)
            self._wake.clear()
            if self._closed.is_set():
                return
            start, took = time.monotonic(), 0.0
            if self.session is None:  # (an up session's heartbeat may say it is gone)
                self._connect()
            elif self._state.late_since is not None:
                self._probe()
                took = time.monotonic() - start
            self._fence_dropped()
            self._stop_retired()  # after: a new session does not wait for an old heartbeat

    # -- fences ------------------------------------------------------------------------------

    def suspect(self, session_id: str, then: Callable[[], object] | None = None) -> None:
        """A copy of ``session_id`` may still land (a load on it timed out): its fence is
        owed (``on_fenced``), on whichever way the link comes back. ``then`` runs with the
        suspicion recorded and before any fence can be given for it (the linker withholds
        the load's device slots there: a fence given meanwhile cannot miss them). Waits for
        nothing but a fence being given at that moment."""
        with self._fencing:
            with self._lock:
                self._marks += 1
                had = self._suspects.get(session_id)
                if had is None:
                    self._suspects[session_id] = _Suspicion(self._marks)
                else:
                    had.mark = self._marks
            if then is not None:
                then()
        self._wake.set()

    def _mark(self) -> int:
        """The latest suspicion's number: taken before the daemon is asked, so that its
        answer fences only what was suspected when it was asked."""
        with self._lock:
            return self._marks

    @property
    def suspects(self) -> int:
        """Sessions whose fence is owed."""
        return len(self._suspects)

    def fenced(self, session_id: str, timeout: float | None = None) -> bool:
        """Wait (up to ``timeout``; None: as long as it takes, or until the link is closed)
        until no copy of ``session_id`` can land; True when none can."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while session_id in self._suspects:
                left = None if end is None else end - time.monotonic()
                if (left is not None and left <= 0) or self._closed.is_set():
                    return False
                self._changed.wait(left if left is not None else 1.0)
        return True

    def _fence(self, session_id: str, mark: int | None = None) -> bool:
        """No copy of ``session_id`` can land any more: ``on_fenced``, then its waiters.
        ``mark``: the daemon's word was asked for then (``_mark``); a suspicion of the
        session recorded after it is not fenced (False). None: the word holds whenever it
        was asked (the session is gone)."""
        with self._fencing:
            had = self._suspects.get(session_id)
            if had is not None and mark is not None and had.mark > mark:
                return False
            try:
                self._on_fenced(session_id)
            except Exception:
                log.exception("hicached link: giving back the slots of timed-out loads failed")
            with self._changed:
                self._suspects.pop(session_id, None)
                self._changed.notify_all()
        return True

    def _fence_dropped(self) -> None:
        """The link's thread: fence the suspected sessions the link has dropped, where the
        daemon's word allows (see the module's docstring)."""
        with self._lock:
            current = self._state.session
            dropped = [(sid, s) for sid, s in self._suspects.items()
                       if current is None or sid != current.session_id]
            client = self._state.client
            mark = self._marks
        for sid, suspicion in dropped:
            if suspicion.gone:
                self._fence(sid)
                continue
            if client is None:
                continue
            try:  # (not a heartbeat: that would keep the session alive)
                client.close_session(sid, timeout=min(self.config.rpc_timeout_s, 1.0))
            except SessionNotFound as exc:
                if exc.from_daemon:  # told only once no copy of it runs, nor can start
                    self._fence(sid)
                continue
            except HiCacheError as exc:
                if not exc.from_daemon and exc.grpc_code == grpc.StatusCode.UNAVAILABLE:
                    now = time.monotonic()
                    since = suspicion.unreachable_since
                    if since is None:
                        suspicion.unreachable_since = now
                    elif now - since >= UNREACHABLE_FENCE_S:
                        self._fence(sid, mark)  # no daemon, for long: nothing copies
                    continue
                # SESSION_ENDING, a late or draining daemon: ask again later
            suspicion.unreachable_since = None
            # closed now (its copies end; then it is gone), or not answered: ask again

    def _stop_retired(self) -> None:
        with self._lock:
            retired, self._retired = self._retired, []
        for s in retired:
            s.retire()

    def close(self) -> None:
        """End the session (its keys stay cached) and the channel; idempotent."""
        self._closed.set()
        self._wake.set()
        with self._changed:
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._stop_retired()
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
