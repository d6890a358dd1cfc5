"""Attaching worker device buffers: shared-memory files (CPU hosts, tests) and CUDA IPC.

Primitives:

- ``DeviceBufferSpec``: one worker buffer as handed over (decoded from the wire by ``wire``).
- ``ShmTransport(shm_dir)``: ``attach(buffers)`` maps every buffer's file once (MAP_SHARED |
  MAP_POPULATE) after checking it: inside ``shm_dir`` after resolving, not a symlink, a regular
  file, not world-writable, large enough for offset + nbytes and for the declared shape. Any
  failure is ``SHM_PATH_REJECTED`` naming the path and why, and nothing stays mapped.
- ``Attachment``: the ``DeviceKV`` built from the buffers, the bytes attached, ``release()``.
- ``unmap_all(maps)``: close mappings, tolerating views that are still alive.
- ``check_extent`` / ``check_strides`` / ``assemble``: the checks and the per-layer assembly
  both transports share (``cudaipc`` attaches ``cuda_ipc`` buffers).

Knows nothing of pools or RPC.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hicached.devicekv import Buffer, DeviceKV
from hicached.errors import GeometryMismatch, ShmPathRejected
from hicached.geometry import DType, Role

if TYPE_CHECKING:
    from hicached.transfer import PlanRunner


@dataclass(frozen=True)
class DeviceBufferSpec:
    """One worker device buffer as handed over on the wire, decoded."""

    member: str
    role: Role
    layer: int
    shape: tuple[int, ...]
    dtype: DType
    strides: tuple[int, ...]
    transport: str
    """"shm" or "cuda_ipc"."""
    path: str = ""
    offset: int = 0
    nbytes: int = 0
    ipc_handle: bytes = b""
    device_uuid: str = ""


def unmap_all(maps: Iterable[mmap.mmap]) -> None:
    """Close mappings; one still viewed by a live tensor is unmapped when the view goes."""
    for m in maps:
        try:
            m.close()
        except BufferError:
            pass


class Attachment:
    """Mapped device buffers of one session (shared-memory files; ``cudaipc`` subclasses it)."""

    runner: PlanRunner | None = None
    """How copies run when not on the CPU (the CUDA path); None = the CPU copy engine."""

    def __init__(self, device: DeviceKV, maps: list[mmap.mmap], nbytes: int) -> None:
        self.device: DeviceKV | None = device
        self._maps = maps
        self.nbytes = nbytes

    def release(self) -> None:
        """Drop the tensors and unmap the files. Idempotent."""
        self.device = None
        maps, self._maps = self._maps, []
        unmap_all(maps)


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
        assert all(b.transport == "shm" for b in buffers), "cuda_ipc buffers go to cudaipc"
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
            device = assemble(buffers, lambda i, b: self._tensor(maps[b.path], b, i))
        except BaseException:
            unmap_all(maps.values())
            raise
        return Attachment(device, list(maps.values()), sum(b.nbytes for b in buffers))

    @staticmethod
    def _tensor(m: mmap.mmap, b: DeviceBufferSpec, i: int) -> torch.Tensor:
        count = math.prod(b.shape)
        raw = torch.frombuffer(m, dtype=torch.uint8, count=b.nbytes, offset=b.offset)
        typed = raw[: count * b.dtype.itemsize].view(b.dtype.torch_dtype)
        if b.strides:
            check_strides(b, i)
            return typed.as_strided(b.shape, b.strides)
        return typed.view(b.shape)


def check_extent(b: DeviceBufferSpec, i: int) -> str:
    """Why buffer ``i``'s offset, size or shape is unusable ('' when it is fine)."""
    if b.offset < 0 or b.nbytes <= 0:
        return f"buffers[{i}] has offset {b.offset}, nbytes {b.nbytes}"
    if any(d < 0 for d in b.shape):
        raise GeometryMismatch(f"buffers[{i}] has a negative dimension",
                               metadata={"shape": b.shape})
    want = math.prod(b.shape) * b.dtype.itemsize
    if want > b.nbytes:
        return f"buffers[{i}] declares {b.nbytes} bytes but its shape {b.shape} needs {want}"
    return ""


def check_strides(b: DeviceBufferSpec, i: int) -> None:
    """Element strides must match the shape's rank and stay inside the buffer."""
    if not b.strides:
        return
    count = math.prod(b.shape)
    if len(b.strides) != len(b.shape):
        raise GeometryMismatch(f"buffers[{i}]: strides and shape differ in rank",
                               metadata={"buffer": i})
    span = 1 + sum((d - 1) * s for d, s in zip(b.shape, b.strides, strict=True)) \
        if count else 0
    if any(s < 0 for s in b.strides) or span > count:
        raise GeometryMismatch(f"buffers[{i}]: strides {b.strides} leave the buffer",
                               metadata={"buffer": i})


def assemble(buffers: Sequence[DeviceBufferSpec],
             make: Callable[[int, DeviceBufferSpec], Buffer], location: str = "cpu"
             ) -> DeviceKV:
    """The session's DeviceKV: every (member, role) needs layers 0..n-1, each given once."""
    layers: dict[str, dict[Role, dict[int, Buffer]]] = {}
    for i, b in enumerate(buffers):
        slot = layers.setdefault(b.member, {}).setdefault(b.role, {})
        if b.layer in slot:
            raise GeometryMismatch(f"buffers[{i}]: layer {b.layer} of "
                                   f"{b.member}.{b.role.value} given twice",
                                   metadata={"buffer": i, "layer": b.layer})
        slot[b.layer] = make(i, b)
    for m, roles in layers.items():
        for r, ls in roles.items():
            if sorted(ls) != list(range(len(ls))):
                raise GeometryMismatch(f"{m}.{r.value}: layers {sorted(ls)} are not "
                                       f"0..{len(ls) - 1}", metadata={"buffer": m})
    return DeviceKV({m: {r: [ls[k] for k in sorted(ls)] for r, ls in roles.items()}
                     for m, roles in layers.items()}, location)
