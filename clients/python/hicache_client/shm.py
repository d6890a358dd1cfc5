"""Shared-memory device buffers for CPU workers (and tests): the daemon maps the same memory.

``ShmDeviceBuffers.create(spec, device_tokens)`` makes one file per member and role (mode 0600,
prefaulted), laid out as SGLang's device pool (``hicache.buffers.layer_shapes``): per layer a
(rows, *unit) tensor. Two kinds:

- ``sealed=True``: a memfd (``memfd_create``) sealed against shrinking and further sealing
  (F_SEAL_SHRINK | F_SEAL_SEAL), handed to the daemon by fd (``.fds``, passed with
  ``open_session(..., fds=...)`` over the identity socket): nothing, not even this process, can
  truncate it under a copy. What production workers use.
- ``sealed=False``: a named file under the shared-memory directory, handed over by path.

``.tensors`` holds the views (``layers(member, role)``, ``all_tensors()``), ``.descriptors`` is
what ``OpenSession`` sends, ``.close()`` unmaps and removes the files (closes the fds). torch is
imported when buffers are created.
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import uuid
from typing import TYPE_CHECKING

from hicache.buffers import DeviceBufferSpec, layer_shapes, unmap_all
from hicache.specs import PoolSpec, Role

if TYPE_CHECKING:
    import torch

ALIGN = 4096


def _sealed_memfd(label: str, size: int) -> int:
    """A memfd of ``size`` bytes that can never shrink, and whose seals are final."""
    fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


class ShmDeviceBuffers:
    def __init__(self, tensors: dict[str, dict[Role, list[torch.Tensor]]],
                 descriptors: list[DeviceBufferSpec], maps: list[mmap.mmap],
                 paths: list[str], fds: list[int] | None = None) -> None:
        self.tensors = tensors
        """``tensors[member][role][layer]``: the worker's view of the buffers."""
        self.descriptors = descriptors
        self._maps = maps
        self.paths = paths
        self.fds = fds or []
        """Sealed memfds, in ``fd_index`` order (``sealed=True``); pass to ``open_session``."""

    @classmethod
    def create(cls, spec: PoolSpec, device_tokens: int, shm_dir: str = "/dev/shm",
               prefix: str = "hicache-worker", mode: int = 0o600, sealed: bool = False
               ) -> ShmDeviceBuffers:
        """``mode`` 0o660 lets a daemon running as another user of the file's group map the
        files (a worker in the service's group); the default keeps them the worker's own.
        ``sealed``: sealed memfds passed by fd instead of files named by path."""
        import torch

        tag = uuid.uuid4().hex[:12]
        tensors: dict[str, dict[Role, list[torch.Tensor]]] = {}
        descriptors: list[DeviceBufferSpec] = []
        maps: list[mmap.mmap] = []
        paths: list[str] = []
        fds: list[int] = []
        try:
            for name, geometry, comp, shape in layer_shapes(spec, device_tokens):
                layer_bytes = math.prod(shape) * comp.dtype.itemsize
                pitch = -(-layer_bytes // ALIGN) * ALIGN
                total = pitch * geometry.layer_num
                label = f"{prefix}-{tag}-{name}-{comp.role.value}"
                if sealed:
                    fd = _sealed_memfd(label, total)
                    fds.append(fd)
                    m = mmap.mmap(fd, total, flags=mmap.MAP_SHARED
                                  | getattr(mmap, "MAP_POPULATE", 0))
                else:
                    path = os.path.join(shm_dir, label)
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
                    paths.append(path)
                    try:
                        os.fchmod(fd, mode)  # the umask does not get a say
                        os.ftruncate(fd, total)
                        m = mmap.mmap(fd, total, flags=mmap.MAP_SHARED
                                      | getattr(mmap, "MAP_POPULATE", 0))
                    finally:
                        os.close(fd)
                maps.append(m)
                layers = []
                for layer in range(geometry.layer_num):
                    raw = torch.frombuffer(m, dtype=torch.uint8, count=layer_bytes,
                                           offset=layer * pitch)
                    layers.append(raw.view(comp.dtype.torch_dtype).view(shape))
                    descriptors.append(DeviceBufferSpec(
                        member=name, role=comp.role, layer=layer, shape=shape,
                        dtype=comp.dtype, strides=(), offset=layer * pitch, nbytes=layer_bytes,
                        **({"transport": "memfd", "fd_index": len(fds) - 1} if sealed
                           else {"transport": "shm", "path": path})))
                tensors.setdefault(name, {})[comp.role] = layers
        except BaseException:
            unmap_all(maps)
            for p in paths:
                os.unlink(p)
            for fd in fds:
                os.close(fd)
            raise
        return cls(tensors, descriptors, maps, paths, fds)

    def layers(self, member: str, role: Role) -> list[torch.Tensor]:
        """The per-layer tensors of one member's component."""
        return self.tensors[member][role]

    def all_tensors(self) -> list[torch.Tensor]:
        """Every buffer, member by member, role by role, layer by layer."""
        return [t for roles in self.tensors.values() for layers in roles.values()
                for t in layers]

    def close(self) -> None:
        self.tensors = {}
        unmap_all(self._maps)
        self._maps = []
        for p in self.paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        self.paths = []
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def __enter__(self) -> ShmDeviceBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
