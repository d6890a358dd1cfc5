"""The on-disk format of a pool's disk tier: a page file and an index file of fixed records.

- ``<pool>.pages``: slot ``i`` at ``i * slot_bytes`` holds one page (``slot_bytes`` is the
  page's size rounded up to 4 KiB, so O_DIRECT works).
- ``<pool>.index``: a 4 KiB header (magic, format version, JSON: the pool spec, page bytes,
  slot count, under a crc32), then one 128-byte record per slot: state, key length, a store
  sequence, the page's xxh3-64 checksum, the record's own crc32, the key.

A record is written only after its page's bytes (and, with ``fsync = "batch"``, after they are
on the device), so a crash never leaves a record naming a page that was not written; a torn
record fails its crc, a torn or rotted page fails its checksum on read. Neither is served.

Primitives: ``slot_bytes(page_bytes)``, ``record_bytes(key, seq, digest)`` /
``parse_record(raw)``, ``header_bytes(doc)`` / ``parse_header(raw)``. The page checksum is
xxh3-64, computed by ``disk`` run by run while each run is in cache.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

from hicache.keys import MAX_KEY_BYTES

MAGIC = b"HCDISK\0\0"
VERSION = 1
HEADER_BYTES = 4096
RECORD_BYTES = 128
ALIGN = 4096
VALID = 1

_HEAD = struct.Struct("<8sIII")  # magic, version, json length, json crc
_REC = struct.Struct(f"<IIQQI4x{MAX_KEY_BYTES}s")  # state, key len, seq, hash, crc, key
_CRC_SKIP = slice(24, 28)  # the crc field itself


def slot_bytes(page_bytes: int) -> int:
    return -(-page_bytes // ALIGN) * ALIGN


def _crc(raw: bytes) -> int:
    return zlib.crc32(raw[:_CRC_SKIP.start] + raw[_CRC_SKIP.stop:])


def record_bytes(key: bytes, seq: int, digest: int) -> bytes:
    raw = bytearray(RECORD_BYTES)
    _REC.pack_into(raw, 0, VALID, len(key), seq, digest, 0, key)
    struct.pack_into("<I", raw, _CRC_SKIP.start, _crc(bytes(raw)))
    return bytes(raw)


def parse_record(raw: bytes) -> tuple[bytes, int, int] | None:
    """(key, seq, page hash) of a valid record; None for a free, torn or damaged one."""
    state, n, seq, digest, crc, key = _REC.unpack_from(raw)
    if state != VALID or not 0 < n <= MAX_KEY_BYTES or crc != _crc(raw[:RECORD_BYTES]):
        return None
    return key[:n], seq, digest


def header_bytes(doc: dict[str, Any]) -> bytes:
    body = json.dumps(doc, sort_keys=True).encode()
    raw = bytearray(HEADER_BYTES)
    _HEAD.pack_into(raw, 0, MAGIC, VERSION, len(body), zlib.crc32(body))
    raw[_HEAD.size:_HEAD.size + len(body)] = body
    return bytes(raw)


def parse_header(raw: bytes) -> tuple[dict[str, Any] | None, str]:
    if len(raw) < HEADER_BYTES:
        return None, "short header"
    magic, version, n, crc = _HEAD.unpack_from(raw)
    if magic != MAGIC:
        return None, "bad magic"
    if version != VERSION:
        return None, f"format {version}, this daemon reads {VERSION}"
    body = raw[_HEAD.size:_HEAD.size + n]
    if n > HEADER_BYTES - _HEAD.size or zlib.crc32(body) != crc:
        return None, "header checksum"
    doc: dict[str, Any] = json.loads(body)
    return doc, ""
