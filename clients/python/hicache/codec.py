"""Conversions between the wire contract (``hicache.v1`` messages) and domain objects.

Primitives:

- ``spec_to_proto`` / ``spec_from_proto``: ``PoolSpec`` <-> ``hicache.v1.PoolSpec`` (enum names
  end in the domain names: ``POOL_KIND_MHA`` <-> ``PoolKind.MHA``).
- ``buffer_from_proto`` / ``buffer_to_proto``: ``hicache.v1.DeviceBuffer`` <->
  ``buffers.DeviceBufferSpec`` (the daemon's transports never see protos).
- ``kind_from_proto`` / ``dtype_from_proto`` / ``layout_from_proto`` / ``role_from_proto`` /
  ``role_to_proto`` / ``dtype_to_proto``: wire enum values <-> domain enums.
- ``pool_to_proto`` / ``pool_from_proto``: ``pools.PoolInfo`` <-> ``hicache.v1.Pool``, field
  by field by name; ``fill_deprecated(msg)``: a message's deprecated fields repeat the fields
  they were renamed to (``pools.DEPRECATED_FIELDS``).

Index batches travel as little-endian int64 bytes (``indices``). Decoding failures raise
domain errors (``SPEC_INVALID``).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from hicache.buffers import MAX_FDS, DeviceBufferSpec
from hicache.errors import SpecInvalid
from hicache.pools import CREATING, DEPRECATED_FIELDS, FAILED, READY, PoolInfo
from hicache.specs import (
    ANCHOR,
    CanarySpec,
    DType,
    KeyFormat,
    KVGeometry,
    Layout,
    MemberSpec,
    PoolKind,
    PoolSpec,
    Role,
)
from hicache.v1 import hicache_pb2 as pb


def _enum_name(enum_type: object, value: int, prefix: str, field: str) -> str:
    try:
        name: str = enum_type.Name(value)  # type: ignore[attr-defined]
    except ValueError:
        raise SpecInvalid(f"{field}: unknown enum value {value}",
                          metadata={"field": field, "value": value}) from None
    if name.endswith("_UNSPECIFIED"):
        raise SpecInvalid(f"{field} must be set", metadata={"field": field})
    return name[len(prefix):]


def kind_from_proto(value: int) -> PoolKind:
    return PoolKind(_enum_name(pb.PoolKind, value, "POOL_KIND_", "kind"))


def dtype_from_proto(value: int, field: str = "dtype") -> DType:
    return DType(_enum_name(pb.DType, value, "DTYPE_", field))


def layout_from_proto(value: int) -> Layout:
    if value == pb.LAYOUT_UNSPECIFIED:
        return Layout.LAYER_FIRST
    return Layout(_enum_name(pb.Layout, value, "LAYOUT_", "layout").lower())


def role_from_proto(value: int) -> Role:
    return Role(_enum_name(pb.BufferRole, value, "BUFFER_ROLE_", "role"))


def role_to_proto(role: Role) -> int:
    return int(pb.BufferRole.Value(f"BUFFER_ROLE_{role.value}"))


def dtype_to_proto(dtype: DType) -> int:
    return int(pb.DType.Value(f"DTYPE_{dtype.value}"))


def _geometry_from(msg: object, kind: int, dtype: int) -> KVGeometry:
    k = kind_from_proto(kind)
    d = DType.UINT8 if k in (PoolKind.DSA_INDEXER, PoolKind.OPAQUE) and dtype == 0 else (
        DType.BFLOAT16 if k is PoolKind.LOGICAL and dtype == 0 else dtype_from_proto(dtype))
    g = msg
    return KVGeometry(
        kind=k, dtype=d, layer_num=int(g.layer_num), head_num=int(g.head_num),  # type: ignore[attr-defined]
        head_dim=int(g.head_dim), v_head_dim=int(g.v_head_dim),  # type: ignore[attr-defined]
        kv_lora_rank=int(g.kv_lora_rank),  # type: ignore[attr-defined]
        qk_rope_head_dim=int(g.qk_rope_head_dim),  # type: ignore[attr-defined]
        index_head_dim=int(g.index_head_dim),  # type: ignore[attr-defined]
        quant_block_size=int(g.quant_block_size),  # type: ignore[attr-defined]
        row_bytes=int(g.row_bytes),  # type: ignore[attr-defined]
    )


def spec_from_proto(msg: pb.PoolSpec) -> PoolSpec:
    """Decode and validate a wire PoolSpec (raises the domain error of the first problem)."""
    sides = tuple(MemberSpec(s.name, _geometry_from(s.geometry, s.geometry.kind,
                                                    s.geometry.dtype))
                  for s in msg.side_pools)
    size = msg.WhichOneof("size")
    return PoolSpec(
        name=msg.name,
        geometry=_geometry_from(msg, msg.kind, msg.dtype),
        page_size=int(msg.page_size),
        layout=layout_from_proto(msg.layout),
        size_tokens=int(msg.size_tokens) if size == "size_tokens" else 0,
        size_bytes=int(msg.size_bytes) if size == "size_bytes" else 0,
        side_pools=sides,
        canary=CanarySpec(int(msg.canary_read_bytes)) if msg.canary_read_bytes else None,
        key_format=_key_format_from(msg.key_format),
    )


def _key_format_from(value: int) -> KeyFormat:
    try:
        return KeyFormat(pb.KeyFormat.Name(value)[len("KEY_FORMAT_"):].lower())  # type: ignore[arg-type]
    except ValueError:  # a number this build does not know
        raise SpecInvalid(f"key_format {value} is not one this daemon knows",
                          metadata={"key_format": value}) from None


def _fill_geometry(msg: object, g: KVGeometry) -> None:
    for name in ("layer_num", "head_num", "head_dim", "v_head_dim", "kv_lora_rank",
                 "qk_rope_head_dim", "index_head_dim", "quant_block_size", "row_bytes"):
        setattr(msg, name, getattr(g, name))
    msg.kind = pb.PoolKind.Value(f"POOL_KIND_{g.kind.value}")  # type: ignore[attr-defined]
    msg.dtype = dtype_to_proto(g.dtype)  # type: ignore[attr-defined]


def spec_to_proto(spec: PoolSpec) -> pb.PoolSpec:
    msg = pb.PoolSpec(name=spec.name, page_size=spec.page_size)
    msg.layout = pb.Layout.Value(f"LAYOUT_{spec.layout.value.upper()}")  # type: ignore[assignment]
    _fill_geometry(msg, spec.geometry)
    if spec.size_tokens:
        msg.size_tokens = spec.size_tokens
    else:
        msg.size_bytes = spec.size_bytes
    for side in spec.side_pools:
        s = msg.side_pools.add(name=side.name)
        _fill_geometry(s.geometry, side.geometry)
    if spec.canary is not None:
        msg.canary_read_bytes = spec.canary.read_bytes
    msg.key_format = pb.KeyFormat.Value(  # type: ignore[assignment]
        f"KEY_FORMAT_{spec.key_format.value.upper()}")
    return msg


def buffer_from_proto(msg: pb.DeviceBuffer, position: int) -> DeviceBufferSpec:
    which = msg.WhichOneof("handle")
    if which is None:
        raise SpecInvalid(f"buffers[{position}] has no handle (shm, memfd, cuda_ipc or "
                          "cuda_vmm)", metadata={"position": position})
    common = dict(member=msg.member or ANCHOR, role=role_from_proto(msg.role),
                  layer=int(msg.layer), shape=tuple(int(x) for x in msg.shape),
                  dtype=dtype_from_proto(msg.dtype, f"buffers[{position}].dtype"),
                  strides=tuple(int(x) for x in msg.strides))
    if which == "shm":
        return DeviceBufferSpec(transport="shm", path=msg.shm.path, offset=int(msg.shm.offset),
                                nbytes=int(msg.shm.nbytes), **common)  # type: ignore[arg-type]
    if which == "memfd":
        return DeviceBufferSpec(transport="memfd", fd_index=int(msg.memfd.fd_index),
                                offset=int(msg.memfd.offset), nbytes=int(msg.memfd.nbytes),
                                **common)  # type: ignore[arg-type]
    if which == "cuda_vmm":
        v = msg.cuda_vmm
        if len(v.fd_indices) != len(v.chunk_bytes) or len(v.fd_indices) > MAX_FDS:
            raise SpecInvalid(f"buffers[{position}]: a cuda_vmm region names {len(v.fd_indices)} "
                              f"fds and {len(v.chunk_bytes)} chunk sizes; one of each per chunk, "
                              f"at most {MAX_FDS}",
                              metadata={"position": position, "fd_indices": len(v.fd_indices),
                                        "chunk_bytes": len(v.chunk_bytes)})
        return DeviceBufferSpec(transport="cuda_vmm", fd_indices=tuple(map(int, v.fd_indices)),
                                chunk_bytes=tuple(map(int, v.chunk_bytes)),
                                device_uuid=v.device_uuid, offset=int(v.offset),
                                nbytes=int(v.nbytes), **common)  # type: ignore[arg-type]
    return DeviceBufferSpec(transport="cuda_ipc", ipc_handle=msg.cuda_ipc.handle,
                            device_uuid=msg.cuda_ipc.device_uuid,
                            offset=int(msg.cuda_ipc.offset), nbytes=int(msg.cuda_ipc.nbytes),
                            **common)  # type: ignore[arg-type]


def buffer_to_proto(b: DeviceBufferSpec) -> pb.DeviceBuffer:
    msg = pb.DeviceBuffer(member=b.member, layer=b.layer, shape=list(b.shape),
                          strides=list(b.strides))
    msg.role = role_to_proto(b.role)  # type: ignore[assignment]
    msg.dtype = dtype_to_proto(b.dtype)  # type: ignore[assignment]
    if b.transport == "shm":
        msg.shm.path, msg.shm.offset, msg.shm.nbytes = b.path, b.offset, b.nbytes
    elif b.transport == "memfd":
        msg.memfd.fd_index, msg.memfd.offset, msg.memfd.nbytes = b.fd_index, b.offset, b.nbytes
    elif b.transport == "cuda_vmm":
        msg.cuda_vmm.fd_indices.extend(b.fd_indices)
        msg.cuda_vmm.chunk_bytes.extend(b.chunk_bytes)
        msg.cuda_vmm.device_uuid, msg.cuda_vmm.offset = b.device_uuid, b.offset
        msg.cuda_vmm.nbytes = b.nbytes
    else:
        msg.cuda_ipc.handle, msg.cuda_ipc.device_uuid = b.ipc_handle, b.device_uuid
        msg.cuda_ipc.offset, msg.cuda_ipc.nbytes = b.offset, b.nbytes
    return msg


# -- a pool as the service reports it (hicache.pools) -----------------------------------------

_POOL_STATES = {READY: pb.POOL_STATE_READY, CREATING: pb.POOL_STATE_CREATING,
                FAILED: pb.POOL_STATE_FAILED}
_POOL_SCALARS = tuple(f.name for f in fields(PoolInfo) if f.name not in ("spec", "state"))
"""The fields that go onto the wire as they are, each under its own name."""


def fill_deprecated(msg: Any) -> Any:
    """``msg`` with each of its deprecated fields repeating the field it was renamed to."""
    for old, new in DEPRECATED_FIELDS.get(msg.DESCRIPTOR.name, {}).items():
        setattr(msg, old, getattr(msg, new))
    return msg


def pool_to_proto(p: PoolInfo) -> pb.Pool:
    msg = pb.Pool(spec=spec_to_proto(p.spec), state=_POOL_STATES[p.state],  # type: ignore[arg-type]
                  **{name: getattr(p, name) for name in _POOL_SCALARS})
    return fill_deprecated(msg)  # type: ignore[no-any-return]


def pool_from_proto(msg: pb.Pool) -> PoolInfo:
    """The pool a reply reports (from an older daemon too: the old names read through)."""
    values = {name: getattr(msg, name) for name in _POOL_SCALARS}
    for old, new in DEPRECATED_FIELDS["Pool"].items():
        values[new] = values[new] or getattr(msg, old)
    state = pb.PoolState.Name(msg.state).removeprefix("POOL_STATE_")
    if state == READY:
        values["progress"] = 1.0
    return PoolInfo(spec=spec_from_proto(msg.spec), state=state, **values)
