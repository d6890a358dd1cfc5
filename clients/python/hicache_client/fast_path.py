"""The client's side of the fast path: the data calls over ``<socket>.fast``.

``HiCacheClient`` asks ``GetInfo`` once whether the daemon offers the fast path (Unix targets
only) and then sends Store, LoadKeys, Lookup, Backup and Load there, falling back to gRPC by
itself; ``HiCacheClient.data_path`` says which it uses ("fast" or "grpc").

Primitives:

- ``FastPath(path, timeout)``: one connection per calling thread (opened on first use, hello
  exchanged; closed when the thread ends); ``call(method, parts, flags, timeout)`` returns
  the reply body or raises the daemon's domain error, rebuilt from the ``google.rpc.Status``
  it sent, as gRPC would; ``FastPathLost`` when the connection failed (the caller retries
  over gRPC); ``close()``.
- ``page_ids(indices, page_size)``: token indices as page ids, or None when they are not
  whole aligned page runs (such a batch goes over gRPC, where the daemon names what is
  wrong).
- ``decode_lookup`` / ``decode_store`` / ``decode_transfer``: reply bodies as results; the
  ``*_body`` builders: request bodies.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import threading
import weakref
from collections.abc import Collection, Sequence

import grpc
import numpy as np

from hicache import fast_wire as w
from hicache.error_mapping import from_status, from_status_bytes
from hicache.errors import DaemonUntrusted, HiCacheError
from hicache.indices import IndexArray, to_index_array
from hicache.locks import lock
from hicache_client.identity import check_daemon, trusted_uids
from hicache_client.results import LookupResult, StoreResult, TransferStats

U32 = struct.Struct("<I")
_U32 = U32
_ARANGES: dict[int, IndexArray] = {}


class FastPathLost(Exception):
    """The fast path's connection failed before a reply: the call goes over gRPC."""


class _Conn:
    """One thread's connection; closed when that thread ends (its thread-local goes) or the
    client closes."""

    __slots__ = ("__weakref__", "frames", "sock", "timeout")

    def __init__(self, sock: socket.socket, spin_us: int) -> None:
        self.sock = sock
        self.frames = w.FrameSocket(sock, spin_us)
        self.timeout: float | None = None

    def set_timeout(self, seconds: float) -> None:
        if self.timeout != seconds:
            tv = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            self.timeout = seconds

    def __del__(self) -> None:
        self.sock.close()


class FastPath:
    def __init__(self, path: str, timeout: float, spin_us: int = 0,
                 trusted: Collection[int] | None = None) -> None:
        """``spin_us``: how long a call polls for its reply before sleeping in the kernel;
        ``trusted``: the uids the daemon may run as (``identity.trusted_uids``)."""
        self.path = path
        self.trusted = trusted_uids() if trusted is None else trusted
        self.timeout = timeout
        self.spin_us = spin_us
        self._local = threading.local()
        self._conns: weakref.WeakSet[_Conn] = weakref.WeakSet()
        self._lock = lock("fast_path.client")
        self._ids = itertools.count(1)
        self.closed = False
        self._pid = os.getpid()

    @property
    def connections(self) -> int:
        """Connections open now (one per thread that called and is still alive)."""
        return len(self._conns)

    def _connect(self, timeout: float) -> _Conn:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(timeout)
            s.connect(self.path)
            check_daemon(s, self.path, self.trusted)  # before a byte of KV goes to it
            s.sendall(w.HELLO.pack(w.MAGIC, w.VERSION, 0, 0))
            magic, version, _, _ = w.HELLO.unpack(w.recv_exact(s, w.HELLO.size))
        except TimeoutError:
            s.close()
            raise deadline_exceeded("opening the connection") from None
        except DaemonUntrusted:
            s.close()
            raise
        except (OSError, EOFError, struct.error) as exc:
            s.close()
            raise FastPathLost(f"cannot open the fast path at {self.path}: {exc}") from None
        if magic != w.MAGIC or version != w.VERSION:
            s.close()
            raise FastPathLost(f"the fast path at {self.path} speaks version {version}, "
                               f"this client {w.VERSION}")
        s.settimeout(None)  # blocking: a timed-out socket polls before each recv, and on a
        # VM a poll that sleeps longer than ~20 us wakes ~75 us late; the kernel's own
        # timeouts (SO_RCVTIMEO / SO_SNDTIMEO) bound each call instead
        conn = _Conn(s, self.spin_us)
        with self._lock:
            if self.closed:
                s.close()
                raise FastPathLost("the client is closed")
            self._conns.add(conn)
        self._local.conn = conn
        return conn

    def _drop(self, conn: _Conn) -> None:
        self._local.conn = None
        self._conns.discard(conn)
        conn.sock.close()

    def call(self, method: w.Method, parts: list[bytes], flags: int = 0,
             timeout: float | None = None) -> bytes:
        """Send one request, wait for its reply body (``timeout`` or the client's)."""
        if self._pid != os.getpid():
            self._forked()
        seconds = timeout or self.timeout
        conn: _Conn = getattr(self._local, "conn", None) or self._connect(seconds)
        body = b"".join(parts)
        rid = next(self._ids) & 0xFFFFFFFF
        try:
            conn.set_timeout(seconds)
            conn.sock.sendall(w.REQUEST.pack(len(body), rid, method, *w.split_flags(flags))
                              + body)
            (_, got, status), data = conn.frames.read(w.REPLY)
        except (TimeoutError, BlockingIOError):  # SO_RCVTIMEO / SO_SNDTIMEO ran out
            self._drop(conn)  # its reply may still come: the stream is out of step
            raise deadline_exceeded("waiting for the reply") from None
        except (OSError, EOFError, struct.error) as err:
            self._drop(conn)
            raise FastPathLost(f"the fast path at {self.path} failed: {err!r}") from None
        if got != rid:
            self._drop(conn)
            raise FastPathLost(f"the fast path answered request {got}, not {rid}")
        if status != w.OK:
            raise from_status_bytes(data)
        return data

    def _forked(self) -> None:
        """In a child: the parent's connections are the parent's (a frame written on one here
        would interleave with the parent's); this process opens its own. Dropping the
        inherited ones closes this process's copies of their fds; the parent's streams stay."""
        self._pid = os.getpid()
        self._lock = lock("fast_path.client")
        self._local = threading.local()
        self._conns = weakref.WeakSet()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            conns, self._conns = list(self._conns), weakref.WeakSet()
        for c in conns:
            c.sock.close()


def deadline_exceeded(where: str) -> HiCacheError:
    """What gRPC raises when a call's deadline passes, for the fast path's calls."""
    exc: HiCacheError = from_status(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"Deadline Exceeded (fast path, {where})", None)
    return exc


def page_ids(indices: object, page_size: int) -> IndexArray | None:
    """Whole aligned page runs of token indices as page ids; None otherwise."""
    try:
        arr = to_index_array(indices, "indices")
    except HiCacheError:
        return None  # gRPC's encoding raises the same, before anything is sent
    if page_size == 1:
        return arr
    n = arr.size
    if page_size < 1 or n % page_size:
        return None
    if n == 0:
        return arr
    first = int(arr[0])
    if first % page_size:
        return None
    # one run of consecutive rows (an engine's usual batch): ascending from its first row to
    # its last with no gap is the whole check, two numpy calls instead of six
    if int(arr[-1]) - first == n - 1 and bool((arr[1:] > arr[:-1]).all()):
        return np.arange(first // page_size, first // page_size + n // page_size,
                         dtype=np.int64)
    rows = arr.reshape(-1, page_size)
    starts = rows[:, 0]
    if (starts % page_size).any():
        return None
    offsets = _ARANGES.get(page_size)
    if offsets is None:
        offsets = _ARANGES[page_size] = np.arange(page_size, dtype=np.int64)
    if not bool(((rows - starts[:, None]) == offsets).all()):
        return None
    return starts // page_size


def decode_lookup(data: bytes, held: bool = False, promise: bool = False) -> LookupResult:
    hit_prefix, hits, n = w.LOOKUP_REPLY.unpack_from(data)
    at = w.LOOKUP_REPLY.size
    count = _U32.unpack_from(data, at + n)[0] if held else 0
    promised = _U32.unpack_from(data, at + n + 4)[0] if held and promise else -1
    return LookupResult(hit_prefix, data[at:at + n], hits, count, promised)


def decode_store(data: bytes) -> StoreResult:
    stored, present, no_space, nbytes, seconds = w.STORE_REPLY.unpack_from(data)
    at = w.STORE_REPLY.size
    (n,) = _U32.unpack_from(data, at)
    return StoreResult(stored, present, no_space, data[at + 4:at + 4 + n], nbytes, seconds)


def decode_transfer(data: bytes) -> TransferStats:
    nbytes, pages, seconds, pending = w.TRANSFER_REPLY.unpack(data)
    return TransferStats(nbytes, pages, seconds, bool(pending))


def keyed_body(session_id: str, keys: Sequence[bytes], device: IndexArray,
               layers: tuple[int, int] = (0, 0), deadline_ns: int = 0,
               chain: tuple[bytes, IndexArray | bytes] | None = None,
               namespace: tuple[str, str] | None = None,
               lookahead: tuple[int, IndexArray | bytes] | None = None) -> list[bytes]:
    """The body of a Store or LoadKeys (``ValueError`` for a key the framing cannot carry);
    a Store's chain (send ``FLAG_CHAIN``), its namespace (``FLAG_NAMESPACE``), its lookahead
    tokens (``FLAG_LOOKAHEAD``), then the call's deadline (``FLAG_DEADLINE``)."""
    parts: list[bytes] = []
    w.put_string(parts, session_id)
    w.put_layers(parts, *layers)
    w.put_keys(parts, keys)
    w.put_pages(parts, device)
    if chain is not None:
        w.put_chain(parts, *chain)
    if namespace is not None:
        w.put_namespace(parts, *namespace)
    if lookahead is not None:
        w.put_lookahead(parts, *lookahead)
    if deadline_ns:
        w.put_i64(parts, deadline_ns)
    return parts


def raw_body(session_id: str, host: IndexArray, device: IndexArray,
             layers: tuple[int, int], deadline_ns: int = 0) -> list[bytes]:
    parts: list[bytes] = []
    w.put_string(parts, session_id)
    w.put_layers(parts, *layers)
    w.put_pages(parts, host)
    w.put_pages(parts, device)
    if deadline_ns:
        w.put_i64(parts, deadline_ns)
    return parts


def session_body(session_id: str) -> list[bytes]:
    parts: list[bytes] = []
    w.put_string(parts, session_id)
    return parts


def lookup_body(pool: str, capability: str, keys: Sequence[bytes], hold_ms: int = 0
                ) -> list[bytes]:
    """A Lookup; with ``hold_ms`` (send ``FLAG_HOLD``) the hit is held for ``capability``."""
    parts: list[bytes] = []
    w.put_string(parts, pool)
    w.put_string(parts, capability)
    w.put_keys(parts, keys)
    if hold_ms:
        w.put_i64(parts, hold_ms)
    return parts


def release_body(session_id: str, keys: Sequence[bytes]) -> list[bytes]:
    parts: list[bytes] = []
    w.put_string(parts, session_id)
    w.put_keys(parts, keys)
    return parts
