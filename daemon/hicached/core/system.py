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
- ``filesystem_of(path)``: the type of the filesystem ``path`` is on (``tmpfs``, ``ext4``, ...).
- ``lock_refusal(path)``: why the kernel would refuse to page-lock (pin for DMA) a shared
  mapping of a file in ``path``'s filesystem, or None where it would not: Linux pins shared
  file pages long-term only where no writeback tracks them (tmpfs, hugetlbfs, ramfs); a file on
  a disk filesystem fails ``cuMemHostRegister`` with ``CUDA_ERROR_INVALID_VALUE``.
"""

from __future__ import annotations

import ctypes
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


# statfs(2) f_type values (linux/magic.h) of the filesystems a daemon's files are likely on
_FS_MAGIC = {0x01021994: "tmpfs", 0x958458F6: "hugetlbfs", 0x858458F6: "ramfs",
             0xEF53: "ext4", 0x58465342: "xfs", 0x9123683E: "btrfs", 0x794C7630: "overlay",
             0x6969: "nfs", 0x2FC12FC1: "zfs", 0xFF534D42: "cifs", 0x65735546: "fuse",
             0x5346544E: "ntfs", 0x4D44: "vfat", 0xF2F52010: "f2fs", 0x73717368: "squashfs"}
_MEMORY_FILESYSTEMS = frozenset({"tmpfs", "hugetlbfs", "ramfs"})
_libc = ctypes.CDLL(None, use_errno=True)


def filesystem_of(path: str) -> str:
    """The filesystem type of ``path`` (or of its nearest existing parent), by statfs(2):
    a name for the common ones, else ``0x<magic>``."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    buf = ctypes.create_string_buffer(256)  # struct statfs: f_type (a long) comes first
    if _libc.statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    magic = ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF
    return _FS_MAGIC.get(magic, f"{magic:#x}")


def lock_refusal(path: str) -> str | None:
    """Why page-locking a shared mapping of a file in ``path``'s filesystem fails, or None
    where it works (a memory filesystem)."""
    fs = filesystem_of(path)
    if fs in _MEMORY_FILESYSTEMS:
        return None
    return (f"{path} is on {fs}, and the kernel page-locks (pins for DMA) shared file pages "
            f"only on a memory filesystem: tmpfs or hugetlbfs")
