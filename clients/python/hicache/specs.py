"""Pool specs: kinds, dtypes, layouts, geometry, and the byte arithmetic that follows from them.

It mirrors SGLang's host pools so that an SGLang worker's device pool maps onto ours 1:1. Both
sides import it: the daemon to build pools, workers to describe theirs.

Primitives:

- ``PoolKind``: ``MHA`` (K and V), ``MLA`` (one latent buffer), ``DSA_INDEXER`` (page-granular
  index-key bytes per layer), ``OPAQUE`` (one row of ``row_bytes`` bytes per token and layer
  that only the engine interprets: vLLM's blocks), ``LOGICAL`` (no tensor: page-aligned anchor
  slots).
- ``DType``: bfloat16, float16, float32, float8 e4m3 / e5m2, uint8.
- ``Layout``: ``layer_first`` (L, size, ...), ``page_first`` (size, L, ...),
  ``page_first_direct`` (page_num, L, page_size, ...).
- ``KeyFormat``: what a pool's keys are (``DIGEST``, ``VLLM``): how its KV events name blocks.
- ``Role``: which device buffer a component maps to (K, V, KV, INDEX).
- ``KVGeometry``: kind + dtype + dimensions of one storage member; ``components()`` lists its
  buffers, each a ``Component`` with the bytes of one unit (a token, or a whole page for DSA).
- ``MemberSpec`` / ``PoolSpec``: a named pool (anchor + optional side pools sharing page indices,
  as SGLang's HostPoolGroup) with its page size, layout and size in tokens or bytes.
- ``same_storage(a, b)``: two specs that describe the same bytes (a pool created as ``MLA``
  uint8 rows before ``OPAQUE`` existed is the ``OPAQUE`` pool of those rows).
- ``check_page_size`` / ``check_pool_size`` / ``check_canary_source``: the seed spec errors.

Knows nothing of memory or RPC, and imports torch only when a torch dtype is asked for
(``DType.torch_dtype`` / ``DType.from_torch``). Specs validate themselves in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hicache.errors import (
    CanarySourceInvalid,
    PageSizeInvalid,
    PoolSizeNotPageAligned,
    SpecInvalid,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class PoolKind(enum.Enum):
    MHA = "MHA"
    MLA = "MLA"
    DSA_INDEXER = "DSA_INDEXER"
    LOGICAL = "LOGICAL"
    OPAQUE = "OPAQUE"


class DType(enum.Enum):
    BFLOAT16 = "BFLOAT16"
    FLOAT16 = "FLOAT16"
    FLOAT32 = "FLOAT32"
    FLOAT8_E4M3 = "FLOAT8_E4M3"
    FLOAT8_E5M2 = "FLOAT8_E5M2"
    UINT8 = "UINT8"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype (imports torch on first use)."""
        import torch

        return getattr(torch, _TORCH_NAMES[self])  # type: ignore[no-any-return]

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> DType:
        for member in cls:
            if member.torch_dtype == dtype:
                return member
        raise SpecInvalid(f"unsupported dtype {dtype}", metadata={"dtype": str(dtype)})


_ITEMSIZE = {DType.BFLOAT16: 2, DType.FLOAT16: 2, DType.FLOAT32: 4, DType.FLOAT8_E4M3: 1,
             DType.FLOAT8_E5M2: 1, DType.UINT8: 1}
_TORCH_NAMES = {DType.BFLOAT16: "bfloat16", DType.FLOAT16: "float16", DType.FLOAT32: "float32",
                DType.FLOAT8_E4M3: "float8_e4m3fn", DType.FLOAT8_E5M2: "float8_e5m2",
                DType.UINT8: "uint8"}


class Layout(enum.Enum):
    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"


class KeyFormat(enum.Enum):
    """What a pool's page keys are, so that the daemon's KV events name each block as the
    engine that wrote it names it in its own (routers see one block, whoever reports it)."""

    DIGEST = "digest"
    """A digest (SGLang's page hashes, and any client's keys): a block is the key's first 8
    bytes, big-endian, signed (SGLang's ``hash_str_to_int64``)."""
    VLLM = "vllm"
    """vLLM's ``OffloadKey`` (a block hash, then a 4-byte KV cache group index): a block is
    the block hash's last 8 bytes, big-endian, unsigned (vLLM's own KV events, under its
    default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``)."""


class Role(enum.Enum):
    K = "K"
    V = "V"
    KV = "KV"
    INDEX = "INDEX"


@dataclass(frozen=True)
class Component:
    """One buffer of a storage member (MHA has K and V; MLA and OPAQUE have KV; DSA has INDEX).

    A *unit* is what one row of the device buffer holds: a token for MHA/MLA, a whole page for
    DSA (its buffers are page-granular).
    """

    role: Role
    dtype: DType
    unit_shape: tuple[int, ...]
    """Trailing shape of one unit in elements: (heads, head_dim), (1, latent) or (page_bytes,)."""
    page_granular: bool
    """True when a unit is a whole page (DSA index buffers)."""

    @property
    def unit_bytes(self) -> int:
        return math.prod(self.unit_shape) * self.dtype.itemsize

    def units_per_page(self, page_size: int) -> int:
        return 1 if self.page_granular else page_size


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecInvalid(
            f"{name} must be a positive integer, got {value!r}",
            metadata={"field": name, "value": value},
        )


@dataclass(frozen=True)
class KVGeometry:
    """Kind, dtype and dimensions of one storage member (per TP rank, as the worker holds it)."""

    kind: PoolKind
    """What the member stores."""
    dtype: DType = DType.BFLOAT16
    """Element type of the buffers; DSA_INDEXER is always UINT8 (packed keys + fp32 scales),
    OPAQUE always UINT8 (bytes)."""
    layer_num: int = 0
    """Layers held by this member (0 only for LOGICAL)."""
    head_num: int = 0
    """MHA: KV heads per rank."""
    head_dim: int = 0
    """MHA: K head dimension."""
    v_head_dim: int = 0
    """MHA: V head dimension when it differs from head_dim (0 = same as head_dim)."""
    kv_lora_rank: int = 0
    """MLA: compressed latent width."""
    qk_rope_head_dim: int = 0
    """MLA: rope part appended to the latent."""
    index_head_dim: int = 0
    """DSA_INDEXER: index key width in bytes (fp8 keys)."""
    quant_block_size: int = 0
    """DSA_INDEXER: keys per fp32 scale."""
    row_bytes: int = 0
    """OPAQUE: bytes of one token's row per layer."""

    def __post_init__(self) -> None:
        kind = self.kind
        if kind is PoolKind.LOGICAL:
            return
        _positive("layer_num", self.layer_num)
        if kind is PoolKind.MHA:
            _positive("head_num", self.head_num)
            _positive("head_dim", self.head_dim)
            if self.v_head_dim:
                _positive("v_head_dim", self.v_head_dim)
        elif kind is PoolKind.MLA:
            _positive("kv_lora_rank", self.kv_lora_rank)
            if self.qk_rope_head_dim < 0:
                raise SpecInvalid("qk_rope_head_dim must be >= 0")
        elif kind is PoolKind.DSA_INDEXER:
            _positive("index_head_dim", self.index_head_dim)
            _positive("quant_block_size", self.quant_block_size)
            if self.index_head_dim % self.quant_block_size:
                raise SpecInvalid(
                    "index_head_dim must be a multiple of quant_block_size",
                    metadata={
                        "index_head_dim": self.index_head_dim,
                        "quant_block_size": self.quant_block_size,
                    },
                )
            if self.dtype is not DType.UINT8:
                raise SpecInvalid(
                    "DSA_INDEXER buffers are uint8 (packed keys + scales)",
                    metadata={"dtype": self.dtype.value},
                )
        elif kind is PoolKind.OPAQUE:
            _positive("row_bytes", self.row_bytes)
            if self.dtype is not DType.UINT8:
                raise SpecInvalid("OPAQUE rows are bytes (dtype UINT8)",
                                  metadata={"dtype": self.dtype.value})

    def __repr__(self) -> str:
        """The dataclass's repr, but a field added later (``row_bytes``) only where it is
        set: engines name pools by a digest of this repr, and a pool must keep its name
        across an upgrade."""
        parts = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                 if f.name not in _ADDED_FIELDS or getattr(self, f.name) != f.default]
        return f"{type(self).__qualname__}({', '.join(parts)})"

    def components(self, page_size: int) -> tuple[Component, ...]:
        """The buffers of this member; DSA units are whole pages of ``page_size`` tokens."""
        if self.kind is PoolKind.MHA:
            v_dim = self.v_head_dim or self.head_dim
            return (
                Component(Role.K, self.dtype, (self.head_num, self.head_dim), False),
                Component(Role.V, self.dtype, (self.head_num, v_dim), False),
            )
        if self.kind is PoolKind.MLA:
            width = self.kv_lora_rank + self.qk_rope_head_dim
            return (Component(Role.KV, self.dtype, (1, width), False),)
        if self.kind is PoolKind.OPAQUE:
            return (Component(Role.KV, DType.UINT8, (1, self.row_bytes), False),)
        if self.kind is PoolKind.DSA_INDEXER:
            return (Component(Role.INDEX, DType.UINT8, (page_size * self.dsa_token_bytes,), True),)
        return ()

    @property
    def dsa_token_bytes(self) -> int:
        """DSA: bytes per token per layer (keys + one fp32 scale per quant block)."""
        return self.index_head_dim + self.index_head_dim // max(self.quant_block_size, 1) * 4

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page across all layers and components of this member."""
        per_layer = sum(
            c.unit_bytes * c.units_per_page(page_size) for c in self.components(page_size)
        )
        return per_layer * self.layer_num


_ADDED_FIELDS = frozenset({"row_bytes"})
"""``KVGeometry`` fields added after its first release (its repr names them only when set)."""

ANCHOR = "kv"
"""Member name of a pool's anchor; side pools carry their own names."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


@dataclass(frozen=True)
class MemberSpec:
    """A side pool of a group: shares the anchor's page indices, has its own geometry."""

    name: str
    """Unique within the pool; device buffers are handed over under this name."""
    geometry: KVGeometry
    """What the side pool stores."""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name) or self.name == ANCHOR:
            raise SpecInvalid(
                f"side pool name {self.name!r} is invalid or reserved",
                metadata={"name": self.name},
            )


@dataclass(frozen=True)
class CanarySpec:
    """Per-page fingerprints recorded on backup and verified on load."""

    read_bytes: int = 16
    """Bytes hashed from the start of every unit row (multiple of 16, <= unit bytes)."""


@dataclass(frozen=True)
class PoolSpec:
    """A named host pool: an anchor member plus side pools that share its page indices."""

    name: str
    """Pool name; creating a pool that exists with the same spec returns it."""
    geometry: KVGeometry
    """The anchor member (LOGICAL for a pure index anchor)."""
    page_size: int
    """Tokens per page (SGLang allows 1-16 and larger)."""
    layout: Layout = Layout.LAYER_FIRST
    """Host buffer layout, shared by all members."""
    size_tokens: int = 0
    """Pool size in tokens; must be page-aligned. Exclusive with size_bytes."""
    size_bytes: int = 0
    """Byte budget; rounded down to whole pages. Exclusive with size_tokens."""
    side_pools: tuple[MemberSpec, ...] = ()
    """Side pools of a group (e.g. a DSA indexer beside an MLA anchor)."""
    canary: CanarySpec | None = None
    """Enables kv-canary fingerprints when set."""
    key_format: KeyFormat = KeyFormat.DIGEST
    """What the pool's keys are: how its KV events name blocks (not part of its storage: a
    pool's bytes are the same whatever its keys are)."""

    def __post_init__(self) -> None:
        if not isinstance(self.key_format, KeyFormat):
            raise SpecInvalid(f"key_format must be a KeyFormat, got {self.key_format!r}",
                              metadata={"key_format": str(self.key_format)})
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise SpecInvalid(
                f"pool name {self.name!r} must match {_NAME.pattern}",
                metadata={"name": self.name},
            )
        check_page_size(self.page_size)
        if (self.size_tokens > 0) == (self.size_bytes > 0):
            raise SpecInvalid(
                "exactly one of size_tokens and size_bytes must be positive",
                metadata={"size_tokens": self.size_tokens, "size_bytes": self.size_bytes},
            )
        if self.size_tokens < 0 or self.size_bytes < 0:
            raise SpecInvalid("sizes must not be negative")
        if self.size_tokens:
            check_pool_size(self.size_tokens, self.page_size)
        names = [m.name for m in self.side_pools]
        if len(set(names)) != len(names):
            raise SpecInvalid("side pool names must be unique", metadata={"names": names})
        if self.canary is not None:
            for _, geometry in self.members():
                for comp in geometry.components(self.page_size):
                    check_canary_source(comp.unit_bytes, self.canary.read_bytes)
        if self.size_bytes and self.page_bytes == 0:
            raise SpecInvalid("a pool that stores no bytes must be sized in tokens")
        if self.size_bytes and self.size_bytes < self.page_bytes:
            raise SpecInvalid(
                "byte budget is smaller than one page",
                metadata={"size_bytes": self.size_bytes, "page_bytes": self.page_bytes},
            )

    def members(self) -> list[tuple[str, KVGeometry]]:
        """The anchor followed by the side pools, as (member name, geometry)."""
        return [(ANCHOR, self.geometry), *((m.name, m.geometry) for m in self.side_pools)]

    @property
    def page_bytes(self) -> int:
        """Host bytes of one page over every member, layer and component."""
        return sum(g.page_bytes(self.page_size) for _, g in self.members())

    @property
    def max_layers(self) -> int:
        return max(g.layer_num for _, g in self.members())

    def resolved_size_tokens(self) -> int:
        """The pool size in tokens; a byte budget is rounded down to whole pages."""
        if self.size_tokens:
            return self.size_tokens
        pages = self.size_bytes // self.page_bytes
        used = pages * self.page_bytes
        if used != self.size_bytes:
            log.info(
                "pool %s: byte budget %d rounded down to %d pages (%d bytes, %d unused)",
                self.name,
                self.size_bytes,
                pages,
                used,
                self.size_bytes - used,
            )
        return pages * self.page_size


def same_storage(a: PoolSpec, b: PoolSpec) -> bool:
    """Whether ``a`` and ``b`` describe the same pool's bytes: equal but for how a member's
    rows are named, where the members' layers and components (role, dtype, unit shape) are
    equal, and for what the keys are (``key_format``). The daemon stores and moves bytes
    only, so such pools are one: a pool of vLLM's rows created as ``MLA`` uint8
    (``kv_lora_rank`` = the row, no rope) before ``OPAQUE`` existed is the ``OPAQUE`` pool of
    those rows, and a worker that asks for either uses it."""
    if a == b:
        return True
    plain = {"geometry": a.geometry, "side_pools": (), "key_format": a.key_format}
    if dataclasses.replace(a, **plain) != dataclasses.replace(b, **plain):  # type: ignore[arg-type]
        return False
    ma, mb = a.members(), b.members()
    return len(ma) == len(mb) and all(
        na == nb and ga.layer_num == gb.layer_num
        and ga.components(a.page_size) == gb.components(b.page_size)
        for (na, ga), (nb, gb) in zip(ma, mb, strict=True))


def check_page_size(page_size: int) -> None:
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise PageSizeInvalid(
            f"page_size must be >= 1, got {page_size!r}",
            metadata={"page_size": page_size},
        )


def check_pool_size(size_tokens: int, page_size: int) -> None:
    if size_tokens % page_size:
        down = size_tokens // page_size * page_size
        up = down + page_size
        raise PoolSizeNotPageAligned(
            f"pool size {size_tokens} tokens is not a multiple of page_size {page_size}; "
            f"use {down if down else up}",
            metadata={
                "size": size_tokens,
                "page_size": page_size,
                "aligned_size": down if down else up,
                "aligned_down": down,
                "aligned_up": up,
            },
        )


def check_canary_source(bytes_per_token: int, read_bytes: int) -> None:
    """kv-canary reads 16-byte words: both sizes must be positive multiples of 16."""
    meta = {"bytes_per_token": bytes_per_token, "read_bytes": read_bytes}
    if bytes_per_token <= 0 or bytes_per_token % 16:
        raise CanarySourceInvalid(
            f"bytes per token {bytes_per_token} must be a positive multiple of 16", metadata=meta
        )
    if read_bytes <= 0 or read_bytes % 16 or read_bytes > bytes_per_token:
        raise CanarySourceInvalid(
            f"read bytes {read_bytes} must be a positive multiple of 16 "
            f"no larger than bytes per token {bytes_per_token}",
            metadata=meta,
        )
