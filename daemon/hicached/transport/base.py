"""What every transport shares: the attachment of a session, and the checks of its buffers.

A transport turns the ``DeviceBufferSpec``s a worker handed over (``hicache.buffers``) into
``WorkerBuffers`` the copy engine can use: ``shm`` maps shared-memory files (CPU hosts, tests),
``cuda_ipc`` opens CUDA IPC handles or maps VMM chunks (``cuda_vmm``).

Primitives:

- ``Attachment``: the session's ``WorkerBuffers``, the bytes attached, the runner its copies
  use (None = the CPU runner), ``release()``.
- ``check_extent`` / ``check_strides`` / ``assemble``: the checks and the per-layer assembly
  both transports share.

Knows nothing of pools or RPC.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Sequence

from hicache.buffers import DeviceBufferSpec, strided_span, unmap_all
from hicache.errors import GeometryMismatch
from hicache.specs import Role
from hicached.copy.engine import PlanRunner
from hicached.core.worker_buffers import Buffer, WorkerBuffers


class Attachment:
    """Mapped worker buffers of one session (shared-memory files; ``cuda_ipc`` subclasses it)."""

    runner: PlanRunner | None = None
    """How copies run when not on the CPU (the CUDA path); None = the CPU runner."""

    def __init__(self, buffers: WorkerBuffers, maps: list[mmap.mmap], nbytes: int) -> None:
        self.buffers: WorkerBuffers | None = buffers
        self._maps = maps
        self.nbytes = nbytes

    def release(self) -> None:
        """Drop the tensors and unmap the files. Idempotent."""
        self.buffers = None
        maps, self._maps = self._maps, []
        unmap_all(maps)


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
    if any(s < 0 for s in b.strides) or strided_span(b.shape, b.strides) > count:
        raise GeometryMismatch(f"buffers[{i}]: strides {b.strides} leave the buffer",
                               metadata={"buffer": i})


def assemble(buffers: Sequence[DeviceBufferSpec],
             make: Callable[[int, DeviceBufferSpec], Buffer], location: str = "cpu"
             ) -> WorkerBuffers:
    """The session's WorkerBuffers: every (member, role) needs layers 0..n-1, each given
    once."""
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
    return WorkerBuffers({m: {r: [ls[k] for k in sorted(ls)] for r, ls in roles.items()}
                     for m, roles in layers.items()}, location)
