"""The one background writer of the tiers below host memory: a thread that runs batches,
backs off while its tier fails, and says so.

Disk spill, cluster spill and write-through are each a ``TierWriter``: the subclass writes one
batch (``_batch``) and says what came of it; this class runs it on its own thread, waits for
work when there is none, and when a batch failed (the tier refused with an error: a full
disk, an unreachable store) waits before the next, twice as long each time up to a cap,
back to no wait once a batch succeeds. A failing tier thus costs a few calls a second at most,
never a core, and writes its failure to the log once per ``LOG_INTERVAL_SECONDS``
(with a count of what was held back), never once per try.

Primitives:

- ``IDLE`` / ``WROTE`` / ``STOP`` / ``Failed(why)``: what a batch came to.
- ``BackOff(first_seconds, max_seconds)``: ``next()`` the next delay (doubling, capped),
  ``reset()``, ``delay``.
- ``TierWriter(pool, tier, backoff)``: ``start()``, ``nudge()`` (work arrived), ``close()``;
  ``failing`` (the last batch failed), ``failures`` (batches failed in a row),
  ``last_error``. Subclasses give ``_batch()``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from enum import Enum

from hicache.log_limit import LimitedLog

log = logging.getLogger(__name__)

IDLE_WAIT_SECONDS = 1.0
"""How long a writer with nothing to write sleeps before it looks again (``nudge`` wakes it)."""
FIRST_RETRY_SECONDS = 0.1
MAX_RETRY_SECONDS = 5.0
"""The longest wait between two tries of a failing tier: how soon it is used again once it
recovers."""
LOG_INTERVAL_SECONDS = 30.0


class Outcome(Enum):
    IDLE = "idle"
    """Nothing to write."""
    WROTE = "wrote"
    """Something was written (the tier works; some keys may have failed alone)."""
    STOP = "stop"
    """The pool is gone: the thread ends."""


IDLE, WROTE, STOP = Outcome.IDLE, Outcome.WROTE, Outcome.STOP


@dataclass(frozen=True)
class Failed:
    """The tier refused the whole batch with an error."""

    why: str


class BackOff:
    def __init__(self, first_seconds: float = FIRST_RETRY_SECONDS,
                 max_seconds: float = MAX_RETRY_SECONDS) -> None:
        self.first, self.max = first_seconds, max_seconds
        self.delay = 0.0

    def next(self) -> float:
        self.delay = min(max(self.delay * 2, self.first), self.max)
        return self.delay

    def reset(self) -> None:
        self.delay = 0.0


_limited = LimitedLog(log, LOG_INTERVAL_SECONDS)


class TierWriter:
    def __init__(self, pool: str, tier: str, backoff: BackOff | None = None) -> None:
        """``pool``, ``tier``: what the writer writes for and to (``disk``, ``cluster``), for
        its thread's name, its log lines and ``hicache_tier_failing{pool, tier}``."""
        self.pool_name, self.tier_name = pool, tier
        self.backoff = backoff or BackOff()
        self.failing = False
        self.failures = 0
        self.last_error = ""
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"{tier}-writer-{pool}")

    def _batch(self) -> Outcome | Failed:
        """Write one batch (subclasses)."""
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def nudge(self) -> None:
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            got = self._batch()
            if got is STOP:
                return
            if got is IDLE:
                self._wake.wait(IDLE_WAIT_SECONDS)
                self._wake.clear()
            elif isinstance(got, Failed):
                self._failed(got.why)
            else:
                self._worked()

    def _failed(self, why: str) -> None:
        self.failing, self.last_error = True, why
        self.failures += 1
        delay = self.backoff.next()
        _limited.warning("%s tier of pool %s failing (%d batch(es) in a row): %s; next try in "
                         "%.1f s", self.tier_name, self.pool_name, self.failures, why, delay,
                         key=f"{self.tier_name} {self.pool_name}")
        self._stop.wait(delay)  # not woken by new work: the tier, not the queue, is the limit

    def _worked(self) -> None:
        if self.failing:
            log.warning("%s tier of pool %s works again after %d failed batch(es)",
                        self.tier_name, self.pool_name, self.failures)
        self.backoff.reset()  # before ``failing`` clears: whoever sees it clear sees this
        self.failures = 0
        self.failing = False
