"""Attaching worker buffers that live in shared memory (CPU hosts, tests): files or memfds.

Two ways to hand shared memory over:

- ``shm``: a file by path. Checked: inside ``shm_dir`` after resolving, not a symlink, a
  regular file, not world-writable, large enough for offset + nbytes and the declared shape.
  A worker can still truncate it under a copy; the copy engine's fault guard turns that into
  ``BUFFER_FAULT`` for that session. An operator may refuse paths altogether
  (``accept_paths=False``).
- ``memfd``: a memfd the worker passed over the identity socket (SCM_RIGHTS). Mapped only if it
  is a regular memory file sealed against shrinking (F_SEAL_SHRINK) and not against writing,
  and large enough: the worker cannot pull the memory from under a copy.

Primitives:

- ``ShmTransport(shm_dir, accept_paths)``: ``attach(buffers, fds)`` maps every file or fd once
  (MAP_SHARED | MAP_POPULATE); the buffers are ``RawBuffer``s at their place in the mapping.
  Any failure is ``SHM_PATH_REJECTED`` / ``FD_REJECTED`` naming the buffer and why, and
  nothing stays mapped.
- ``check_memfd(fd, need)``: the seal and size checks of one fd; returns its size.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import stat
from collections.abc import Sequence

from hicache.buffers import DeviceBufferSpec, unmap_all
from hicache.errors import FdRejected, ShmPathRejected
from hicached.core.worker_buffers import RawBuffer
from hicached.transport.base import Attachment, assemble, check_extent, check_strides


def _reject(path: str, why: str) -> ShmPathRejected:
    return ShmPathRejected(f"shm path {path!r} rejected: {why}",
                           metadata={"path": path, "why": why})


def _reject_fd(index: int, why: str) -> FdRejected:
    return FdRejected(f"memfd buffer fd {index} rejected: {why}",
                      metadata={"fd_index": index, "why": why})


def check_memfd(fd: int, need: int, index: int = 0) -> int:
    """Why ``fd`` may not back buffers needing ``need`` bytes (``FD_REJECTED``); its size."""
    try:
        st = os.fstat(fd)
    except OSError as exc:
        raise _reject_fd(index, f"cannot stat: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _reject_fd(index, "not a memory file (memfd_create)")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise _reject_fd(index, "does not support seals: not a memfd") from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise _reject_fd(index, "not sealed against shrinking (F_SEAL_SHRINK): the worker "
                                "could truncate it under a copy")
    if seals & (fcntl.F_SEAL_WRITE | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0)):
        raise _reject_fd(index, "sealed against writing: loads could not land in it")
    if st.st_size < need:
        raise _reject_fd(index, f"memfd has {st.st_size} bytes, buffers need {need}")
    return st.st_size


class ShmTransport:
    def __init__(self, shm_dir: str, accept_paths: bool = True) -> None:
        self.shm_dir = os.path.realpath(shm_dir)
        self.accept_paths = accept_paths

    def _open(self, path: str, need: int) -> tuple[mmap.mmap, int]:
        if not os.path.isabs(path):
            raise _reject(path, "not an absolute path")
        real = os.path.realpath(path)
        if os.path.commonpath([real, self.shm_dir]) != self.shm_dir or real == self.shm_dir:
            raise _reject(path, f"outside the shared-memory directory {self.shm_dir}")
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise _reject(path, f"cannot stat: {exc.strerror}") from None
        if stat.S_ISLNK(st.st_mode):
            raise _reject(path, "is a symbolic link")
        if not stat.S_ISREG(st.st_mode):
            raise _reject(path, "not a regular file")
        if st.st_mode & stat.S_IWOTH:
            raise _reject(path, "world-writable")
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise _reject(path, f"cannot open: {exc.strerror}") from None
        try:
            fst = os.fstat(fd)
            if not stat.S_ISREG(fst.st_mode) or (fst.st_dev, fst.st_ino) != (st.st_dev,
                                                                            st.st_ino):
                raise _reject(path, "changed while being opened")
            if fst.st_size < need:
                raise _reject(path, f"file has {fst.st_size} bytes, buffers need {need}")
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            return mmap.mmap(fd, need, flags=flags), fst.st_size
        finally:
            os.close(fd)

    def attach(self, buffers: Sequence[DeviceBufferSpec], fds: Sequence[int] = ()
               ) -> Attachment:
        """Map the buffers: ``shm`` ones by path, ``memfd`` ones from ``fds`` (which stay the
        caller's to close)."""
        assert all(b.transport in ("shm", "memfd") for b in buffers), "not shared memory"
        need: dict[str | int, int] = {}
        for i, b in enumerate(buffers):
            where: str | int
            if b.transport == "memfd":
                if not 0 <= b.fd_index < len(fds):
                    raise _reject_fd(b.fd_index, f"buffers[{i}] names fd {b.fd_index}, "
                                                 f"{len(fds)} were handed over with the "
                                                 "session's peer_token")
                where = b.fd_index
            else:
                if not self.accept_paths:
                    raise _reject(b.path, "this daemon maps only sealed memfds passed over "
                                          "its identity socket (accept_shm_paths = false)")
                where = b.path
            why = check_extent(b, i)
            if why:
                raise _reject_fd(b.fd_index, why) if isinstance(where, int) else _reject(
                    b.path, why)
            need[where] = max(need.get(where, 0), b.offset + b.nbytes)
        maps: dict[str | int, mmap.mmap] = {}
        try:
            for where, n in need.items():
                maps[where] = (self._open(where, n)[0] if isinstance(where, str)
                               else self._map_fd(fds[where], n, where))
            bases = {where: _address(m) for where, m in maps.items()}
            attached = assemble(buffers, lambda i, b: self._buffer(
                bases[b.fd_index if b.transport == "memfd" else b.path], b, i))
        except BaseException:
            unmap_all(maps.values())
            raise
        return Attachment(attached, list(maps.values()), sum(b.nbytes for b in buffers))

    @staticmethod
    def _map_fd(fd: int, need: int, index: int) -> mmap.mmap:
        check_memfd(fd, need, index)
        try:
            return mmap.mmap(fd, need, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except OSError as exc:
            raise _reject_fd(index, f"cannot map: {exc.strerror}") from None

    @staticmethod
    def _buffer(base: int, b: DeviceBufferSpec, i: int) -> RawBuffer:
        """Buffer ``i`` in a mapping at ``base``: raw memory the attachment keeps mapped until
        its ``release``, which the session defers past every copy using it."""
        check_strides(b, i)
        return RawBuffer(base + b.offset, b.shape, b.dtype, b.strides)


def _address(m: mmap.mmap) -> int:
    """Where a mapping starts (the ctypes view is dropped at once: it would pin the mapping
    against ``close``)."""
    view = ctypes.c_char.from_buffer(m)
    try:
        return ctypes.addressof(view)
    finally:
        del view
