"""Moving one page between a pool's memory and a slot of its disk tier's page file.

Pages are written from and read into the pool's own views (``HostPool.page_views``), run by
run, each run hashed (xxh3-64) while it is in cache; with O_DIRECT straight from and into
those views when they are 4 KiB-aligned (typical geometries), else through an aligned bounce
buffer (anonymous mappings, kept for reuse).

Primitives: ``PageFile(fd, page_bytes, slot_bytes, o_direct)``: ``write(slot, buffers)`` /
``read(slot, buffers)`` -> the digest of the bytes written or landed (``OSError`` on a short
or failed call); ``reserve(fd, nbytes, directory, name)``: a file's blocks allocated now
(``posix_fallocate``), so a full filesystem shows when the tier opens
(``DiskTierUnavailable``), not at every spill.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
from collections.abc import Sequence

import numpy as np
import xxhash

from hicached.tiers import disk_format as fmt

log = logging.getLogger(__name__)

NOT_SUPPORTED = (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS)
"""``posix_fallocate`` errors of a filesystem that cannot reserve (the file stays sparse)."""


def _aligned(buffers: Sequence[memoryview]) -> bool:
    """Whether O_DIRECT can use these buffers as they are: 4 KiB-aligned starts and sizes,
    few enough for one system call."""
    if len(buffers) > 1024:
        return False
    return all(len(b) % fmt.ALIGN == 0 and
               np.frombuffer(b, dtype=np.uint8).ctypes.data % fmt.ALIGN == 0
               for b in buffers)


class PageFile:
    def __init__(self, fd: int, page_bytes: int, slot_bytes: int, o_direct: bool) -> None:
        self._data_fd, self.page_bytes, self.slot_bytes = fd, page_bytes, slot_bytes
        self.o_direct = o_direct
        self._bounces: queue.LifoQueue[np.ndarray] = queue.LifoQueue()

    def write(self, slot: int, buffers: Sequence[memoryview]) -> int:
        """Write the page run by run, hashing each run while it is in cache; its digest."""
        off = slot * self.slot_bytes
        h = xxhash.xxh3_64()
        if not self.o_direct:
            for b in buffers:
                h.update(b)
                if os.pwrite(self._data_fd, b, off) != len(b):
                    raise OSError(f"short write at {off}")
                off += len(b)
            return int(h.intdigest())
        if _aligned(buffers):  # straight from the pool's memory, no bounce
            for b in buffers:
                h.update(b)
            if os.pwritev(self._data_fd, buffers, off) != self.page_bytes:
                raise OSError("short O_DIRECT write")
            return int(h.intdigest())
        bounce = self._bounce()
        try:
            pos = 0
            for b in buffers:
                view = np.frombuffer(b, dtype=np.uint8)
                bounce[pos:pos + view.size] = view
                h.update(bounce[pos:pos + view.size].data)
                pos += view.size
            if os.pwrite(self._data_fd, bounce.data, off) != self.slot_bytes:
                raise OSError("short O_DIRECT write")
        finally:
            self._bounces.put(bounce)
        return int(h.intdigest())

    def _bounce(self) -> np.ndarray:
        try:
            return self._bounces.get_nowait()
        except queue.Empty:
            return np.frombuffer(mmap.mmap(-1, self.slot_bytes), dtype=np.uint8)

    def read(self, slot: int, buffers: Sequence[memoryview]) -> int:
        """Read the page into ``buffers`` run by run, hashing each run while it is in cache;
        the digest of what landed."""
        off = slot * self.slot_bytes
        h = xxhash.xxh3_64()
        if not self.o_direct:
            for b in buffers:
                if os.preadv(self._data_fd, [b], off) != len(b):
                    raise OSError(f"short read at {off}")
                h.update(b)
                off += len(b)
            return int(h.intdigest())
        if _aligned(buffers):  # straight into the pool's memory, no bounce
            if os.preadv(self._data_fd, buffers, off) != self.page_bytes:
                raise OSError("short O_DIRECT read")
            for b in buffers:
                h.update(b)
            return int(h.intdigest())
        bounce = self._bounce()
        try:
            if os.preadv(self._data_fd, [bounce.data], off) != self.slot_bytes:
                raise OSError("short O_DIRECT read")
            pos = 0
            for b in buffers:
                view = np.frombuffer(b, dtype=np.uint8)
                view[:] = bounce[pos:pos + view.size]
                h.update(b)
                pos += view.size
        finally:
            self._bounces.put(bounce)
        return int(h.intdigest())


class DiskTierUnavailable(OSError):
    """The tier's files cannot be had (no space for them, a directory or file that is not the
    daemon's own): the pool runs without its disk tier."""


def reserve(fd: int, nbytes: int, directory: str, name: str) -> None:
    """Allocate the file's ``nbytes`` now; ``DiskTierUnavailable`` (the bytes needed and free)
    when the filesystem lacks them. A filesystem that cannot reserve leaves it sparse, logged
    once."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in NOT_SUPPORTED:
            log.warning("disk tier of pool %s: the filesystem of %s cannot reserve space; its "
                        "files stay sparse (a full disk then fails spills, backed off)", name,
                        directory)
            return
        st = os.statvfs(directory)
        raise DiskTierUnavailable(
            exc.errno, f"disk tier of pool {name}: its files in {directory} need {nbytes} "
            f"bytes, the filesystem has {st.f_bavail * st.f_frsize} free ({exc.strerror}); "
            "give [tier.disk] less capacity or more space") from exc
