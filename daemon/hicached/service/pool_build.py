"""Building a pool in the background: a large pool takes minutes to prefault and pin.

``CreatePool`` must not hold its caller (or the registry) that long, so the table starts a
``PoolBuild`` and answers at once: the pool is ``CREATING`` (with progress) until its memory is
mapped, faulted in and pinned, then ``READY``; a build that fails stays ``FAILED`` with its
error until the pool is deleted or created again. Transfers, sessions and cache calls on a pool
that is not ready get ``POOL_NOT_READY`` naming its state.

Primitives:

- ``PoolBuild(spec, make)``: ``start(on_done)`` runs ``make(on_progress)`` on its own thread;
  ``state`` (``CREATING`` / ``FAILED``), ``progress`` (0..1 of the prefault), ``error``,
  ``elapsed``; ``not_ready()`` is the ``PoolNotReady`` to raise for it; ``wait(timeout)``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from hicache.errors import HiCacheError, PoolNotReady
from hicache.pools import CREATING, FAILED
from hicache.specs import PoolSpec
from hicached.core.pool import HostPool

log = logging.getLogger(__name__)



class PoolBuild:
    def __init__(self, spec: PoolSpec, total_bytes: int,
                 make: Callable[[Callable[[int], None]], HostPool]) -> None:
        """``make(on_progress)`` builds the pool, reporting prefaulted bytes."""
        self.spec = spec
        self.total_bytes = max(total_bytes, 1)
        self.done_bytes = 0
        self.error: HiCacheError | None = None
        self.started = time.monotonic()
        self._make = make
        self._done = threading.Event()

    @property
    def state(self) -> str:
        return FAILED if self.error is not None else CREATING

    @property
    def progress(self) -> float:
        return min(self.done_bytes / self.total_bytes, 1.0)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def _advance(self, nbytes: int) -> None:
        self.done_bytes += nbytes  # one writer per chunk; a torn read only skews a figure

    def start(self, on_done: Callable[[PoolBuild, HostPool | None], None]) -> None:
        """Build on a thread; ``on_done(self, pool)`` gets the pool, or None on failure."""
        def run() -> None:
            pool: HostPool | None = None
            try:
                pool = self._make(self._advance)
            except HiCacheError as exc:
                self.error = exc
            except Exception as exc:
                log.exception("building pool %s failed", self.spec.name)
                self.error = HiCacheError(f"building pool {self.spec.name} failed: {exc}")
            try:
                on_done(self, pool)
            finally:
                self._done.set()

        threading.Thread(target=run, name=f"build-{self.spec.name}", daemon=True).start()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def not_ready(self) -> PoolNotReady:
        name = self.spec.name
        if self.error is not None:
            return PoolNotReady(f"pool {name} failed to build: {self.error}; delete it or "
                                "create it again", metadata={
                                    "pool": name, "state": FAILED,
                                    "error_reason": self.error.reason})
        return PoolNotReady(f"pool {name} is still being created ({self.progress:.0%} after "
                            f"{self.elapsed:.1f}s)", metadata={
                                "pool": name, "state": CREATING,
                                "progress": f"{self.progress:.3f}"})
