"""An engine adapter's book of holds: how long a held Lookup's answer is trusted, which
requests count on each held key, and the one thread that lets holds go.

A worker asks the daemon to *hold* a Lookup's hit for its session (``hold_ms``) so that the
LoadKeys after it finds the pages there: a hit told to the engine is a promise. The engines ask
differently (SGLang once per request with all its keys, vLLM block by block), but the promise
and its rules are the same, and live here once:

- **Freshness**: an answer is trusted while it is younger than ``FRESH_SHARE`` of the hold.
  The daemon keeps a hold for ``hold_ms`` from the Lookup's arrival; the rest is margin for
  the engine's own delay between the answer and the load it schedules. An older answer is
  asked again (the Lookup renews the hold).
- **Claims**: each request whose answer held a key *claims* it; a key is released
  (``ReleaseHolds``) only when no request claims it any more, so one request's end never
  takes a hold from under another's load. A request's claims end when the adapter says so
  (``drop``): its load declined or cancelled, or the request finished. Keys its LoadKeys
  consumed (the daemon ends a hold a load used) are dropped without a release.
- **One release thread**: releases go to the book's own thread, in order; the engine's
  scheduler never waits for the daemon there. A release that fails is logged (holds expire
  by themselves). The adapter's other calls that no one waits for (vLLM's touches) run
  there too (``later``), in order with the releases.

Thread-safe (one lock); ``release``'s callables run on the release thread only.

Primitives:

- ``FRESH_SHARE``; ``HoldBook(hold_ms, release, name)``: ``window`` (seconds an answer is
  trusted), ``fresh(at)``, ``claim(req, keys)``, ``drop(req, consumed=())`` (the keys now
  unclaimed, released), ``let_go(keys)`` (those no request claims, released),
  ``drop_all(keep)`` (every claim of requests ``keep`` does not name; returns the keys
  unclaimed, not released), ``claims(req)``, ``claimed`` (keys with a claim),
  ``release(keys, how=None)`` (on the release thread), ``later(fn)`` (``fn()`` there, after
  what was queued before), ``settle(timeout)`` (the releases queued so far made),
  ``close()``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from typing import Any

from hicache.locks import lock

log = logging.getLogger("hicache_client.holds")

FRESH_SHARE = 0.5
"""The share of a hold during which its answer is trusted (the rest: the engine's delay from
answer to load, and the call's own time)."""

Release = Callable[[list[Any]], object]


class HoldBook:
    def __init__(self, hold_ms: int, release: Release, name: str = "hicache-holds") -> None:
        """``hold_ms``: the holds the adapter asks for (0: none, no answer is ever fresh);
        ``release(keys)``: end this worker's holds of ``keys`` (may raise); ``name``: the
        release thread's."""
        self.window = hold_ms / 1000 * FRESH_SHARE
        """Seconds an answer is trusted."""
        self._release = release
        self._lock = lock("hold_book")
        self._by_request: dict[Hashable, set[Any]] = {}
        self._claims: dict[Any, int] = {}
        """key -> requests claiming its hold."""
        self._queue: queue.Queue[tuple[Release, list[Any]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    # -- answers -------------------------------------------------------------------------

    def fresh(self, at: float) -> bool:
        """Whether an answer given at ``at`` (``time.monotonic()``) is still trusted."""
        return time.monotonic() - at < self.window

    # -- claims --------------------------------------------------------------------------

    def claim(self, req: Hashable, keys: Iterable[Any]) -> None:
        """``req`` counts on the holds of ``keys`` (a key it claims already: unchanged)."""
        with self._lock:
            mine = self._by_request.setdefault(req, set())
            for k in keys:
                if k not in mine:
                    mine.add(k)
                    self._claims[k] = self._claims.get(k, 0) + 1

    def drop(self, req: Hashable, consumed: Collection[Any] = ()) -> list[Any]:
        """``req``'s claims end; the keys no request claims any more are released (those in
        ``consumed`` aside: a load used their holds) and returned."""
        with self._lock:
            free = self._unclaim(self._by_request.pop(req, ()))
        if consumed:
            free = [k for k in free if k not in consumed]
        if free:
            self.release(free)
        return free

    def let_go(self, keys: Iterable[Any]) -> list[Any]:
        """Holds no request counts on (a lookup answered for a request that ended meanwhile):
        those of ``keys`` that no request claims are released, and returned."""
        with self._lock:
            free = [k for k in dict.fromkeys(keys) if k not in self._claims]
        if free:
            self.release(free)
        return free

    def drop_all(self, keep: Callable[[Hashable], bool]) -> list[Any]:
        """Every request's claims end but those ``keep(req)`` names (a load in flight); the
        keys no request claims any more are returned, not released (the caller decides)."""
        with self._lock:
            gone = [req for req in self._by_request if not keep(req)]
            free: list[Any] = []
            for req in gone:
                free.extend(self._unclaim(self._by_request.pop(req)))
        return free

    def claims(self, req: Hashable) -> frozenset[Any]:
        with self._lock:
            return frozenset(self._by_request.get(req, ()))

    @property
    def claimed(self) -> int:
        """Keys some request claims."""
        return len(self._claims)

    def _unclaim(self, keys: Iterable[Any]) -> list[Any]:
        free = []
        for k in keys:
            n = self._claims.get(k, 0) - 1
            if n <= 0:
                self._claims.pop(k, None)
                free.append(k)
            else:
                self._claims[k] = n
        return free

    # -- the release thread --------------------------------------------------------------

    def release(self, keys: Sequence[Any], how: Release | None = None) -> None:
        """End holds of ``keys`` on the release thread, by ``how`` (default: the book's
        ``release``)."""
        if keys:
            self._queue.put((how or self._release, list(keys)))

    def later(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` on the release thread after what was queued before it (a call to
        the daemon the caller must not wait for); an exception it raises is logged."""
        self._queue.put((lambda _: fn(), []))

    def settle(self, timeout: float = 5.0) -> bool:
        """Wait until the releases queued so far were made (False: ``timeout`` passed)."""
        done = threading.Event()
        self._queue.put((lambda _: done.set(), []))
        return done.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Releases queued so far are made (within ``timeout``), then the thread ends."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            how, keys = item
            try:
                how(keys)
            except Exception as exc:  # holds expire by themselves; a touch is a hint
                log.debug("a call on the release thread (%d key(s)) failed: %s", len(keys),
                          exc)
