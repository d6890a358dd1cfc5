"""The data path's bound, shared by the gRPC server and the fast path.

Primitives:

- ``DataGate(limit)``: at most ``limit`` data calls (transfers, Store, LoadKeys, Lookup) run
  at once over both paths together; ``enter()`` past it raises ``OVERLOADED`` at once with a
  retry hint (never a queue), ``leave()`` gives the slot back; ``in_flight`` now.
- ``ByteBudget(limit)``: bytes of fast-path frames being read, over every connection:
  ``take(n, deadline)`` waits until ``n`` more fit (False once the monotonic ``deadline``
  passed), ``give(n)`` returns them; ``in_use`` now. A frame's reader takes what its buffer
  grows by, so a stalled sender holds only what it sent.
- ``RETRY_AFTER_MS``: the hint.
"""

from __future__ import annotations

import time

from hicache.errors import Overloaded
from hicache.locks import condition, lock

RETRY_AFTER_MS = 10
"""The retry hint of an OVERLOADED refusal: about one batch's time on a busy node."""


class DataGate:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self._lock = lock("admission")

    def enter(self) -> None:
        """Take a slot, or ``OVERLOADED`` when all ``limit`` are taken."""
        with self._lock:
            busy = self.in_flight
            if busy < self.limit:
                self.in_flight = busy + 1
                return
        raise Overloaded(f"{busy} transfers in flight, the data path's limit; retry in "
                         f"{RETRY_AFTER_MS} ms",
                         metadata={"in_flight": busy, "limit": self.limit,
                                   "retry_after_ms": RETRY_AFTER_MS})

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1


class ByteBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0
        self._cond = condition("admission.bytes")

    def take(self, n: int, deadline: float) -> bool:
        """Reserve ``n`` bytes, waiting for others to give theirs back until ``deadline``
        (``time.monotonic``); False (nothing taken) when they do not fit by then. ``n`` over
        the whole limit never fits."""
        with self._cond:
            while self.in_use + n > self.limit:
                left = deadline - time.monotonic()
                if left <= 0 or n > self.limit:
                    return False
                self._cond.wait(left)
            self.in_use += n
            return True

    def give(self, n: int) -> None:
        if n:
            with self._cond:
                self.in_use -= n
                self._cond.notify_all()
