"""The fast path's framing: the data calls in a compact binary form on a Unix socket.

The daemon serves Store, LoadKeys, Lookup, Backup and Load over gRPC (the contract) and,
beside its Unix API socket, over ``<socket>.fast`` in this framing, which costs a few
microseconds per call to encode and decode instead of Python gRPC's per-call machinery. The
calls mean the same, are validated the same and fail with the same reason codes and metadata:
an error frame carries the very ``google.rpc.Status`` gRPC would have sent. Devices and host
pages travel as page ids (not token indices).

Little-endian throughout. A connection opens with ``HELLO`` both ways (magic, version; the
daemon's adds the largest frame it takes), then carries requests one after another, each
answered before the next is read:

- request: ``REQUEST`` header (body length, request id, method, flags) and the body;
- reply: ``REPLY`` header (body length, request id, ``OK`` or ``ERROR``) and the body, for
  ``ERROR`` a serialized ``google.rpc.Status``.

Bodies: a string is a u16 length and UTF-8; keys are a u32 count, a u8 width (every key that
many bytes) and the keys, or width 0, a u8 length per key and the keys; pages are a u32 count
and that many int64.

- Lookup: pool, credential (a session capability of the pool, or "") and keys; with
  ``FLAG_HOLD`` an i64 ``hold_ms`` follows (the hit is held for the credential's session);
  reply: u32 hit prefix, u32 hits, u32 count and one tier byte per key (0 = absent), with
  ``FLAG_HOLD`` then u32 held.
- ReleaseHolds: session and keys (none: all); reply: u32 released. A control call.
- Store / LoadKeys: session, i32 layer begin and end, keys, device pages; reply of Store:
  ``STORE_REPLY`` then a u32 count and one status byte per key; of LoadKeys: ``TRANSFER_REPLY``.
- Backup / Load: session, i32 layer begin and end, host pages, device pages; reply:
  ``TRANSFER_REPLY`` (bytes moved, pages, seconds, pending).
- LoadKeys and Load with ``FLAG_DEADLINE``: an i64 deadline (Unix ns) follows the body.
- Heartbeat: session; reply: ``HEARTBEAT_REPLY`` (lease, time left, ms). A control call: the
  data path's bound does not apply, as over gRPC.

Primitives: ``FrameSocket`` (reads whole frames; ``FrameTooLarge``), ``recv_exact``, the
``Method`` codes and their gRPC names (``METHOD_NAMES``), ``FLAG_LAYER_EVENTS``, the structs
above, ``Reader`` (decodes a body; ``INDICES_MALFORMED`` naming field ``frame`` when it is
short or has bytes left), and the ``put_*`` encoders (``put_keys`` raises ``ValueError`` for a
key of 256 bytes or more: such a batch goes over gRPC, which names it).
"""

from __future__ import annotations

import enum
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from hicache.errors import IndicesMalformed
from hicache.indices import IndexArray
from hicache.polling import AdaptivePoll

MAGIC = b"HCFP"
VERSION = 1
HELLO = struct.Struct("<4sHHI")
"""magic, version, 0, the largest frame body the daemon accepts (0 from the client)."""
REQUEST = struct.Struct("<IIBBH")
"""body length, request id, method, flags, 0."""
REPLY = struct.Struct("<IIBxxx")
"""body length, request id, ``OK`` / ``ERROR``."""
OK, ERROR = 0, 1
FLAG_LAYER_EVENTS = 1
"""LoadKeys / Load: reply once enqueued, the session's layer events signal arrival."""
FLAG_HOLD = 2
"""Lookup: hold the hit for the session named as the credential (``hold_ms`` follows)."""
FLAG_DEADLINE = 4
"""LoadKeys / Load: the caller's deadline follows (i64 Unix ns): no copy begins after it."""

LAYERS = struct.Struct("<ii")
STORE_REPLY = struct.Struct("<IIIQd")
"""stored, already present, no space, bytes moved, seconds."""
TRANSFER_REPLY = struct.Struct("<QQdB7x")
"""bytes moved, pages, seconds, pending."""
LOOKUP_REPLY = struct.Struct("<III")
"""hit prefix, hits, count (the tier bytes follow)."""
HEARTBEAT_REPLY = struct.Struct("<qq")
"""lease and time left on it, in ms."""
_U8, _U16, _U32 = struct.Struct("<B"), struct.Struct("<H"), struct.Struct("<I")
_I64 = struct.Struct("<q")
_KEYS = struct.Struct("<IB")


class Method(enum.IntEnum):
    LOOKUP = 1
    STORE = 2
    LOAD_KEYS = 3
    BACKUP = 4
    LOAD = 5
    HEARTBEAT = 6
    RELEASE_HOLDS = 7


METHOD_NAMES = {Method.LOOKUP: "Lookup", Method.STORE: "Store", Method.LOAD_KEYS: "LoadKeys",
                Method.BACKUP: "Backup", Method.LOAD: "Load", Method.HEARTBEAT: "Heartbeat",
                Method.RELEASE_HOLDS: "ReleaseHolds"}
"""The gRPC method each code stands for (metrics and errors name calls by it)."""


def malformed(why: str, **metadata: object) -> IndicesMalformed:
    """A body that does not decode as its method's: ``INDICES_MALFORMED``, field ``frame``."""
    return IndicesMalformed(f"fast path frame: {why}", metadata={"field": "frame", **metadata})


class Reader:
    """Decodes one body front to back."""

    __slots__ = ("_buf", "_pos")

    def __init__(self, buf: bytes | memoryview) -> None:
        self._buf = memoryview(buf)
        self._pos = 0

    def _take(self, n: int) -> memoryview:
        end = self._pos + n
        if n < 0 or end > len(self._buf):
            raise malformed(f"ends {end - len(self._buf)} byte(s) early",
                            length=len(self._buf))
        out = self._buf[self._pos:end]
        self._pos = end
        return out

    def string(self) -> str:
        (n,) = _U16.unpack(self._take(2))
        try:
            return str(self._take(n), "utf-8")
        except UnicodeDecodeError:
            raise malformed("a string is not UTF-8") from None

    def layers(self) -> tuple[int, int]:
        begin, end = LAYERS.unpack(self._take(LAYERS.size))
        return begin, end

    def keys(self) -> list[bytes]:
        n, width = _KEYS.unpack(self._take(_KEYS.size))
        if width:
            block = bytes(self._take(n * width))
            return [block[i:i + width] for i in range(0, n * width, width)]
        lengths = bytes(self._take(n))
        block = bytes(self._take(sum(lengths)))
        out, at = [], 0
        for k in lengths:
            out.append(block[at:at + k])
            at += k
        return out

    def pages(self) -> IndexArray:
        (n,) = _U32.unpack(self._take(4))
        return np.frombuffer(self._take(n * 8), dtype="<i8")

    def rest(self) -> bytes:
        return bytes(self._take(len(self._buf) - self._pos))

    def u32(self) -> int:
        (v,) = _U32.unpack(self._take(4))
        return int(v)

    def i64(self) -> int:
        (v,) = _I64.unpack(self._take(8))
        return int(v)

    def end(self) -> None:
        if self._pos != len(self._buf):
            raise malformed(f"{len(self._buf) - self._pos} byte(s) left over")


class FrameTooLarge(ValueError):
    """A frame whose body exceeds the reader's limit (its body is left unread)."""

    def __init__(self, fields: tuple[Any, ...]) -> None:
        super().__init__(f"a frame of {fields[0]} bytes")
        self.fields = fields


class FrameSocket:
    """Reads whole frames off a stream socket with as few ``recv`` calls as the kernel allows:
    a frame that arrived in one piece costs one call (each call is a point where a busy
    process hands its interpreter lock to another thread)."""

    __slots__ = ("_buf", "_sock", "_view", "poll")

    def __init__(self, sock: Any, spin_us: int = 0) -> None:
        """``spin_us``: the largest window ``read`` polls for the first bytes before it
        sleeps in the kernel (``polling.AdaptivePoll``; 0: it sleeps at once)."""
        self._sock = sock
        self._buf = bytearray(1 << 16)
        self._view = memoryview(self._buf)
        self.poll = AdaptivePoll(spin_us)

    def read(self, header: struct.Struct, limit: int = 1 << 62
             ) -> tuple[tuple[Any, ...], bytes]:
        """(the header's fields, the body); ``EOFError`` when the peer closes first,
        ``FrameTooLarge`` (the header's fields in ``fields``) for a body over ``limit``. The
        body length is the header's first field; one request or reply is in flight per
        connection, so nothing beyond the frame is ever read."""
        if len(self._buf) > 1 << 20:  # the last frame was large: give the memory back
            self._buf = bytearray(1 << 16)
            self._view = memoryview(self._buf)
        poll, t0 = self.poll, time.monotonic_ns()
        caught = poll.wait(self._sock.fileno())
        got = self._recv(0)  # the first bytes: at once when polled, else after a sleep
        poll.learn(time.monotonic_ns() - t0, caught)
        need, sized = header.size, False
        while True:
            if not sized and got >= header.size:
                fields = header.unpack_from(self._buf)
                if fields[0] > limit:
                    raise FrameTooLarge(fields)
                need, sized = header.size + fields[0], True
                if need > len(self._buf):  # a large frame: room for all of it
                    self._buf = self._buf[:got] + bytearray(need - got)
                    self._view = memoryview(self._buf)
            if sized and got >= need:
                break
            got += self._recv(got)
        if got > need:
            raise EOFError(f"{got - need} byte(s) after a frame: the peer is out of step")
        return header.unpack_from(self._buf), bytes(self._view[header.size:need])

    def _recv(self, at: int) -> int:
        n: int = self._sock.recv_into(self._view[at:], len(self._buf) - at)
        if not n:
            raise EOFError("the peer closed the connection")
        return n


def recv_exact(sock: Any, n: int) -> bytes:
    """``n`` bytes off a stream socket (the hellos); ``EOFError`` when the peer closes first."""
    data: bytes = sock.recv(n, socket.MSG_WAITALL)
    if len(data) < n:
        raise EOFError("the peer closed the connection")
    return data


def put_string(out: list[bytes], s: str) -> None:
    data = s.encode()
    out += (_U16.pack(len(data)), data)


def put_keys(out: list[bytes], keys: Sequence[bytes]) -> None:
    """Keys of one width travel as one block (SGLang's are all 32 bytes)."""
    width = len(keys[0]) if keys else 0
    if all(len(k) == width for k in keys) and 0 < width < 256:
        out += (_KEYS.pack(len(keys), width), b"".join(keys))
    elif max(map(len, keys)) < 256:  # the daemon names a key of 0 or > 64 bytes
        out += (_KEYS.pack(len(keys), 0), bytes(map(len, keys)), b"".join(keys))
    else:
        raise ValueError("a key of 256 bytes or more does not fit the fast path's framing")


def put_i64(out: list[bytes], value: int) -> None:
    out.append(_I64.pack(value))


def put_u32(out: list[bytes], value: int) -> None:
    out.append(_U32.pack(value))


def put_pages(out: list[bytes], pages: IndexArray) -> None:
    arr = np.ascontiguousarray(pages, dtype="<i8")
    out += (_U32.pack(arr.size), arr.tobytes())


def put_layers(out: list[bytes], begin: int, end: int) -> None:
    out.append(LAYERS.pack(begin, end))


def put_tiers(out: list[bytes], tiers: bytes) -> None:
    out += (_U32.pack(len(tiers)), tiers)
