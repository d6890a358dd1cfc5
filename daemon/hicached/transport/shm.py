"""Attaching worker buffers that live in shared-memory files (CPU hosts, tests).

Primitives:

- ``ShmTransport(shm_dir)``: ``attach(buffers)`` maps every buffer's file once (MAP_SHARED |
  MAP_POPULATE) after checking it: inside ``shm_dir`` after resolving, not a symlink, a regular
  file, not world-writable, large enough for offset + nbytes and for the declared shape. Any
  failure is ``SHM_PATH_REJECTED`` naming the path and why, and nothing stays mapped.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
from collections.abc import Sequence

import torch

from hicache.buffers import DeviceBufferSpec, unmap_all
from hicache.errors import ShmPathRejected
from hicached.transport.base import Attachment, assemble, check_extent, check_strides


def _reject(path: str, why: str) -> ShmPathRejected:
    return ShmPathRejected(f"shm path {path!r} rejected: {why}",
                           metadata={"path": path, "why": why})


class ShmTransport:
    def __init__(self, shm_dir: str) -> None:
        self.shm_dir = os.path.realpath(shm_dir)

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

    def attach(self, buffers: Sequence[DeviceBufferSpec]) -> Attachment:
        assert all(b.transport == "shm" for b in buffers), "cuda_ipc buffers go to cuda_ipc"
        need: dict[str, int] = {}
        for i, b in enumerate(buffers):
            why = check_extent(b, i)
            if why:
                raise _reject(b.path, why)
            need[b.path] = max(need.get(b.path, 0), b.offset + b.nbytes)
        maps: dict[str, mmap.mmap] = {}
        try:
            for path, n in need.items():
                maps[path] = self._open(path, n)[0]
            attached = assemble(buffers, lambda i, b: self._tensor(maps[b.path], b, i))
        except BaseException:
            unmap_all(maps.values())
            raise
        return Attachment(attached, list(maps.values()), sum(b.nbytes for b in buffers))

    @staticmethod
    def _tensor(m: mmap.mmap, b: DeviceBufferSpec, i: int) -> torch.Tensor:
        count = math.prod(b.shape)
        raw = torch.frombuffer(m, dtype=torch.uint8, count=b.nbytes, offset=b.offset)
        typed = raw[: count * b.dtype.itemsize].view(b.dtype.torch_dtype)
        if b.strides:
            check_strides(b, i)
            return typed.as_strided(b.shape, b.strides)
        return typed.view(b.shape)
