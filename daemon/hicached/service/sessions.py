"""Worker sessions: attached device buffers with a lease, reaped when the worker goes quiet.

Primitives:

- ``Session``: one worker's attachment to one pool; ``expires_at`` moves forward on every
  heartbeat and transfer; ``in_flight`` counts transfers using its mappings; ``owner`` is the
  number its raw pages are owned under (freed when it ends, through ``on_end``).
- ``SessionManager``: ``open``, ``get``, ``heartbeat``, ``close``, ``transfer(session_id)`` (a
  context manager keeping the session's mappings for one copy), ``begin_copy`` / ``end_copy``
  (for GPU copies that outlive their RPC), ``reap()`` and a reaper thread (asleep while no
  session is open; each round also runs ``on_tick``: holds expire there).

A closed or expired session leaves the table at once; its mappings are released when its last
in-flight transfer ends, so a copy never runs on unmapped memory and a dead worker never keeps
its buffers mapped. Its end is told only then: until its last copy ends, calls naming it get
``SESSION_ENDING`` (retry), and ``SESSION_NOT_FOUND`` afterwards, so a worker that hears
"gone" knows no byte of that session can still land in its buffers (the fence the engines'
links rely on); the table of such sessions holds only those with a copy still running. Host
pages belong to the pool, not the session: a restarted worker opens a new session and loads
what its predecessor backed up.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from hicache import seams
from hicache.errors import BufferFault, SessionEnding, SessionNotFound
from hicache.identity import is_public_id, public_session_id
from hicache.locks import lock
from hicached.core.pool import HostPool
from hicached.service.identity import Peer
from hicached.transport.base import Attachment

log = logging.getLogger(__name__)

ENDING_RETRY_MS = 50
"""What a ``SESSION_ENDING`` answer asks the caller to wait before asking again."""


@dataclass
class Session:
    session_id: str
    pool_name: str
    pool: HostPool
    worker_id: str
    lease_seconds: float
    attachment: Attachment
    device_tokens: int
    expires_at: float
    owner: int = 0
    """Owner number of the raw pages it allocated (unique in this daemon, never 0)."""
    in_flight: int = 0
    loads: int = 0
    """Loads whose copies began and have not landed (``Session.loads_in_flight``)."""
    transfers: int = 0
    lease_clamped: bool = False
    """The worker asked for more than the daemon's maximum lease."""
    peer: Peer | None = None
    """Who opened it, when the worker identified itself (identity socket)."""
    ended: bool = False
    released: bool = False
    lock: threading.Lock = field(default_factory=lambda: lock("session"))

    @property
    def public_id(self) -> str:
        """What others see: names the session, cannot use it."""
        return public_session_id(self.session_id)

    def expires_in(self, now: float) -> float:
        return max(self.expires_at - now, 0.0)


class SessionManager:
    def __init__(self, default_lease_seconds: float,
                 clock: Callable[[], float] = time.monotonic,
                 max_lease_seconds: float = float("inf"),
                 on_reap: Callable[[Session], None] = lambda s: None,
                 on_end: Callable[[Session], None] = lambda s: None,
                 on_tick: Callable[[], None] = lambda: None) -> None:
        """``on_end`` runs once for every session that ends (closed, reaped, shut down);
        ``on_tick`` on every round of the reaper (what expires with time: holds)."""
        self.default_lease = default_lease_seconds
        self.max_lease = max_lease_seconds
        self._clock = clock
        self._on_reap = on_reap
        self._on_end = on_end
        self._on_tick = on_tick
        self._owners = itertools.count(1)
        self._sessions: dict[str, Session] = {}
        self._ending: dict[str, Session] = {}
        """Sessions that ended while a copy of theirs ran, until the last one ends: they are
        answered ``SESSION_ENDING``, never ``SESSION_NOT_FOUND``, so "gone" tells a worker
        that nothing of the session can land any more."""
        self._lock = lock("sessions")
        self._stop = threading.Event()
        self._opened = threading.Event()
        """Set by ``open``: a reaper asleep for want of sessions wakes."""
        self._thread: threading.Thread | None = None
        self.reaped_total = 0

    # -- lifecycle -------------------------------------------------------------------------

    def open(self, pool_name: str, pool: HostPool, worker_id: str, attachment: Attachment,
             device_tokens: int, lease_seconds: float = 0.0, peer: Peer | None = None
             ) -> Session:
        lease = lease_seconds if lease_seconds > 0 else self.default_lease
        clamped = lease > self.max_lease
        if clamped:
            log.info("worker %s asked for a %.1fs lease; clamped to %.1fs", worker_id, lease,
                     self.max_lease)
            lease = self.max_lease
        s = Session(session_id=uuid.uuid4().hex, pool_name=pool_name, pool=pool,
                    worker_id=worker_id, lease_seconds=lease, attachment=attachment,
                    device_tokens=device_tokens, expires_at=self._clock() + lease,
                    owner=next(self._owners), lease_clamped=clamped, peer=peer)
        with self._lock:
            self._sessions[s.session_id] = s
        self._opened.set()
        log.info("session %s opened: pool=%s worker=%s lease=%.1fs attached=%d bytes",
                 s.public_id, pool_name, worker_id, lease, attachment.nbytes)
        return s

    def get(self, session_id: str) -> Session:
        with self._lock:
            s = self._sessions.get(session_id)
        if s is None or s.expires_at < self._clock():
            if s is not None:
                self.reap()
            self._check_ending(session_id)
            raise SessionNotFound(f"no open session {session_id!r} (closed or lease expired)",
                                  metadata={"session_id": session_id})
        return s

    def _check_ending(self, session_id: str) -> None:
        """``SESSION_ENDING`` for a session that ended while a copy of it still runs."""
        with self._lock:
            s = self._ending.get(session_id)
        if s is not None:
            raise _ending(s)

    def heartbeat(self, session_id: str) -> Session:
        s = self.get(session_id)
        s.expires_at = self._clock() + s.lease_seconds
        return s

    def close(self, session_id: str) -> None:
        """End a session named by its capability, or by its public id (an operator's
        ``hicachectl close-session``)."""
        asked = session_id  # (an error names what was asked: never a capability for it)
        with self._lock:
            if is_public_id(session_id):
                session_id = next((k for k, v in [*self._sessions.items(),
                                                  *self._ending.items()]
                                   if v.public_id == session_id), session_id)
            s = self._remove(session_id)
        if s is None:
            self._check_ending(session_id)
            raise SessionNotFound(f"no open session {asked!r}",
                                  metadata={"session_id": asked})
        self._end(s, "closed")

    def _remove(self, session_id: str) -> Session | None:
        """Take a session out of the table and into ``_ending`` in one step (our lock
        held), so that no call in between hears it is gone; ``_end`` takes it out of
        ``_ending`` again when no copy of it runs, else its last ``end_copy`` does."""
        s = self._sessions.pop(session_id, None)
        if s is not None:
            self._ending[session_id] = s
        return s

    @contextmanager
    def transfer(self, session_id: str) -> Iterator[Session]:
        """Hold the session's mappings for one copy; the lease counts it as a sign of life.
        A copy that found the worker's memory gone (``BUFFER_FAULT``) ends the session: its
        mappings can no longer be trusted, and no other session is touched."""
        s = self.get(session_id)
        self.begin_copy(s)
        try:
            yield s
        except BufferFault as exc:
            with self._lock:
                ended = self._remove(s.session_id) is not None
            if ended:
                log.warning("session %s (worker %s): %s", s.public_id, s.worker_id, exc)
                self._end(s, "ended: its buffer memory vanished under a copy")
            raise BufferFault(f"{exc.message}; session {s.public_id} ended",
                              metadata={"session_id": s.public_id,
                                        "worker_id": s.worker_id}) from None
        finally:
            s.transfers += 1
            self.end_copy(s)

    def begin_copy(self, s: Session) -> None:
        """A copy uses the session's mappings: they stay until its ``end_copy`` (copies still
        running on a GPU after their RPC returned count too)."""
        with s.lock:
            if s.ended:
                if s.in_flight:
                    raise _ending(s)
                raise SessionNotFound(f"session {s.session_id!r} ended",
                                      metadata={"session_id": s.session_id})
            s.in_flight += 1

    def end_copy(self, s: Session) -> None:
        with s.lock:
            s.in_flight -= 1
            release = self._settle(s)
        s.expires_at = max(s.expires_at, self._clock() + s.lease_seconds)
        if release:
            s.attachment.release()

    def _settle(self, s: Session) -> bool:
        """The session's lock held: an ended session whose last copy is over is told ended
        from now on (not SESSION_ENDING); whether its mappings are to be released now (once,
        by the caller, after the lock)."""
        if not s.ended or s.in_flight:
            return False
        with self._lock:  # lock order: a session's, then ours
            self._ending.pop(s.session_id, None)
        release, s.released = not s.released, True
        return release

    def _end(self, s: Session, why: str) -> None:
        seams.reached("session.removed")
        with s.lock:
            s.ended = True
            release = self._settle(s)
        if release:
            s.attachment.release()
        try:
            self._on_end(s)
        except Exception:  # ending a session must not fail half-way
            log.exception("cleaning up after session %s failed", s.public_id)
        log.info("session %s %s (worker %s, %d transfers)", s.public_id, why, s.worker_id,
                 s.transfers)

    def reap(self) -> list[Session]:
        """End every session whose lease has run out."""
        now = self._clock()
        with self._lock:
            dead = [s for s in self._sessions.values() if s.expires_at < now]
            for s in dead:
                self._remove(s.session_id)
        for s in dead:
            self._end(s, f"reaped: no heartbeat for {s.lease_seconds:.1f}s")
            self.reaped_total += 1
            self._on_reap(s)
        return dead

    # -- queries ---------------------------------------------------------------------------

    def list(self, pool_name: str = "") -> list[Session]:
        with self._lock:
            return [s for s in self._sessions.values() if not pool_name
                    or s.pool_name == pool_name]

    def count(self, pool_name: str = "") -> int:
        return len(self.list(pool_name))

    @property
    def attached_bytes(self) -> int:
        return sum(s.attachment.nbytes for s in self.list())

    @property
    def ending(self) -> int:
        """Sessions ended while a copy of theirs still runs."""
        with self._lock:
            return len(self._ending)

    # -- reaper ----------------------------------------------------------------------------

    def start_reaper(self, interval: float | None = None) -> None:
        period = interval if interval is not None else max(min(self.default_lease / 4, 1.0),
                                                           0.05)

        def loop() -> None:
            while not self._stop.is_set():
                if not self._sessions:  # nothing to reap: asleep until a session opens
                    self._opened.wait()
                    self._opened.clear()
                    continue
                if self._stop.wait(period):
                    return
                try:
                    self.reap()
                    self._on_tick()
                except Exception:  # the reaper must survive anything
                    log.exception("session reaper failed")

        self._thread = threading.Thread(target=loop, name="session-reaper", daemon=True)
        self._thread.start()

    def close_all(self) -> None:
        self._stop.set()
        self._opened.set()
        with self._lock:
            sessions = [s for s in (self._remove(k) for k in list(self._sessions))
                        if s is not None]
        for s in sessions:
            self._end(s, "closed at shutdown")
        if self._thread is not None:
            self._thread.join(timeout=5)


def _ending(s: Session) -> SessionEnding:
    return SessionEnding(f"session {s.public_id} has ended and a copy of it is still running: "
                         "SESSION_NOT_FOUND follows once none is",
                         metadata={"session_id": s.public_id, "copies": s.in_flight,
                                   "retry_after_ms": ENDING_RETRY_MS})
