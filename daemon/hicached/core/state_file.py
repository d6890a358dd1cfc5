"""A pool's state in files that outlive the daemon: its memory and its tables.

Per pool ``<name>`` under the state directory (tmpfs by default, a hugetlbfs mount where the
operator gives one):

- ``<name>.data``: the pool's memory (``HostMemory`` FILE backing, kept when the pool closes).
- ``<name>.meta``: a 4 KiB header, then the tables that say what the memory holds, each
  64-byte aligned: the allocator's per-page state, kind, owner and written bits
  (``core.allocator``), the key slots (``cache.key_slots``) and the kv-canary fingerprints.
  The files are mapped shared: what the daemon wrote before a SIGKILL is there after it.

The header: magic ``HICACHE\\0``, a format version, the length and crc32 of a JSON document
(the pool spec, page count, data size, table layout) and, apart from it, a 64-bit generation
(one aligned store, bumped at every attach). A pool re-attaches only when magic, version,
crc and the whole JSON equal what this daemon computes for the spec; otherwise it starts cold
and says why (``Outcome``). Files that are not the daemon's own (another owner, writable by
others, a symlink) are never re-attached nor read: ``cold_untrusted``.

Primitives:

- ``spec_to_dict`` / ``spec_from_dict``: a ``PoolSpec`` as plain JSON data and back.
- ``TableSpec``: one named table (dtype, shape); ``layout(tables)`` places them.
- ``StateFiles(state_dir, spec, data_bytes, tables)``: ``open()`` -> ``Outcome`` (created,
  reattached, or cold with a reason, the old files replaced); ``table(name)`` numpy views;
  ``data_path``; ``generation``; ``close()``; ``remove()``.
- ``read_header(meta_path)``: the header's JSON of a meta file (or why it is unreadable), to
  find the pools a state directory holds (``saved_specs(state_dir)``).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache.errors import SpecInvalid
from hicache.paths import remove_if_there, remove_state
from hicache.specs import (
    CanarySpec,
    DType,
    KeyFormat,
    KVGeometry,
    Layout,
    MemberSpec,
    PoolKind,
    PoolSpec,
)
from hicached.core.trusted_paths import UntrustedPath, open_own, own_dir, untrusted_file

log = logging.getLogger(__name__)

MAGIC = b"HICACHE\0"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
_FIXED = struct.Struct("<8sIII4xQ")  # magic, version, json length, json crc, generation
_GENERATION_OFFSET = 24
_JSON_OFFSET = 64
ALIGN = 64


_ADDED = frozenset({"row_bytes", "key_format"})
"""Spec fields added after the format's first release (absent from a file means the default)."""


def spec_to_dict(spec: PoolSpec) -> dict[str, Any]:
    def plain(v: Any) -> Any:
        if isinstance(v, enum.Enum):
            return v.value
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            # a field added later is written only when set, so that a daemon from before it
            # still reads the file of a pool that does not use it
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)
                    if f.name not in _ADDED or getattr(v, f.name) != f.default}
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        return v
    out: dict[str, Any] = plain(spec)
    return out


def spec_from_dict(d: dict[str, Any]) -> PoolSpec:
    def geometry(g: dict[str, Any]) -> KVGeometry:
        return KVGeometry(**{**g, "kind": PoolKind(g["kind"]), "dtype": DType(g["dtype"])})
    canary = d.get("canary")
    return PoolSpec(
        name=d["name"], geometry=geometry(d["geometry"]), page_size=d["page_size"],
        layout=Layout(d["layout"]), size_tokens=d["size_tokens"], size_bytes=d["size_bytes"],
        side_pools=tuple(MemberSpec(m["name"], geometry(m["geometry"]))
                         for m in d["side_pools"]),
        canary=CanarySpec(**canary) if canary else None,
        key_format=KeyFormat(d.get("key_format", KeyFormat.DIGEST.value)))


@dataclass(frozen=True)
class TableSpec:
    name: str
    dtype: np.dtype[Any] | str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.dtype(self.dtype).itemsize * int(np.prod(self.shape, dtype=np.int64)))


def layout(tables: list[TableSpec]) -> dict[str, int]:
    """Offset of each table in the meta file (after the header, 64-byte aligned)."""
    out, off = {}, HEADER_BYTES
    for t in tables:
        out[t.name] = off
        off += -(-t.nbytes // ALIGN) * ALIGN
    out[""] = off  # the file's size
    return out


class Outcome(enum.Enum):
    CREATED = "created"
    REATTACHED = "reattached"
    COLD_VERSION = "cold_version"
    """Files of another format version: replaced."""
    COLD_MISMATCH = "cold_mismatch"
    """Files of another spec or geometry: replaced."""
    COLD_CORRUPT = "cold_corrupt"
    """A torn or damaged header, or a data file of the wrong size: replaced."""
    COLD_UNTRUSTED = "cold_untrusted"
    """Files not the daemon's own (another owner, writable by others, a symlink): never
    re-attached, replaced."""


def untrusted_state(state_dir: str, name: str) -> str:
    """Why a saved pool's files are not the daemon's own ("" when they are, or are absent)."""
    for suffix in (".meta", ".data"):
        try:
            st = os.lstat(os.path.join(state_dir, name + suffix))
        except FileNotFoundError:
            continue
        why = untrusted_file(st)
        if why:
            return f"untrusted: {name}{suffix} is {why}"
    return ""


def read_header(meta_path: str) -> tuple[dict[str, Any] | None, str]:
    """(the header's JSON, '') or (None, why it cannot be used); a file that is not the
    daemon's own is not read."""
    try:
        fd = open_own(meta_path, os.O_RDONLY)
    except UntrustedPath as exc:
        return None, f"untrusted: {exc.why}"
    except OSError as exc:
        return None, f"unreadable: {exc.strerror}"
    with os.fdopen(fd, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES:
        return None, "corrupt: short header"
    magic, version, length, crc, _gen = _FIXED.unpack_from(head)
    if magic != MAGIC:
        return None, "corrupt: bad magic"
    if version != FORMAT_VERSION:
        return None, f"version: format {version}, this daemon reads {FORMAT_VERSION}"
    body = head[_JSON_OFFSET:_JSON_OFFSET + length]
    if length > HEADER_BYTES - _JSON_OFFSET or zlib.crc32(body) != crc:
        return None, "corrupt: header checksum"
    try:
        doc: dict[str, Any] = json.loads(body)
    except ValueError:
        return None, "corrupt: header is not JSON"
    return doc, ""


def saved_specs(state_dir: str) -> dict[str, tuple[PoolSpec | None, str]]:
    """Pools whose state a directory holds: name -> (spec, '') or (None, why not usable)."""
    out: dict[str, tuple[PoolSpec | None, str]] = {}
    try:
        names = sorted(os.listdir(state_dir))
    except FileNotFoundError:
        return out
    for fn in names:
        if not fn.endswith(".meta"):
            continue
        doc, why = read_header(os.path.join(state_dir, fn))
        try:
            out[fn[:-5]] = (spec_from_dict(doc["spec"]), "") if doc else (None, why)
        except (KeyError, TypeError, ValueError, SpecInvalid) as exc:
            out[fn[:-5]] = (None, f"corrupt: spec unreadable ({exc})")
    return out


class StateFiles:
    def __init__(self, state_dir: str, spec: PoolSpec, data_bytes: int,
                 tables: list[TableSpec]) -> None:
        self.spec = spec
        self.state_dir = state_dir
        self.meta_path = os.path.join(state_dir, f"{spec.name}.meta")
        self.data_path = os.path.join(state_dir, f"{spec.name}.data")
        self.data_bytes = data_bytes
        self._tables = {t.name: t for t in tables}
        self._offsets = layout(tables)
        self._doc = {"spec": spec_to_dict(spec), "data_bytes": data_bytes,
                     "tables": [[t.name, np.dtype(t.dtype).str, list(t.shape),
                                 self._offsets[t.name]] for t in tables]}
        self._mm: mmap.mmap | None = None
        self.outcome: Outcome | None = None
        self.reason = ""

    def open(self) -> Outcome:
        """Map the meta file: the saved one when it matches, else a fresh one (the old files
        of that name are removed first, so no byte of another geometry is ever served)."""
        own_dir(self.state_dir)
        outcome, why = self._match()
        if outcome is not Outcome.REATTACHED:
            if outcome is not Outcome.CREATED:
                log.warning("pool %s starts cold: its saved state is unusable (%s)",
                            self.spec.name, why)
            self.remove()
            self._create()
        fd = open_own(self.meta_path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, self._offsets[""], flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        gen = self.generation + 1
        struct.pack_into("<Q", self._mm, _GENERATION_OFFSET, gen)
        self.outcome, self.reason = outcome, why
        return outcome

    def _match(self) -> tuple[Outcome, str]:
        untrusted = untrusted_state(self.state_dir, self.spec.name)
        if untrusted:
            return Outcome.COLD_UNTRUSTED, untrusted
        if not os.path.lexists(self.meta_path):
            return Outcome.CREATED, ""
        doc, why = read_header(self.meta_path)
        if doc is None:
            return (Outcome.COLD_VERSION if why.startswith("version") else
                    Outcome.COLD_CORRUPT), why
        if doc != json.loads(json.dumps(self._doc)):
            return Outcome.COLD_MISMATCH, "saved with another spec, geometry or table layout"
        try:
            sizes = os.path.getsize(self.meta_path), os.path.getsize(self.data_path)
        except OSError:
            return Outcome.COLD_CORRUPT, "the data file is missing"
        if sizes != (self._offsets[""], self.data_bytes):
            return Outcome.COLD_CORRUPT, f"file sizes {sizes} are not the spec's"
        return Outcome.REATTACHED, ""

    def _create(self) -> None:
        body = json.dumps(self._doc).encode()
        if len(body) > HEADER_BYTES - _JSON_OFFSET:
            raise SpecInvalid(f"pool {self.spec.name}: spec too large for the state header")
        head = bytearray(HEADER_BYTES)
        _FIXED.pack_into(head, 0, MAGIC, FORMAT_VERSION, len(body), zlib.crc32(body), 0)
        head[_JSON_OFFSET:_JSON_OFFSET + len(body)] = body
        tmp = self.meta_path + ".new"
        remove_if_there(tmp)  # a killed daemon's, or planted: never written through
        fd = open_own(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            os.ftruncate(fd, self._offsets[""])  # tables start zeroed: everything free
            os.pwrite(fd, bytes(head), 0)
        finally:
            os.close(fd)
        os.replace(tmp, self.meta_path)  # the header appears whole or not at all

    @property
    def generation(self) -> int:
        if self._mm is None:
            return 0
        return int(struct.unpack_from("<Q", self._mm, _GENERATION_OFFSET)[0])

    def table(self, name: str) -> np.ndarray:
        """A writable view of one table (lives as long as the mapping)."""
        assert self._mm is not None, "open() first"
        t = self._tables[name]
        return np.frombuffer(self._mm, dtype=t.dtype, count=int(np.prod(t.shape)),
                             offset=self._offsets[name]).reshape(t.shape)

    def close(self) -> None:
        """Unmap; the files stay (that is the point)."""
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views still alive: unmapped when they go

    def remove(self) -> None:
        """Delete both files (DeletePool, a cold start, ``hicachectl drop-state``)."""
        self.close()
        remove_state(self.state_dir, self.spec.name)
