"""Poll before sleeping: an adaptive window for the fast path's waits.

A thread that blocks in ``recv`` gives its CPU up; when the CPU idles, a virtual machine
whose idle CPUs halt (``guest_halt_poll_ns`` = 0, common) pays a VM exit and an interrupt to
wake it: 40-80 microseconds each side of a request, more than a 1-page request's work. Deep
C-states cost the same on bare metal. Polling the socket for a short window first avoids it
when the bytes come soon, and costs a CPU for the window when they do not.

``AdaptivePoll`` sizes the window as the kernel's haltpoll governor does: after a wait the
window could have covered (the bytes came within ``max_us``) it grows (x2, from 50 us);
after a longer one it shrinks (/2, to 0 below 50 us). A connection whose requests come back
to back polls; an idle one, or one whose calls take milliseconds, sleeps at once.

A wait that slept is longer than the bytes' arrival by the sleep's own wake-up (the cost the
poll saves), so a reply that a poll catches in 130 us can take 300 us when slept for: judged
by slept waits alone, a window at 0 would stay there for good however soon the bytes come.
So a window at 0 probes: after ``PROBE_FIRST`` waits without polling one wait polls for the
largest window; a probe that catches the bytes opens the window to it, one that does not
doubles the waits until the next probe (up to ``PROBE_MAX``). An idle connection spends at
most one largest window per ``PROBE_MAX`` waits on it. The poll
runs in ``hicache._poll`` without the interpreter lock (the process's other threads run
meanwhile), at most ``max_pollers()`` threads of a process poll at once (a quarter of the
CPUs, at least one) and none while more threads of the node want to run than it has CPUs
(the running count of ``/proc/loadavg``, read at most once a millisecond: a poll would take
a CPU from one of them). The rest sleep. Without the native helper nothing polls.

Primitives: ``DEFAULT_MAX_US``, ``GROW_START_NS``, ``PROBE_FIRST``, ``PROBE_MAX``;
``AdaptivePoll(max_us)``: ``wait(fd)`` (before a blocking read; True when the bytes are
there), ``learn(waited_ns, caught)`` (after it), ``window_ns`` and the counters ``polls``,
``caught``, ``polled_ns``, ``busy``, ``probes`` (``counts()``, ``PollCounts``,
``sum_counts``); ``max_pollers()``, ``native_available()``.
"""

from __future__ import annotations

import logging
import os
import time
from types import ModuleType

from hicache.locks import lock

log = logging.getLogger(__name__)

DEFAULT_MAX_US = 200
"""The largest window by default (daemon ``fast_path_spin_us``, client ``spin_us``): a 1-page
request's reply, or a worker's next request in a burst, comes within it on a 2-vCPU VM."""
GROW_START_NS = 50_000
"""The first window after a wait it could have covered (as haltpoll's grow_start)."""

PROBE_FIRST = 8
"""Waits a window at 0 lets pass without polling before it probes with the largest window."""
PROBE_MAX = 1024
"""The most waits between two probes (the gap doubles after each probe that missed)."""

PollCounts = tuple[int, int, int, int]
"""(waits that polled, those the poll caught, ns spent polling, waits not polled: node busy)."""


def sum_counts(*counts: PollCounts) -> PollCounts:
    """Counts of several windows (or totals) added up."""
    return (sum(c[0] for c in counts), sum(c[1] for c in counts), sum(c[2] for c in counts),
            sum(c[3] for c in counts))


_native: ModuleType | None = None
_loaded = False
_load_lock = lock("polling.load")


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

    __slots__ = ("_probe_gap", "_probing", "_unpolled", "_wait", "busy", "caught", "max_ns",
                 "polled_ns", "polls", "probes", "window_ns")

    def __init__(self, max_us: int) -> None:
        """``max_us``: the largest window (0: never poll)."""
        self.max_ns = max_us * 1000
        self.window_ns = 0
        self.polls = 0
        """Waits that polled (probes included)."""
        self.caught = 0
        """Of those, the ones whose bytes came within the window (no sleep)."""
        self.polled_ns = 0
        """Time spent polling: the CPU the polls took."""
        self.busy = 0
        """Waits that did not poll because more threads wanted to run than the node has CPUs."""
        self.probes = 0
        """Waits that polled for the largest window while the window was at 0."""
        self._unpolled = 0  # waits since the window fell to 0 or the last probe
        self._probe_gap = PROBE_FIRST
        self._probing = False
        native = _load() if max_us else None
        self._wait = native.wait_readable if native is not None else None

    def counts(self) -> PollCounts:
        return self.polls, self.caught, self.polled_ns, self.busy

    def wait(self, fd: int) -> bool:
        """Poll ``fd`` for the window (or, as a probe, for the largest one); True when it
        became readable (or closed) in it."""
        if self._wait is None:
            return False
        window = self.window_ns
        if not window:
            self._unpolled += 1
            if self._unpolled < self._probe_gap:
                return False
            self._unpolled, self._probing, window = 0, True, self.max_ns
        t0 = time.monotonic_ns()
        got = self._wait(fd, window)
        if got < 0:  # max_pollers threads poll already (-1), or the node's CPUs are all
            self.busy += got == -2  # wanted (-2): sleep
            self._probing = False
            return False
        self.polls += 1
        self.probes += self._probing
        self.polled_ns += time.monotonic_ns() - t0
        if got:
            self.caught += 1
        return bool(got)

    def learn(self, waited_ns: int, caught: bool) -> None:
        """After a wait of ``waited_ns`` (poll and sleep) that the poll ``caught`` or not."""
        if not self.max_ns:
            return
        if self._probing:  # the largest window tried while at 0: open it, or probe less often
            self._probing = False
            if caught:
                self.window_ns, self._probe_gap = self.max_ns, PROBE_FIRST
            else:
                self._probe_gap = min(PROBE_MAX, 2 * self._probe_gap)
            return
        if caught:
            return
        if waited_ns <= self.max_ns:  # a window this long would have caught it: grow
            self.window_ns = min(self.max_ns, max(GROW_START_NS, self.window_ns * 2))
            self._probe_gap = PROBE_FIRST
        elif self.window_ns:  # longer than any window: shrink
            half = self.window_ns // 2
            self.window_ns = half if half >= GROW_START_NS else 0
            self._unpolled = 0
