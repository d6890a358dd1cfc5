"""A worker's device KV buffers as both sides describe them: shapes, strides, descriptors.

SGLang's device pools hold, per member and role, one buffer per layer of shape
(rows, *unit_shape): rows = tokens + one padding page for token-granular components (MHA K/V,
MLA latent), pages + 1 for page-granular ones (DSA index buffers).

Primitives:

- ``device_rows(comp, device_tokens, page_size)``: the rows of one layer buffer.
- ``device_shape(comp, rows)``: its shape.
- ``layer_shapes(spec, device_tokens)``: (member, geometry, component, per-layer shape) of every
  buffer a worker with ``device_tokens`` tokens holds for ``spec``.
- ``contiguous_strides(shape)`` / ``strided_span(shape, strides)``: element strides of a dense
  buffer, and how many elements a strided one spans (its extent).
- ``DeviceBufferSpec``: one buffer as handed over on the wire (``codec`` encodes it), by a
  shared-memory file, a sealed memfd, a CUDA IPC handle or CUDA VMM chunks passed as fds.
- ``MAX_FDS``: the fds one session may hand over (memfds, VMM chunks): the identity socket's
  bound on one request.
- ``unmap_all(maps)``: close the mappings of buffer files, tolerating views still alive.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hicache.specs import Component, DType, KVGeometry, PoolSpec, Role

MAX_FDS = 128
"""Fds one OpenSession may hand over with its identity request (sealed memfds, exported VMM
chunks): what the identity socket reads from one request (the kernel passes at most 253 with one
message), so also the most chunks a ``cuda_vmm`` region may have."""


def device_rows(comp: Component, device_tokens: int, page_size: int) -> int:
    """Rows of one layer buffer holding ``device_tokens`` tokens, SGLang's padding included."""
    if comp.page_granular:
        return device_tokens // page_size + 1
    return device_tokens + page_size


def device_shape(comp: Component, rows: int) -> tuple[int, ...]:
    """Per-layer device buffer shape: (rows, *unit) — tokens (+ page_size padding) or pages."""
    return (rows, *comp.unit_shape)


def layer_shapes(spec: PoolSpec, device_tokens: int
                 ) -> list[tuple[str, KVGeometry, Component, tuple[int, ...]]]:
    """(member, geometry, component, per-layer shape) of SGLang's device pool for ``spec``."""
    ps = spec.page_size
    return [(name, geometry, comp, device_shape(comp, device_rows(comp, device_tokens, ps)))
            for name, geometry in spec.members() for comp in geometry.components(ps)]


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a dense row-major buffer of ``shape``."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(out))


def strided_span(shape: Sequence[int], strides: Sequence[int]) -> int:
    """Elements from the first to one past the last element of a strided buffer (0 if empty)."""
    if math.prod(shape) == 0:
        return 0
    return 1 + sum((d - 1) * s for d, s in zip(shape, strides, strict=True))


def unmap_all(maps: Iterable[mmap.mmap]) -> None:
    """Close mappings; one still viewed by a live tensor is unmapped when the view goes."""
    for m in maps:
        try:
            m.close()
        except BufferError:
            pass


@dataclass(frozen=True)
class DeviceBufferSpec:
    """One worker device buffer as handed over on the wire, decoded."""

    member: str
    """Pool member the buffer belongs to (``kv`` for the anchor)."""
    role: Role
    """Which component of the member (K, V, KV, INDEX)."""
    layer: int
    """Layer index within the member."""
    shape: tuple[int, ...]
    """Element shape, (rows, *unit_shape)."""
    dtype: DType
    """Element type."""
    strides: tuple[int, ...]
    """Element strides; empty = contiguous."""
    transport: str
    """"shm" (a file by path), "memfd" (a sealed memfd passed by fd), "cuda_ipc" (a CUDA IPC
    handle) or "cuda_vmm" (CUDA VMM chunks passed by fd)."""
    path: str = ""
    """shm: the file under the daemon's shared-memory directory."""
    offset: int = 0
    """Bytes from the start of the file (shm, memfd), of the CUDA allocation (cuda_ipc) or of
    the region its chunks make (cuda_vmm)."""
    nbytes: int = 0
    """Bytes of the buffer."""
    ipc_handle: bytes = b""
    """cuda_ipc: the 64-byte ``cuIpcGetMemHandle`` handle of the allocation holding it."""
    device_uuid: str = ""
    """cuda_ipc, cuda_vmm: the GPU's UUID (ordinals differ between processes)."""
    fd_index: int = -1
    """memfd: position of its fd among those passed with the session's identity request."""
    fd_indices: tuple[int, ...] = ()
    """cuda_vmm: each chunk's fd among those passed with the session's identity request, in
    the order the chunks are mapped back to back (the region); buffers naming the same chunks
    share the region."""
    chunk_bytes: tuple[int, ...] = ()
    """cuda_vmm: each chunk's mapped size in bytes (a multiple of the device's granularity)."""
