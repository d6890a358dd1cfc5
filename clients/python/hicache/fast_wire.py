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

- request: ``REQUEST`` header (body length, request id, method, flags: the low 8 bits, then
  the high 16, ``split_flags`` / ``join_flags``) and the body;
- reply: ``REPLY`` header (body length, request id, ``OK`` or ``ERROR``) and the body, for
  ``ERROR`` a serialized ``google.rpc.Status``.

Bodies: a string is a u16 length and UTF-8; keys are a u32 count, a u8 width (every key that
many bytes) and the keys, or width 0, a u8 length per key and the keys; pages are a u32 count
and that many int64.

- Lookup: pool, credential (a session capability of the pool, or "") and keys; with
  ``FLAG_HOLD`` an i64 ``hold_ms`` follows (the hit is held for the credential's session);
  reply: u32 hit prefix, u32 hits, u32 count and one tier byte per key (0 = absent), with
  ``FLAG_HOLD`` then u32 held, and with ``FLAG_PROMISE`` too then u32 promised.
  ``FLAG_TOUCH``: the hit's host pages count as used now.
- ReleaseHolds: session and keys (none: all); reply: u32 released. A control call.
- Store / LoadKeys: session, i32 layer begin and end, keys, device pages; reply of Store:
  ``STORE_REPLY`` then a u32 count and one status byte per key; of LoadKeys: ``TRANSFER_REPLY``.
- Backup / Load: session, i32 layer begin and end, host pages, device pages; reply:
  ``TRANSFER_REPLY`` (bytes moved, pages, seconds, pending).
- Store, LoadKeys and Load with ``FLAG_DEADLINE``: an i64 deadline (Unix ns) follows the
  body (and a Store's chain).
- Store with ``FLAG_CHAIN``: the keys' chain follows the body: the parent key (u8 length and
  its bytes) and the token ids (a u32 count and that many int64). With ``FLAG_NAMESPACE``
  the pages' namespace follows that (or the body): the LoRA name and the cache salt, each a
  u8 length and that much UTF-8. With ``FLAG_LOOKAHEAD`` the pages' lookahead tokens follow
  that (vLLM's lookahead block hashes): a u16 count per key and the ids (a u32 count and that
  many int64).
- Heartbeat: session; reply: ``HEARTBEAT_REPLY`` (lease, time left, ms). A control call: the
  data path's bound does not apply, as over gRPC.

Primitives: ``FrameSocket`` (reads whole frames into a buffer that grows with what arrived;
``FrameTooLarge``, ``FrameTooSlow``, ``FrameNotAdmitted``; a ``Budget`` for its bytes),
``recv_exact``, the
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
from typing import Any, Protocol

import numpy as np

from hicache.errors import IndicesMalformed, KeyInvalid
from hicache.indices import IndexArray
from hicache.keys import SameWidthKeys, raise_too_many
from hicache.polling import AdaptivePoll

MAGIC = b"HCFP"
VERSION = 1
HELLO = struct.Struct("<4sHHI")
"""magic, version, 0, the largest frame body the daemon accepts (0 from the client)."""
REQUEST = struct.Struct("<IIBBH")
"""body length, request id, method, flags (bits 0-7), flags (bits 8-23: 0 from a client
before ``FLAG_LOOKAHEAD``, and ignored by a daemon before it)."""
REPLY = struct.Struct("<IIBxxx")
"""body length, request id, ``OK`` / ``ERROR``."""
OK, ERROR = 0, 1
FLAG_LAYER_EVENTS = 1
"""LoadKeys / Load: reply once enqueued, the session's layer events signal arrival."""
FLAG_HOLD = 2
"""Lookup: hold the hit for the session named as the credential (``hold_ms`` follows)."""
FLAG_DEADLINE = 4
"""LoadKeys / Load: the caller's deadline follows (i64 Unix ns): no copy begins after it."""
FLAG_CHAIN = 8
"""Store: the parent key and the token ids follow (what routers see of the pages)."""
STORE_DEADLINE = 16
"""Never sent in a frame: in ``GetInfo.fast_path_flags`` it says the daemon reads
``FLAG_DEADLINE`` on a Store too (a daemon from before took it for loads alone and refuses a
Store that carries one: its client sends such a Store without it)."""
FLAG_TOUCH = 32
"""Lookup: the hit's host pages count as used now (no bytes follow: a daemon from before it
reads the frame as a plain Lookup)."""
FLAG_NAMESPACE = 64
"""Store: the pages' LoRA name and cache salt follow the chain (a daemon that does not list
it in ``GetInfo.fast_path_flags`` refuses such a frame: its client sends none)."""
FLAG_PROMISE = 128
"""Lookup with ``FLAG_HOLD``: the reply carries a u32 ``promised`` after ``held`` (a daemon that
does not list it in ``GetInfo.fast_path_flags`` refuses such a frame: its client sends none)."""
FLAG_LOOKAHEAD = 256
"""Store: the pages' lookahead tokens follow the namespace (or the chain, or the body), sent in
the header's high flag bits (a daemon that does not list it in ``GetInfo.fast_path_flags``
reads no such bits and refuses the frame's extra bytes: its client sends it none)."""
KNOWN_FLAGS = (FLAG_LAYER_EVENTS | FLAG_HOLD | FLAG_DEADLINE | FLAG_CHAIN | STORE_DEADLINE
               | FLAG_TOUCH | FLAG_NAMESPACE | FLAG_PROMISE | FLAG_LOOKAHEAD)
"""What this framing's daemon understands (``GetInfo.fast_path_flags``)."""
UNSAID_FLAGS = FLAG_LAYER_EVENTS | FLAG_HOLD | FLAG_DEADLINE
"""What a daemon understands that does not say (one from before ``FLAG_CHAIN`` and
``GetInfo.fast_path_flags``): the flags the framing had then."""

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


def split_flags(flags: int) -> tuple[int, int]:
    """A request's flags as the header carries them: (bits 0-7, bits 8-23)."""
    return flags & 0xFF, flags >> 8


def join_flags(low: int, high: int) -> int:
    return low | high << 8
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

    def keys(self, limit: int | None = None) -> list[bytes]:
        """The keys; ``TOO_MANY_KEYS`` before any is built when there are more than ``limit``."""
        n, width = _KEYS.unpack(self._take(_KEYS.size))
        if limit is not None and n > limit:
            raise_too_many(n, limit)
        if width:  # one C call splits the block (half the time of slicing it in Python)
            return SameWidthKeys(struct.Struct(f"{width}s" * n).unpack(self._take(n * width)),
                                 width)
        lengths = bytes(self._take(n))
        block = bytes(self._take(sum(lengths)))
        out, at = [], 0
        for k in lengths:
            out.append(block[at:at + k])
            at += k
        return out

    def pages(self) -> IndexArray:
        (n,) = _U32.unpack(self._take(4))
        arr = np.frombuffer(self._take(n * 8), dtype="<i8")
        return arr if arr.flags.aligned else arr.copy()  # C code reads them as int64

    def page_bytes(self) -> bytes:
        """What ``pages`` reads, as its little-endian int64 bytes (no array made: a Store's
        token ids, which the daemon keeps as bytes)."""
        (n,) = _U32.unpack(self._take(4))
        return bytes(self._take(n * 8))

    def short_bytes(self) -> bytes:
        """A u8 length and that many bytes (a parent key)."""
        (n,) = _U8.unpack(self._take(1))
        return bytes(self._take(n))

    def u16(self) -> int:
        (v,) = _U16.unpack(self._take(2))
        return int(v)

    def short_str(self, field: str) -> str:
        """A u8 length and that much UTF-8 (``KEY_INVALID`` naming ``field`` when it is not)."""
        raw = self.short_bytes()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise KeyInvalid(f"{field} is not UTF-8", metadata={"field": field}) from None

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


class FrameTooSlow(TimeoutError):
    """A frame's body did not arrive within the reader's ``body_timeout`` (``got`` bytes of
    ``need`` had; ``fields``: the header's, None when it did not come whole)."""

    def __init__(self, got: int, need: int, fields: tuple[Any, ...] | None) -> None:
        super().__init__(f"{got} of a frame's {need} bytes arrived in time")
        self.got, self.need, self.fields = got, need, fields


class FrameNotAdmitted(FrameTooSlow):
    """The reader's byte budget did not have room for the rest of a frame in time."""


class Budget(Protocol):
    """Room for the bytes of frames being read (``hicached.service.admission.ByteBudget``)."""

    def take(self, n: int, deadline: float) -> bool: ...

    def give(self, n: int) -> None: ...


_FIRST_BUFFER = 16 << 10
"""A connection's buffer between frames: a frame that fits arrives with one ``recv``."""


class FrameSocket:
    """Reads whole frames off a stream socket with as few ``recv`` calls as the kernel allows:
    a frame that arrived in one piece costs one call (each call is a point where a busy
    process hands its interpreter lock to another thread). A frame's buffer grows with what
    arrives (doubling), never with what its header announces."""

    __slots__ = ("_body_timeout", "_budget", "_buf", "_sock", "_taken", "_view", "poll")

    def __init__(self, sock: Any, spin_us: int = 0, body_timeout: float | None = None,
                 budget: Budget | None = None) -> None:
        """``spin_us``: the largest window ``read`` polls for the first bytes before it
        sleeps in the kernel (``polling.AdaptivePoll``; 0: it sleeps at once).
        ``body_timeout``: seconds the rest of a frame may take once its first bytes came
        (``FrameTooSlow``; None: no bound). ``budget``: where a buffer grown past the first
        16 KiB takes its bytes from (``FrameNotAdmitted`` when they do not fit in time)."""
        self._sock = sock
        self._buf = bytearray(_FIRST_BUFFER)
        self._view = memoryview(self._buf)
        self._body_timeout, self._budget, self._taken = body_timeout, budget, 0
        self.poll = AdaptivePoll(spin_us)

    def read(self, header: struct.Struct, limit: int = 1 << 62
             ) -> tuple[tuple[Any, ...], bytes]:
        """(the header's fields, the body); ``EOFError`` when the peer closes first,
        ``FrameTooLarge`` (the header's fields in ``fields``) for a body over ``limit``,
        ``FrameTooSlow`` / ``FrameNotAdmitted`` as above. The body length is the header's first
        field; one request or reply is in flight per connection, so nothing beyond the frame
        is ever read."""
        poll, t0 = self.poll, time.monotonic_ns()
        caught = poll.wait(self._sock.fileno())
        got = self._recv(0)  # the first bytes: at once when polled, else after a sleep
        poll.learn(time.monotonic_ns() - t0, caught)
        need, sized, fields = header.size, False, None
        deadline = None
        try:
            while True:
                if not sized and got >= header.size:
                    fields = header.unpack_from(self._buf)
                    if fields[0] > limit:
                        raise FrameTooLarge(fields)
                    need, sized = header.size + fields[0], True
                if sized and got >= need:
                    break
                if deadline is None:  # the frame came in pieces: from now on, bounded
                    deadline = (None if self._body_timeout is None
                                else time.monotonic() + self._body_timeout)
                    if deadline is not None:
                        self._sock.settimeout(self._body_timeout)
                if got == len(self._buf):
                    self._grow(min(max(2 * got, got + _FIRST_BUFFER), need), got, need,
                               deadline, fields)
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                            raise FrameTooSlow(got, need, fields)
                    self._sock.settimeout(left)
                try:
                    got += self._recv(got)
                except TimeoutError:
                    raise FrameTooSlow(got, need, fields) from None
        finally:
            if deadline is not None:
                self._sock.settimeout(None)
        if got > need:
            raise EOFError(f"{got - need} byte(s) after a frame: the peer is out of step")
        out = header.unpack_from(self._buf), bytes(self._view[header.size:need])
        if len(self._buf) > _FIRST_BUFFER:  # a large frame: its buffer and budget go back
            self._release()
        return out

    def _grow(self, size: int, got: int, need: int, deadline: float | None,
              fields: tuple[Any, ...] | None) -> None:
        """A buffer of ``size`` bytes holding what came. The budget pays for the new buffer
        whole while the old one is still alive (the peak of a grow), then gets the old one's
        share back."""
        until = time.monotonic() + 3600 if deadline is None else deadline
        if self._budget is not None and not self._budget.take(size, until):
            raise FrameNotAdmitted(got, need, fields)
        grown = bytearray(size)
        grown[:got] = self._view[:got]
        self._view.release()
        self._buf, self._view = grown, memoryview(grown)
        if self._budget is not None:
            self._budget.give(self._taken)
            self._taken = size

    def _release(self) -> None:
        self._buf = bytearray(_FIRST_BUFFER)
        self._view = memoryview(self._buf)
        if self._taken and self._budget is not None:
            self._budget.give(self._taken)
        self._taken = 0

    def close(self) -> None:
        """Give back what the last frame took of the budget (the connection is done)."""
        self._release()

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


def put_chain(out: list[bytes], parent_key: bytes, token_ids: IndexArray | bytes) -> None:
    """The trailer of a Store sent with ``FLAG_CHAIN`` (``ValueError`` for a parent key of
    256 bytes or more: such a Store goes over gRPC, which names it); ``bytes`` tokens are
    little-endian int64 already."""
    if len(parent_key) > 255:
        raise ValueError("a parent key of 256 bytes or more does not fit the fast path")
    out += (_U8.pack(len(parent_key)), parent_key)
    if isinstance(token_ids, bytes):
        out += (_U32.pack(len(token_ids) // 8), token_ids)
    else:
        put_pages(out, token_ids)


def put_namespace(out: list[bytes], lora_name: str, cache_salt: str) -> None:
    """The trailer of a Store sent with ``FLAG_NAMESPACE`` (``ValueError`` for a name of 256
    UTF-8 bytes or more: such a Store goes over gRPC, which names it)."""
    for value in (lora_name, cache_salt):
        raw = value.encode("utf-8")
        if len(raw) > 255:
            raise ValueError("a name of 256 bytes or more does not fit the fast path")
        out += (_U8.pack(len(raw)), raw)


def put_lookahead(out: list[bytes], per_key: int, token_ids: IndexArray | bytes) -> None:
    """The trailer of a Store sent with ``FLAG_LOOKAHEAD`` (``ValueError`` for a count that
    does not fit a u16: such a Store goes over gRPC, which names it)."""
    if not 0 <= per_key <= 0xFFFF:
        raise ValueError("a lookahead count that does not fit the fast path")
    out.append(_U16.pack(per_key))
    if isinstance(token_ids, bytes):
        out += (_U32.pack(len(token_ids) // 8), token_ids)
    else:
        put_pages(out, token_ids)


def put_layers(out: list[bytes], begin: int, end: int) -> None:
    out.append(LAYERS.pack(begin, end))


def put_tiers(out: list[bytes], tiers: bytes) -> None:
    out += (_U32.pack(len(tiers)), tiers)
