"""Shared-memory device buffers for CPU workers (and tests): the daemon maps the same files.

``ShmDeviceBuffers.create(spec, device_tokens)`` makes one file per member and role under the
shared-memory directory (mode 0600, prefaulted), laid out as SGLang's device pool
(``hicache.buffers.layer_shapes``): per layer a (rows, *unit) tensor. ``.tensors`` holds them
(``layers(member, role)``, ``all_tensors()``), ``.descriptors`` is what ``OpenSession`` sends,
``.close()`` unmaps and removes the files. torch is imported when buffers are created.
"""

from __future__ import annotations

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


class ShmDeviceBuffers:
    def __init__(self, tensors: dict[str, dict[Role, list[torch.Tensor]]],
                 descriptors: list[DeviceBufferSpec], maps: list[mmap.mmap],
                 paths: list[str]) -> None:
        self.tensors = tensors
        """``tensors[member][role][layer]``: the worker's view of the buffers."""
        self.descriptors = descriptors
        self._maps = maps
        self.paths = paths

    @classmethod
    def create(cls, spec: PoolSpec, device_tokens: int, shm_dir: str = "/dev/shm",
               prefix: str = "hicache-worker", mode: int = 0o600) -> ShmDeviceBuffers:
        """``mode`` 0o660 lets a daemon running as another user of the file's group map the
        files (a worker in the service's group); the default keeps them the worker's own."""
        import torch

        tag = uuid.uuid4().hex[:12]
        tensors: dict[str, dict[Role, list[torch.Tensor]]] = {}
        descriptors: list[DeviceBufferSpec] = []
        maps: list[mmap.mmap] = []
        paths: list[str] = []
        try:
            for name, geometry, comp, shape in layer_shapes(spec, device_tokens):
                layer_bytes = math.prod(shape) * comp.dtype.itemsize
                pitch = -(-layer_bytes // ALIGN) * ALIGN
                path = os.path.join(shm_dir, f"{prefix}-{tag}-{name}-{comp.role.value}")
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
                paths.append(path)
                try:
                    os.fchmod(fd, mode)  # the umask does not get a say
                    total = pitch * geometry.layer_num
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
                        dtype=comp.dtype, strides=(), transport="shm", path=path,
                        offset=layer * pitch, nbytes=layer_bytes))
                tensors.setdefault(name, {})[comp.role] = layers
        except BaseException:
            unmap_all(maps)
            for p in paths:
                os.unlink(p)
            raise
        return cls(tensors, descriptors, maps, paths)

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

    def __enter__(self) -> ShmDeviceBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
