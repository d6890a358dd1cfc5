"""Shared-memory device buffers for CPU workers (and tests): the daemon maps the same files.

``ShmDeviceBuffers.create(spec, device_tokens)`` makes one file per member and role under the
shared-memory directory (mode 0600, prefaulted), laid out as SGLang's device pool: per layer a
(rows, *unit) tensor, rows = tokens + page_size (pages + 1 for DSA index buffers).
``.device`` is the local ``DeviceKV``; ``.descriptors`` what ``OpenSession`` sends;
``.close()`` unmaps and removes the files.
"""

from __future__ import annotations

import math
import mmap
import os
import uuid

import torch

from hicached.devicekv import DeviceKV
from hicached.geometry import PoolSpec, Role, device_shape
from hicached.transport import DeviceBufferSpec, unmap_all

ALIGN = 4096


class ShmDeviceBuffers:
    def __init__(self, device: DeviceKV, descriptors: list[DeviceBufferSpec],
                 maps: list[mmap.mmap], paths: list[str]) -> None:
        self.device: DeviceKV | None = device
        self.descriptors = descriptors
        self._maps = maps
        self.paths = paths

    @classmethod
    def create(cls, spec: PoolSpec, device_tokens: int, shm_dir: str = "/dev/shm",
               prefix: str = "hicache-worker") -> ShmDeviceBuffers:
        ps = spec.page_size
        tag = uuid.uuid4().hex[:12]
        buffers: dict[str, dict[Role, list[torch.Tensor]]] = {}
        descriptors: list[DeviceBufferSpec] = []
        maps: list[mmap.mmap] = []
        paths: list[str] = []
        try:
            for name, geometry in spec.members():
                for comp in geometry.components(ps):
                    rows = device_tokens // ps + 1 if comp.page_granular else device_tokens + ps
                    shape = device_shape(comp, rows)
                    layer_bytes = math.prod(shape) * comp.dtype.itemsize
                    pitch = -(-layer_bytes // ALIGN) * ALIGN
                    path = os.path.join(shm_dir, f"{prefix}-{tag}-{name}-{comp.role.value}")
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                    paths.append(path)
                    try:
                        total = pitch * geometry.layer_num
                        os.ftruncate(fd, total)
                        m = mmap.mmap(fd, total, flags=mmap.MAP_SHARED
                                      | getattr(mmap, "MAP_POPULATE", 0))
                    finally:
                        os.close(fd)
                    maps.append(m)
                    tensors = []
                    for layer in range(geometry.layer_num):
                        raw = torch.frombuffer(m, dtype=torch.uint8, count=layer_bytes,
                                               offset=layer * pitch)
                        tensors.append(raw.view(comp.dtype.torch_dtype).view(shape))
                        descriptors.append(DeviceBufferSpec(
                            member=name, role=comp.role, layer=layer, shape=shape,
                            dtype=comp.dtype, strides=(), transport="shm", path=path,
                            offset=layer * pitch, nbytes=layer_bytes))
                    buffers.setdefault(name, {})[comp.role] = tensors
        except BaseException:
            for p in paths:
                os.unlink(p)
            raise
        return cls(DeviceKV(buffers), descriptors, maps, paths)

    def close(self) -> None:
        self.device = None
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
