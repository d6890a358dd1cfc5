"""Shared-memory device buffers for CPU workers (and tests): the daemon maps the same memory.

``ShmDeviceBuffers.create(spec, device_tokens)`` makes one file per member and role (mode 0600,
prefaulted), laid out as SGLang's device pool (``hicache.buffers.layer_shapes``): per layer a
(rows, *unit) buffer. Two kinds:

- ``sealed=True``: a memfd (``memfd_create``) sealed against shrinking and further sealing
  (F_SEAL_SHRINK | F_SEAL_SEAL), handed to the daemon by fd (``.fds``, passed with
  ``open_session(..., fds=...)`` over the identity socket): nothing, not even this process, can
  truncate it under a copy. What production workers use.
- ``sealed=False``: a named file under the shared-memory directory, handed over by path.

``.descriptors`` is what ``OpenSession`` sends; ``.rows(member, role, layer)`` is a layer's
bytes as a numpy (rows, row bytes) array, no torch needed; ``.tensors`` holds torch views
(``layers(member, role)``, ``all_tensors()``), made on first use, which imports torch (a
torch-free process, ``hicache-bench trace``, never asks for them). ``.close()`` unmaps and
removes the files (closes the fds).
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import uuid
from typing import TYPE_CHECKING

import numpy as np

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
    def __init__(self, descriptors: list[DeviceBufferSpec], maps: list[mmap.mmap],
                 paths: list[str], fds: list[int] | None = None) -> None:
        self.descriptors = descriptors
        """One per layer of each member and role, in order; ``descriptors[i]`` lies in the
        mapping ``maps[i // layers of its member]`` at its ``offset``."""
        self._maps = maps
        self._views: dict[tuple[str, Role, int], tuple[mmap.mmap, DeviceBufferSpec]] = {}
        index = {key: i for i, key in enumerate(dict.fromkeys((d.member, d.role)
                                                              for d in descriptors))}
        assert len(index) == len(maps), "one mapping per member and role"
        for d in descriptors:
            self._views[(d.member, d.role, d.layer)] = (maps[index[(d.member, d.role)]], d)
        self._tensors: dict[str, dict[Role, list[torch.Tensor]]] | None = None
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
        tag = uuid.uuid4().hex[:12]
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
                for layer in range(geometry.layer_num):
                    descriptors.append(DeviceBufferSpec(
                        member=name, role=comp.role, layer=layer, shape=shape,
                        dtype=comp.dtype, strides=(), offset=layer * pitch, nbytes=layer_bytes,
                        **({"transport": "memfd", "fd_index": len(fds) - 1} if sealed
                           else {"transport": "shm", "path": path})))
        except BaseException:
            unmap_all(maps)
            for p in paths:
                os.unlink(p)
            for fd in fds:
                os.close(fd)
            raise
        return cls(descriptors, maps, paths, fds)

    def rows(self, member: str, role: Role, layer: int) -> np.ndarray:
        """One layer's bytes, a (rows, bytes per row) uint8 array over the shared memory (a
        view: writing it writes what the daemon copies from; no torch)."""
        m, d = self._views[(member, role, layer)]
        flat = np.frombuffer(m, dtype=np.uint8, count=d.nbytes, offset=d.offset)
        return flat.reshape(d.shape[0], -1)

    @property
    def tensors(self) -> dict[str, dict[Role, list[torch.Tensor]]]:
        """``tensors[member][role][layer]``: the worker's torch views of the buffers (made
        on first use: this imports torch)."""
        if self._tensors is None:
            import torch

            out: dict[str, dict[Role, list[torch.Tensor]]] = {}
            for (member, role, _), (m, d) in self._views.items():
                raw = torch.frombuffer(m, dtype=torch.uint8, count=d.nbytes, offset=d.offset)
                out.setdefault(member, {}).setdefault(role, []).append(
                    raw.view(d.dtype.torch_dtype).view(d.shape))
            self._tensors = out
        return self._tensors

    def layers(self, member: str, role: Role) -> list[torch.Tensor]:
        """The per-layer tensors of one member's component."""
        return self.tensors[member][role]

    def all_tensors(self) -> list[torch.Tensor]:
        """Every buffer, member by member, role by role, layer by layer."""
        return [t for roles in self.tensors.values() for layers in roles.values()
                for t in layers]

    def close(self) -> None:
        self._tensors = {}
        self._views = {}
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
