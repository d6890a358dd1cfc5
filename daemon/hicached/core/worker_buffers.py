"""A worker's KV buffers (CPU or GPU) as the copy engine sees them, checked against a pool.

Laid out like SGLang's device pools: per member and role, one buffer per layer, of shape
(rows, *unit_shape) — ``hicache.buffers`` has the rule for rows.

Primitives:

- ``WorkerBuffers(buffers, location)``: ``buffers[member][role]`` is the list of per-layer
  tensors (or ``RawBuffer``s), all on ``location`` (``cpu`` for shared-memory files and
  in-process tensors, ``cuda`` for GPU memory mapped over IPC or from VMM chunks).
- ``RawBuffer``: memory mapped from another process (a shared-memory file or memfd, a CUDA IPC
  allocation, VMM chunks), described like a tensor (address, shape, dtype, strides, device)
  for the geometry checks and copy plans: what the daemon attaches, with no torch.
- ``Buffer``: what a buffer must answer (a ``RawBuffer`` or a torch tensor).
- ``WorkerBuffers.allocate(spec, device_tokens)``: zeroed CPU torch tensors of the right
  geometry (tests, benchmarks, in-process use; imports torch, which the daemon never calls).
- ``extents(member, role)``: each layer's start and end address, for the copy planner.
- ``check_against(spec)``: ``GEOMETRY_MISMATCH`` listing every wrong member, role, layer, shape,
  dtype or non-contiguous buffer; returns the usable device capacity in tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from hicache.buffers import contiguous_strides, device_shape, layer_shapes
from hicache.errors import GeometryMismatch, SpecInvalid, Violation, raise_violations
from hicache.specs import DType, PoolSpec, Role

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Device:
    """Where a ``RawBuffer`` lives, as ``torch.device`` names it (``cpu``; ``cuda``, 0)."""

    type: str
    index: int | None = None

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


CPU = Device("cpu")


class Buffer(Protocol):
    shape: Any
    dtype: Any
    device: Any

    def data_ptr(self) -> int: ...
    def numel(self) -> int: ...
    def element_size(self) -> int: ...
    def dim(self) -> int: ...
    def is_contiguous(self) -> bool: ...


def dtype_of(t: Buffer) -> DType | None:
    """The buffer's dtype as the pool names it, None for one no pool has (a torch tensor's is
    looked up: torch is loaded already when one was given)."""
    if isinstance(t.dtype, DType):
        return t.dtype
    try:
        return DType.from_torch(t.dtype)
    except SpecInvalid:
        return None


class RawBuffer:
    """A buffer at a raw address (a mapping of a worker's memory), shaped like a tensor."""

    def __init__(self, address: int, shape: Sequence[int], dtype: DType,
                 strides: Sequence[int], device: Device = CPU) -> None:
        self.address = address
        self.shape = tuple(shape)
        self.dtype = dtype
        self.strides = tuple(strides) if strides else contiguous_strides(self.shape)
        self.device = device

    def data_ptr(self) -> int:
        return self.address

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize

    def dim(self) -> int:
        return len(self.shape)

    def is_contiguous(self) -> bool:
        return self.numel() == 0 or all(
            st == want for d, st, want in zip(self.shape, self.strides,
                                              contiguous_strides(self.shape), strict=True)
            if d > 1)


class WorkerBuffers:
    def __init__(self, buffers: Mapping[str, Mapping[Role, Sequence[Buffer]]],
                 location: str = "cpu") -> None:
        self.buffers: dict[str, dict[Role, list[Buffer]]] = {
            m: {r: list(ts) for r, ts in roles.items()} for m, roles in buffers.items()
        }
        self.location = location
        self._checked: tuple[PoolSpec, int] | None = None
        self._extents: dict[tuple[str, Role], tuple[np.ndarray, np.ndarray]] = {}
        self.plan_cache: dict[object, tuple[object, Any]] = {}
        """What the copy engine plans once for these buffers (its business)."""

    @classmethod
    def allocate(cls, spec: PoolSpec, device_tokens: int,
                 factory: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
                 ) -> WorkerBuffers:
        """Buffers for ``device_tokens`` tokens (+ one padding page, as SGLang allocates)."""
        import torch

        make = factory or (lambda shape, dtype: torch.zeros(shape, dtype=dtype))
        out: dict[str, dict[Role, list[Buffer]]] = {}
        for name, geometry, comp, shape in layer_shapes(spec, device_tokens):
            out.setdefault(name, {})[comp.role] = [make(shape, comp.dtype.torch_dtype)
                                                   for _ in range(geometry.layer_num)]
        return cls(out)

    def layers(self, member: str, role: Role) -> list[torch.Tensor]:
        """The per-layer tensors of buffers made as torch tensors (not for mapped ones)."""
        out = self.buffers[member][role]
        assert not any(isinstance(t, RawBuffer) for t in out), "raw buffers are not tensors"
        return out  # type: ignore[return-value]

    def all_tensors(self) -> list[torch.Tensor]:
        """Every buffer of CPU buffers, member by member, role by role, layer by layer."""
        return [t for roles in self.buffers for r in self.buffers[roles]
                for t in self.layers(roles, r)]

    def extents(self, member: str, role: Role) -> tuple[np.ndarray, np.ndarray]:
        """(start addresses, end addresses) of each layer's buffer, as int64 arrays."""
        key = (member, role)
        got = self._extents.get(key)
        if got is None:
            ts = self.buffers[member][role]
            starts = np.array([t.data_ptr() for t in ts], dtype=np.int64)
            sizes = np.array([t.numel() * t.element_size() for t in ts], dtype=np.int64)
            got = self._extents[key] = (starts, starts + sizes)
        return got

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for roles in self.buffers.values() for ts in roles.values() for t in ts)

    def check_against(self, spec: PoolSpec) -> int:
        """Validate every buffer; return the device capacity in tokens (all members)."""
        if self._checked is not None and self._checked[0] == spec:
            return self._checked[1]
        ps = spec.page_size
        violations: list[Violation] = []
        capacity: int | None = None

        def bad(path: str, why: str, **meta: object) -> None:
            violations.append(Violation(f"buffers[{path}]", GeometryMismatch.reason, why,
                                        {"buffer": path, **{k: str(v) for k, v in meta.items()}}))

        expected_members = {name for name, g in spec.members() if g.components(ps)}
        for extra in sorted(set(self.buffers) - expected_members):
            bad(extra, f"pool {spec.name} has no member {extra!r} with buffers")
        for name, geometry in spec.members():
            comps = geometry.components(ps)
            if not comps:
                continue
            roles = self.buffers.get(name)
            if roles is None:
                bad(name, f"missing buffers for member {name!r}")
                continue
            for extra_role in sorted(set(roles) - {c.role for c in comps}, key=str):
                bad(f"{name}.{extra_role.value}", f"role {extra_role.value} is not in the pool")
            for comp in comps:
                path = f"{name}.{comp.role.value}"
                layers = roles.get(comp.role)
                if layers is None:
                    bad(path, f"missing {comp.role.value} buffers")
                    continue
                if len(layers) != geometry.layer_num:
                    bad(path, f"{len(layers)} layers given, pool has {geometry.layer_num}",
                        expected=geometry.layer_num, got=len(layers))
                    continue
                rows0 = layers[0].shape[0] if layers[0].dim() else -1
                for i, t in enumerate(layers):
                    want = device_shape(comp, t.shape[0] if t.dim() else 0)
                    lp = f"{path}[{i}]"
                    dtype = dtype_of(t)
                    if dtype is not comp.dtype:
                        got = dtype.value if dtype is not None else str(t.dtype)
                        bad(lp, f"dtype {got}, pool has {comp.dtype.value}",
                            expected=comp.dtype.value, got=got)
                    elif tuple(t.shape) != want or t.shape[0] != rows0:
                        bad(lp, f"shape {tuple(t.shape)}, expected (rows={rows0}, "
                                f"{', '.join(map(str, comp.unit_shape))})",
                            expected=(rows0, *comp.unit_shape), got=tuple(t.shape))
                    elif not t.is_contiguous():
                        bad(lp, "buffer is not contiguous")
                    elif t.device.type != self.location:
                        bad(lp, f"buffer is on {t.device}, this session's buffers are on "
                                f"{self.location}")
                tokens = rows0 * ps if comp.page_granular else rows0
                capacity = tokens if capacity is None else min(capacity, tokens)
        raise_violations(violations)
        cap = max(capacity or 0, 0)
        self._checked = (spec, cap)
        return cap
