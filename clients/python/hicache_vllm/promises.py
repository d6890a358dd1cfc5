"""What the daemon promised the scheduler: batched, held lookups and the claims on their holds.

vLLM asks one block at a time (``lookup(key)``) on its scheduler's thread; a round trip per
block would cost that thread a millisecond per 16 blocks. So a request's first key is looked up
at once together with every key vLLM recorded after it for the request (its prefix order), in
one ``Lookup`` per pool (every rank's pool: a block is a hit only when each holds it) that
*holds* the hit for the manager's sessions, and the rest of the scan reads the answers: a hit
only for held blocks, so a HIT is a promise that ``prepare_load`` can keep (vLLM cannot be
told of a failed load), and a request is answered, hit or miss, in the step it is scanned.
A key not among those answered is *asked*: the scheduler hears ``RETRY`` (vLLM keeps
scanning the request's keys, then defers it a step), and at the end of the step (``flush``,
from vLLM's ``on_schedule_end``) the keys each request asked go as one ``Lookup`` per pool.
Lookups run on the scheduler's thread, each bounded by the link's deadline (a daemon that
misses it is skipped until it answers again): a thread of their own would wait for the
interpreter lock behind a scheduler that steps without pause, for milliseconds, where the call
itself takes tens of microseconds.

The holds follow ``hicache_client.hold_book`` (the SGLang linker's rules too): a held key
may be claimed by several requests; the hold is released (``ReleaseHolds``, on the book's
thread: nothing waits for it) when no request claims it any more: the request finished and
its loads completed. An answer older than the book's window is asked again (the daemon
refreshes the hold), and so is a miss answered before this engine's latest store.
A request vLLM looks up again after one of its loads completed (that load was given up and
vLLM recomputes, or the request was preempted) is asked afresh, never answered from before
the load; past ``LOADS_PER_REQUEST`` loads its keys are misses (a load that keeps failing
must not keep the request from computing).

Primitives:

- ``Promises(book, lookup)``: ``book`` the manager's ``HoldBook`` (claims, freshness,
  releases); ``lookup`` is ``(keys) -> held prefix length`` (may raise: every key a miss).
- ``answer(req_id, key, following)``: True (held), False (miss) or None (asked: say RETRY).
- ``flush()``: look up the keys asked this step; ``pending``: keys asked and not looked up.
- ``stored()``: this engine stored blocks (misses answered before are asked again).
- ``loading(req_id, keys)`` / ``loaded(req_id)``: a load in flight keeps its claims.
- ``finished(req_id)``: the request's claims end (once its loads are done).
- ``forget_all()``: every answer and every lookup asked dropped (a reset); returns the held
  keys no load in flight claims (the caller releases them: the claims are gone).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from hicache.locks import lock
from hicache_client.hold_book import HoldBook

log = logging.getLogger("hicache_vllm")

MAX_REQUESTS = 65536
"""Requests whose answers are kept (beyond it the oldest unloaded ones are forgotten)."""

LOADS_PER_REQUEST = 2
"""Loads one request is offered; vLLM asks again only after a load failed (or the request
was preempted): past this many, the request's keys are misses and it computes them."""


@dataclass
class _Request:
    asked: list[bytes] = field(default_factory=list)
    """Keys to ask in the next batch."""
    answers: dict[bytes, bool] = field(default_factory=dict)
    at: float = 0.0
    generation: int = 0
    """The store generation its answers were asked in (a miss then may be a hit now)."""
    loads: int = 0
    loaded: int = 0
    """Loads of it that completed (any lookup after one is asked afresh)."""
    finished: bool = False


class Promises:
    def __init__(self, book: HoldBook, lookup: Callable[[list[bytes]], int]) -> None:
        self.book = book
        self._lookup = lookup
        self._lock = lock("vllm.promises")
        self._requests: dict[str, _Request] = {}
        self._asked: set[str] = set()
        self.generation = 0
        """Bumped by ``stored``: misses answered before it are asked again."""
        self.stats = {"lookups": 0, "lookup_failures": 0, "held_blocks": 0, "miss_blocks": 0,
                      "deferred": 0, "reload_misses": 0}

    # -- the scheduler's thread (waits only in lookups, each within its deadline) ----------

    def answer(self, req_id: str, key: bytes,
               following: Callable[[], list[bytes]] | None = None) -> bool | None:
        """``following``: the request's keys from ``key`` on, in prefix order, where the
        caller knows them (all looked up with ``key``, in one ``Lookup``)."""
        with self._lock:
            r = self._requests.get(req_id)
            if r is None:
                r = self._requests[req_id] = _Request()
                self._trim()
            if r.loaded >= LOADS_PER_REQUEST and not r.loads:
                self.stats["reload_misses"] += 1
                return False
            got = r.answers.get(key)
            if got is not None and (r.loads or (
                    self.book.fresh(r.at) and (got or r.generation == self.generation))):
                return got
            if got is not None:  # stale: ask again (the Lookup refreshes the holds)
                r.answers.clear()
            probe = not r.answers and not r.asked
            if not probe:
                if key not in r.asked:
                    r.asked.append(key)
                self._asked.add(req_id)
                self.stats["deferred"] += 1
                return None
        # the first key of a request: asked now, with every key after it that vLLM recorded
        # for the request, so a miss and a hit alike are answered in this step; keys not
        # among them are batched at the step's end
        keys = following() if following is not None else []
        self._answer(req_id, keys if keys[:1] == [key] else [key])
        with self._lock:
            r = self._requests.get(req_id)
            return bool(r is not None and r.answers.get(key))

    def flush(self) -> None:
        """Look up what each request asked this step (on the caller's thread)."""
        with self._lock:
            batches = [(req_id, self._requests[req_id].asked) for req_id in self._asked
                       if req_id in self._requests and self._requests[req_id].asked]
            for req_id, _ in batches:
                self._requests[req_id].asked = []
            self._asked.clear()
        for req_id, keys in batches:
            self._answer(req_id, keys)

    @property
    def pending(self) -> bool:
        return bool(self._asked)

    def stored(self) -> None:
        """This engine stored blocks: a miss answered before may be a hit now."""
        self.generation += 1

    def loading(self, req_id: str, keys: Iterable[bytes]) -> None:
        with self._lock:
            r = self._requests.setdefault(req_id, _Request())
            r.loads += 1

    def loaded(self, req_id: str) -> None:
        with self._lock:
            r = self._requests.get(req_id)
            if r is None:
                return
            r.loads = max(r.loads - 1, 0)
            r.loaded += 1
            r.answers.clear()  # a lookup after this one asks the daemon again
            if r.finished and not r.loads:
                self._end(req_id)

    def finished(self, req_id: str) -> None:
        with self._lock:
            r = self._requests.get(req_id)
            if r is None:
                return
            r.finished = True
            if not r.loads:
                self._end(req_id)

    def forget_all(self) -> list[bytes]:
        with self._lock:
            self._asked.clear()
            for r in self._requests.values():
                r.answers.clear()
                r.asked = []
            loading = {req_id for req_id, r in self._requests.items() if r.loads}
            # a load in flight keeps its holds until it completes
            return self.book.drop_all(loading.__contains__)

    # -- books (under the lock) ------------------------------------------------------------

    def _end(self, req_id: str) -> None:
        self._requests.pop(req_id)
        self.book.drop(req_id)

    def _trim(self) -> None:
        if len(self._requests) <= MAX_REQUESTS:
            return
        for req_id, r in list(self._requests.items())[:len(self._requests) - MAX_REQUESTS]:
            if not r.loads:
                self._end(req_id)

    # -- lookups and releases -------------------------------------------------------------

    def _answer(self, req_id: str, keys: list[bytes]) -> None:
        generation = self.generation
        try:
            held = self._lookup(keys)
            self.stats["lookups"] += 1
        except Exception as exc:
            self.stats["lookup_failures"] += 1
            log.debug("lookup for %s failed: %s", req_id, exc)
            held = 0
        self.stats["held_blocks"] += held
        self.stats["miss_blocks"] += len(keys) - held
        with self._lock:
            r = self._requests.get(req_id)
            if r is None or r.finished:  # it ended meanwhile: what no one claims goes
                self.book.let_go(keys[:held])
                return
            self.book.claim(req_id, keys[:held])
            r.at = time.monotonic()
            r.generation = generation
            for i, k in enumerate(keys):
                r.answers[k] = i < held
