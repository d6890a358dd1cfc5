"""What the host offers: usable CPUs and available memory, read without loading anything else.

Primitives:

- ``usable_cpus()``: CPUs this process may run on (its affinity mask), at least 1.
- ``default_threads(requested)``: ``requested``, or every usable CPU for 0 (prefaulting a
  pool at start) — the one place that rule lives.
- ``default_copy_threads(requested)``: ``requested``, or for 0 a quarter of the usable CPUs,
  1 to 8 (copies while inference runs on the same node).
- ``available_bytes()``: MemAvailable from /proc/meminfo.
- ``check_budget(nbytes, reserve_bytes)``: ``HOST_MEMORY_INSUFFICIENT`` when ``nbytes`` exceeds
  available memory minus the reserve, naming every number.
"""

from __future__ import annotations

import os

from hicache.errors import HostMemoryInsufficient


def usable_cpus() -> int:
    return max(1, len(os.sched_getaffinity(0)))


def default_threads(requested: int) -> int:
    """``requested`` threads, or one per usable CPU when it is 0."""
    return requested or usable_cpus()


def default_copy_threads(requested: int) -> int:
    """``requested`` threads per copy, or for 0 a quarter of the usable CPUs, at least 1 and at
    most 8: a few threads reach the memory bandwidth, and the rest of the node belongs to the
    inference processes beside the daemon (on a loaded 2-CPU node a 2 MiB copy took 3.3 ms on
    two threads, 0.07 ms on one)."""
    return requested or max(1, min(8, usable_cpus() // 4))


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (bytes); falls back to free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_budget(nbytes: int, reserve_bytes: int) -> None:
    """Refuse ``nbytes`` when it exceeds available memory minus ``reserve_bytes``."""
    avail = available_bytes()
    allowed = max(avail - reserve_bytes, 0)
    if nbytes > allowed:
        raise HostMemoryInsufficient(
            f"requested {nbytes} bytes but only {allowed} may be used "
            f"({avail} available minus a reserve of {reserve_bytes})",
            metadata={
                "requested_bytes": nbytes,
                "available_bytes": avail,
                "reserve_bytes": reserve_bytes,
                "allowed_bytes": allowed,
            },
        )
