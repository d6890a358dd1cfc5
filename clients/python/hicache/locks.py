"""hicached's locks, made by name, and the checker of their written order.

Every lock of the daemon, of the workers' libraries (the client, the SGLang and vLLM
linkers) and of this package is made here and named for what it guards; ``ORDER`` lists the
names from outermost to innermost, and ``docs/architecture.md`` ("Lock order") explains it.
A thread holding a lock may take only a lock listed after it: two threads can then never
each wait for what the other holds.

Normally a name costs nothing: ``lock(name)`` returns a plain ``threading.Lock``. After
``check_order(report)`` (called on import when ``HICACHED_CHECK_LOCK_ORDER`` names a
directory, so in a daemon, a worker or an engine server alike; the test suite sets it for
its own process and every process it starts), each lock made is a ``CheckedLock``: it keeps,
per thread, the locks held, and a blocking take of a lock not after each of them in
``ORDER`` is an inversion, recorded once per pair of names (with where it happened) in
``inversions()`` and in ``report`` at once (a daemon killed a moment later has still told
it). The order is checked when it is broken, not only when a deadlock happens: Linux's
lockdep and SQLite's written order do the same.

Primitives: ``ORDER``, ``lock(name)``, ``condition(name_or_lock)``, ``check_order(report)``,
``checking()``, ``inversions()``, ``CheckedLock``, ``ENV_CHECK_LOCK_ORDER``.
"""

from __future__ import annotations

import os
import threading
import traceback
from pathlib import Path

ORDER: tuple[str, ...] = (
    # the daemon's lifecycle: a drain begins before anything it stops
    "server.drain",
    # pools: their creation, then the table
    "pool_table.creating",
    "pool_table",
    # sessions: one session's own state, then the table (a session's end is told under it)
    "session",
    "sessions",
    # the daemon's gate: calls in flight (a drain waits for them) and event-stream slots
    "daemon.gate",
    # admission of data calls
    "admission",
    "admission.bytes",
    # one pool's cache: its key index, then the budget a growth asks under it
    "pool_cache",
    "budget",
    # the tiers below the cache: the cluster's write queue, then what each tier holds
    "tier.cluster_writer",
    "tier.cluster",
    "tier.mooncake",
    "tier.mooncake_replicas",
    "tier.disk",
    # what a tier or the cache tells: the chains, then the event ring
    "chains",
    "events",
    # the pool's memory: its state, the allocator, the pinned units, the canary
    "pool",
    "allocator",
    "pin_units",
    "canary",
    # moving bytes: a worker's mappings, then the CUDA ways and their tables
    "cuda_ipc.attachment",
    "cuda_ipc.copies",
    "cuda_ipc.mappings",
    "cuda_vmm.mappings",
    "cuda.paths",
    "cuda.runner.tables",
    "cuda.launch",
    "cuda.kernels",
    "cuda.nvrtc",
    "cuda.nvrtc.load",
    # front ends and publishers: each guards only its own books
    "fast_path",
    "identity_channel",
    "kv_events",
    "kv_channel",
    # leaves of the daemon: counters nothing is taken under
    "daemon.landing",
    "metrics.outcomes",
    "tallies",
    # the workers' libraries: a client's fast path set up once, its async calls' threads,
    # then a session link's fence and its state
    "client.fast_path",
    "client.async",
    "link.fencing",
    "link",
    # the engines' books: SGLang's quarantined slots, vLLM's transfer queues, promises and
    # the manager's counters; the holds a client keeps
    "sglang.quarantine",
    "vllm.worker",
    "vllm.promises",
    "vllm.manager.events",
    "vllm.manager.touch",
    "vllm.manager.stats",
    "hold_book",
    "fast_path.client",
    # this package's, taken by the daemon and the workers alike, under any of the above
    "cuda_driver.load",
    "cuda_driver",
    "polling.load",
    "seams.pause",
    "log_limit",
)
"""Every lock's name, outermost first: holding one, a thread takes only those after it."""

ENV_CHECK_LOCK_ORDER = "HICACHED_CHECK_LOCK_ORDER"
"""A directory: check every lock made from then on against ``ORDER`` and write each inversion
there (the test suite sets it; a checked take costs about a microsecond, so not for
production)."""

_RANK = {name: i for i, name in enumerate(ORDER)}
if len(_RANK) != len(ORDER):
    raise ImportError("a lock name is listed twice in ORDER")

MAX_INVERSIONS = 256
"""Distinct inversions kept (each pair of names once): the checker's memory is bounded."""

_state = threading.local()
_books = threading.Lock()  # the checker's own books: taken last, under anything, unchecked
_report: Path | None = None
_checking = False
_seen: dict[tuple[str, str], str] = {}


def check_order(report: str | os.PathLike[str] | None = None) -> None:
    """From now on, locks made are checked against ``ORDER``; inversions are appended to
    ``report`` (a directory: one ``lock-order-PID.txt`` per process) as they happen."""
    global _report, _checking
    if report is not None:
        Path(report).mkdir(parents=True, exist_ok=True)
        _report = Path(report) / f"lock-order-{os.getpid()}.txt"
    _checking = True


def checking() -> bool:
    """Whether locks made now are checked."""
    return _checking


def inversions() -> dict[tuple[str, str], str]:
    """(held, taken) -> where it was first taken out of order, in this process."""
    with _books:
        return dict(_seen)


def _held() -> list[CheckedLock]:
    held: list[CheckedLock] | None = getattr(_state, "held", None)
    if held is None:
        held = _state.held = []
    return held


def _inverted(held: CheckedLock, taken: CheckedLock) -> None:
    pair = (held.name, taken.name)
    with _books:
        if pair in _seen or len(_seen) >= MAX_INVERSIONS:
            return
        stack = "".join(traceback.format_stack(limit=12)[:-3])
        where = (f"took {taken.name!r} while holding {held.name!r} in thread "
                 f"{threading.current_thread().name}\n{stack}")
        _seen[pair] = where
        if _report is not None:
            with open(_report, "a", encoding="utf-8") as f:
                f.write(where + "\n\f\n")


class CheckedLock:
    """A ``threading.Lock`` that checks, on every blocking take, that each lock the thread
    holds comes before it in ``ORDER`` (a ``threading.Condition`` can wait on it)."""

    __slots__ = ("_holder", "_lock", "name", "rank")

    def __init__(self, name: str) -> None:
        self.name = name
        self.rank = _RANK[name]
        self._lock = threading.Lock()
        self._holder: list[CheckedLock] | None = None
        """The held list of the thread that took it (a lock may be released by another)."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        held = _held()
        if blocking:  # a try-take cannot wait on anyone: lockdep does not order it either
            for h in held:
                if h.rank >= self.rank:
                    _inverted(h, self)
        got = self._lock.acquire(blocking, timeout)
        if got:
            held.append(self)
            self._holder = held
        return got

    def release(self) -> None:
        held, self._holder = self._holder, None
        if held is not None:
            for i in range(len(held) - 1, -1, -1):
                if held[i] is self:
                    del held[i]
                    break
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    # what threading.Condition asks of its lock
    def _is_owned(self) -> bool:
        return self._holder is _held() and self._lock.locked()

    def __repr__(self) -> str:
        return f"<CheckedLock {self.name} {'locked' if self.locked() else 'unlocked'}>"


def lock(name: str) -> threading.Lock:
    """The lock named ``name`` (one of ``ORDER``): a plain lock, or a checked one."""
    if name not in _RANK:
        raise ValueError(f"lock {name!r} is not in hicache.locks.ORDER")
    if _checking:
        return CheckedLock(name)  # type: ignore[return-value]
    return threading.Lock()


def condition(of: str | threading.Lock) -> threading.Condition:
    """A condition over ``of``: a lock made here, or the name of a new one."""
    return threading.Condition(lock(of) if isinstance(of, str) else of)


if os.environ.get(ENV_CHECK_LOCK_ORDER):
    check_order(os.environ[ENV_CHECK_LOCK_ORDER])
