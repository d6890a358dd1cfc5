"""Named points between the steps of flows whose correctness depends on what may happen in
between, where a test stops one side while another acts.

Code that races calls ``reached(name)`` between two steps: one dictionary lookup while nothing
is registered. A test registers a hook at a point and then drives the other side itself, so
that an interleaving that is rare under load happens every time:

- ``hooked(name, fn)``: ``fn()`` runs in the thread that reaches ``name`` (for as long as the
  context is open).
- ``Pause(name)``: the first thread to reach ``name`` waits there: ``wait_reached(timeout)``
  tells the test it is there, ``release()`` lets it go (so does leaving the context).

For stress runs of whole processes, ``HICACHE_SEAM_DELAYS`` (``name=microseconds,...``, read
once at import) makes every thread that reaches a point sleep there: a window that lasts
microseconds in production lasts long enough for real concurrent clients to hit it. Unset in
production; a name it does not know is an error at start-up.

The points (``POINTS`` lists them, with what lies on either side):
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from hicache.locks import lock

POINTS = {
    "raw.checked": "a raw Backup / Load: its pages validated, not yet held for the copy",
    "load_keys.resolved": "a LoadKeys: keys resolved and their pages held, the copy not begun",
    "store.taken": "a Store: pages taken for its keys, the copy not begun",
    "store.copied": "a Store: its pages copied, not yet kept (ready) or dropped",
    "spill.written": "a spiller: a page written below, the write not yet committed",
    "promote.read": "a promotion: a page read from below into host memory, not yet ready",
    "cluster.borrowed": "the cluster writer: pages borrowed, the put not begun",
    "cluster.put": "the cluster writer: a batch put, not yet recorded as put",
    "lookup.chunk": "a long Lookup: a chunk of its keys checked, the pool's lock let go before "
                    "the next",
    "budget.grow_reserving": "a Store's growth: its room taken from the budget's slack, its "
                             "pages being reserved (locked, fallocated) with no budget lock "
                             "held, its limit not yet raised",
    "budget.reserved": "a growth (a Store's, a rebalance's): its pages reserved with no "
                       "budget lock held, the limit not yet raised",
    "lookup.hold": "a Lookup that holds its hit: its session found live, the pool's lock not "
                   "yet taken to hold",
    "kv_events.turn": "the KV event publisher: awake, its queue not yet published",
    "session.removed": "a session's end: out of the open sessions' table, its end (mappings, "
                       "raw pages, whether a copy still runs) not yet settled",
    "resize.moved": "a pool being shrunk: its keys evicted and moved, its limit not yet set "
                    "where it ends (above the size asked for where pages are in use)",
}

_hooks: dict[str, Callable[[], None]] = {}


def _delays_from_env() -> None:
    import functools
    import os
    import time

    spec = os.environ.get("HICACHE_SEAM_DELAYS", "")
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, us = item.partition("=")
        if name not in POINTS:
            raise ValueError(f"HICACHE_SEAM_DELAYS names no seam {name!r}; known: "
                             f"{sorted(POINTS)}")
        _hooks[name] = functools.partial(time.sleep, int(us) / 1e6)


_delays_from_env()


def reached(name: str) -> None:
    """Called by the code at point ``name``; runs the hook a test registered there, if any."""
    hook = _hooks.get(name)
    if hook is not None:
        hook()


@contextmanager
def hooked(name: str, fn: Callable[[], None]) -> Iterator[None]:
    """Run ``fn`` wherever ``name`` is reached while the context is open."""
    if name not in POINTS:
        raise KeyError(f"no seam {name!r}; known: {sorted(POINTS)}")
    _hooks[name] = fn
    try:
        yield
    finally:
        _hooks.pop(name, None)


class Pause:
    """The first thread to reach the point waits there until ``release``."""

    def __init__(self, name: str, times: int = 1) -> None:
        self.name = name
        self._left = times
        self._lock = lock("seams.pause")
        self._here = threading.Event()
        self._go = threading.Event()
        self._context = hooked(name, self._hook)

    def _hook(self) -> None:
        with self._lock:
            if self._left <= 0:
                return
            self._left -= 1
        self._here.set()
        self._go.wait(60)

    def wait_reached(self, timeout: float = 10.0) -> bool:
        return self._here.wait(timeout)

    def release(self) -> None:
        self._go.set()

    def __enter__(self) -> Pause:
        self._context.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        self._context.__exit__(None, None, None)
