"""The data path's bound, shared by the gRPC server and the fast path.

Primitives:

- ``DataGate(limit)``: at most ``limit`` data calls (transfers, Store, LoadKeys, Lookup) run
  at once over both paths together; ``enter()`` past it raises ``OVERLOADED`` at once with a
  retry hint (never a queue), ``leave()`` gives the slot back; ``in_flight`` now.
- ``RETRY_AFTER_MS``: the hint.
"""

from __future__ import annotations

import threading

from hicache.errors import Overloaded

RETRY_AFTER_MS = 10
"""The retry hint of an OVERLOADED refusal: about one batch's time on a busy node."""


class DataGate:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self._lock = threading.Lock()

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
