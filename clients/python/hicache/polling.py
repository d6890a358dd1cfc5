"""Poll before sleeping: an adaptive window for the fast path's waits.

A thread that blocks in ``recv`` gives its CPU up; when the CPU idles, a virtual machine
whose idle CPUs halt (``guest_halt_poll_ns`` = 0, common) pays a VM exit and an interrupt to
wake it: 40-80 microseconds each side of a request, more than a 1-page request's work. Deep
C-states cost the same on bare metal. Polling the socket for a short window first avoids it
when the bytes come soon, and costs a CPU for the window when they do not.

``AdaptivePoll`` sizes the window as the kernel's haltpoll governor does: after a wait the
window could have covered (the bytes came within ``max_us``) it grows (x2, from 50 us);
after a longer one it shrinks (/2, to 0 below 50 us). A connection whose requests come back
to back polls; an idle one, or one whose calls take milliseconds, sleeps at once. The poll
runs in ``hicache._poll`` without the interpreter lock (the process's other threads run
meanwhile), at most ``max_pollers()`` threads of a process poll at once (a quarter of the
CPUs, at least one) and none while more threads of the node want to run than it has CPUs
(the running count of ``/proc/loadavg``, read at most once a millisecond: a poll would take
a CPU from one of them). The rest sleep. Without the native helper nothing polls.

Primitives: ``DEFAULT_MAX_US``; ``AdaptivePoll(max_us)``: ``wait(fd)`` (before a blocking
read; True when the bytes are there), ``learn(waited_ns, caught)`` (after it), ``window_ns``
and the counters ``polls``, ``caught``, ``polled_ns``, ``busy`` (``counts()``, ``PollCounts``,
``sum_counts``); ``max_pollers()``, ``native_available()``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from types import ModuleType

log = logging.getLogger(__name__)

DEFAULT_MAX_US = 200
"""The largest window by default (daemon ``fast_path_spin_us``, client ``spin_us``): a 1-page
request's reply, or a worker's next request in a burst, comes within it on a 2-vCPU VM."""
GROW_START_NS = 50_000
"""The first window after a wait it could have covered (as haltpoll's grow_start)."""

PollCounts = tuple[int, int, int, int]
"""(waits that polled, those the poll caught, ns spent polling, waits not polled: node busy)."""


def sum_counts(*counts: PollCounts) -> PollCounts:
    """Counts of several windows (or totals) added up."""
    return (sum(c[0] for c in counts), sum(c[1] for c in counts), sum(c[2] for c in counts),
            sum(c[3] for c in counts))


_native: ModuleType | None = None
_loaded = False
_load_lock = threading.Lock()


def max_pollers() -> int:
    """Threads of one process that poll at once: a quarter of its CPUs, at least one."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, cpus // 4)


def _load() -> ModuleType | None:
    """The native helper, loaded on first use (importing this package loads no extension)."""
    global _native, _loaded
    with _load_lock:
        if not _loaded:
            try:
                from hicache import _poll  # type: ignore[attr-defined]

                _poll.set_max_pollers(max_pollers())
                _native = _poll
            except ImportError:
                log.warning("hicache._poll is not built: fast-path waits sleep at once")
            _loaded = True
    return _native


def native_available() -> bool:
    return _load() is not None


class AdaptivePoll:
    """One connection's poll window (one thread uses it at a time)."""

    __slots__ = ("_wait", "busy", "caught", "max_ns", "polled_ns", "polls", "window_ns")

    def __init__(self, max_us: int) -> None:
        """``max_us``: the largest window (0: never poll)."""
        self.max_ns = max_us * 1000
        self.window_ns = 0
        self.polls = 0
        """Waits that polled."""
        self.caught = 0
        """Of those, the ones whose bytes came within the window (no sleep)."""
        self.polled_ns = 0
        """Time spent polling: the CPU the polls took."""
        self.busy = 0
        """Waits that did not poll because more threads wanted to run than the node has CPUs."""
        native = _load() if max_us else None
        self._wait = native.wait_readable if native is not None else None

    def counts(self) -> PollCounts:
        return self.polls, self.caught, self.polled_ns, self.busy

    def wait(self, fd: int) -> bool:
        """Poll ``fd`` for the window; True when it became readable (or closed) in it."""
        if not self.window_ns or self._wait is None:
            return False
        t0 = time.monotonic_ns()
        got = self._wait(fd, self.window_ns)
        if got < 0:  # max_pollers threads poll already (-1), or the node's CPUs are all
            self.busy += got == -2  # wanted (-2): sleep
            return False
        self.polls += 1
        self.polled_ns += time.monotonic_ns() - t0
        if got:
            self.caught += 1
        return bool(got)

    def learn(self, waited_ns: int, caught: bool) -> None:
        """After a wait of ``waited_ns`` (poll and sleep) that the poll ``caught`` or not."""
        if caught or not self.max_ns:
            return
        if waited_ns <= self.max_ns:  # a window this long would have caught it: grow
            self.window_ns = min(self.max_ns, max(GROW_START_NS, self.window_ns * 2))
        elif self.window_ns:  # longer than any window: shrink
            half = self.window_ns // 2
            self.window_ns = half if half >= GROW_START_NS else 0
