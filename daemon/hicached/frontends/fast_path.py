"""The fast path: the data calls over ``<socket>.fast`` in ``hicache.fast_wire``'s framing.

Python gRPC spends most of a millisecond on each call before and after the handler; a 1-page
Store or a Lookup is a few tens of microseconds of work. Beside every Unix API socket the
daemon offers this socket (``GetInfo.fast_path``), where a connection's own thread reads a
frame, decodes it with ``fast_codec`` into the method's typed request (``service.calls``), runs
the same handler as the gRPC front end and writes the encoded result: no per-call allocation
of gRPC's call objects, contexts, metadata or executors. What every gRPC call gets from the
interceptors, a fast call gets here, in the same order and with the same outcome:

every call goes through the same ``envelope.Envelope`` as a gRPC call (error mapping, metrics,
access rules, admission, the drain gate, in the same order and with the same outcome: a
refusal is sent as the very ``google.rpc.Status`` gRPC would carry); the connection's peer is
the kernel's (SO_PEERCRED and SO_PEERGROUPS at accept), so a Lookup on a pool a rule covers is
allowed for a listed peer without a token; session calls are covered by the capability they
carry.

Heartbeat and ReleaseHolds are served here too (an idle worker's only call: over gRPC it costs
the daemon about a millisecond of CPU each time; a request the scheduler cancels), as control
calls: outside the data path's bound.

After a reply, a connection's thread polls for the worker's next request for an adaptive
window (``fast_path_spin_us`` at most, ``hicache.polling``) before it sleeps: requests that come
back to back skip the wake-up of a sleeping CPU; ``hicache_fast_path_polls_total{result}`` and
``hicache_fast_path_poll_seconds_total`` say what that caught and cost (and how often the node
was too busy to poll).

A frame's buffer grows with what arrives, taking from the daemon-wide
``fast_path_inflight_bytes``; its body must arrive within ``fast_path_body_timeout_s``, or the
connection is closed (``hicache_fast_path_dropped_connections_total{reason}``).

Primitives: ``FastPathServer(envelope, path, ...)``: ``start()``, ``close()`` (no new
connections; open ones are shut, their calls in flight finish first), ``connections``,
``poll_stats()``.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from google.rpc import status_pb2

from hicache import fast_wire as w
from hicache.error_mapping import to_rpc_status
from hicache.errors import (
    HiCacheError,
    Overloaded,
    ResourceExhausted,
    SpecInvalid,
)
from hicache.locks import lock
from hicache.log_limit import LimitedLog
from hicache.paths import remove_if_there
from hicache.polling import PollCounts, sum_counts
from hicached.frontends import fast_codec as fc
from hicached.frontends.envelope import Call, Envelope, Refused
from hicached.frontends.sockets import listen_beside
from hicached.service import calls
from hicached.service.admission import RETRY_AFTER_MS, ByteBudget
from hicached.service.daemon import Daemon
from hicached.service.identity import Peer, peer_of

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024
"""Connections served at once (one thread each, asleep in recv while idle)."""
HELLO_TIMEOUT_SECONDS = 2.0
"""A connection that has not said hello by then is closed."""


class FastPathServer:
    def __init__(self, envelope: Envelope, path: str, *, mode: int = 0o600, gid: int = -1,
                 max_frame_bytes: int = 64 << 20, spin_us: int = 0, body_timeout: float = 5.0,
                 budget: ByteBudget | None = None) -> None:
        """``envelope``: what every call goes through (shared with gRPC); ``path``: the socket
        (beside the API socket, whose lock guards it); ``mode`` and ``gid`` as the API
        socket's; ``max_frame_bytes``: the largest request body; ``spin_us``: the longest a
        connection's thread polls for the next request after a reply before it sleeps
        (``fast_path_spin_us``; the window adapts per connection: ``hicache.polling``);
        ``body_timeout``: the longest a frame may take to arrive once it began
        (``fast_path_body_timeout_s``); ``budget``: the bytes of frames being read
        (``fast_path_inflight_bytes``, shared by the daemon's fast path sockets)."""
        self.envelope, self.daemon = envelope, envelope.daemon
        self.path, self.spin_us = path, spin_us
        self.body_timeout = body_timeout
        self.budget = budget if budget is not None else ByteBudget(256 << 20)
        self._log = LimitedLog(log)
        self._mode, self._gid, self.max_frame_bytes = mode, gid, max_frame_bytes
        self._sock: socket.socket | None = None
        self._conns: dict[socket.socket, w.FrameSocket | None] = {}
        self._closed_polls: PollCounts = (0, 0, 0, 0)  # of the connections gone
        self._lock = lock("fast_path")
        self._closing = False
        self._accepting: threading.Thread | None = None
        self._max_keys = self.daemon.max_keys_per_call
        # per method number: its name, codec and handler (``service.calls``)
        self._methods: dict[int, tuple[str, fc.FastCodec, Callable[[Daemon, Any], Any]]] = {}
        for number, codec in fc.CODECS.items():
            handler = calls.METHODS[codec.name].handler
            assert handler is not None, f"{codec.name} is on the fast path: it has a handler"
            self._methods[number] = (codec.name, codec, handler)

    @property
    def connections(self) -> int:
        return len(self._conns)

    def poll_stats(self) -> PollCounts:
        """The poll counts of the waits for a next request, over every connection served."""
        with self._lock:
            live = [f.poll.counts() for f in self._conns.values() if f is not None]
            total = self._closed_polls
        return sum_counts(total, *live)

    def start(self) -> None:
        self._sock = listen_beside(self.path, self._mode, self._gid, 128)
        self._accepting = threading.Thread(target=self._accept_loop, name="fast-accept",
                                           daemon=True)
        self._accepting.start()

    def close(self) -> None:
        """Stop accepting and shut every connection (a call in flight still replies)."""
        if self._closing:
            return
        self._closing = True
        if self._sock is not None:
            try:  # wake the accept loop (closing its socket would not): it sees _closing
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as poke:
                    poke.settimeout(1.0)
                    poke.connect(self.path)
            except OSError:
                pass
            if self._accepting is not None:
                self._accepting.join(5)
            self._sock.close()
            self._sock = None
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RD)  # its thread's recv returns; a reply still goes
            except OSError:
                pass
        remove_if_there(self.path)

    # -- connections -------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closing and self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            if self._closing:
                conn.close()
                return
            try:
                peer = peer_of(conn)  # who connected, as the kernel recorded it then
            except OSError:
                conn.close()
                continue
            with self._lock:
                full = len(self._conns) >= MAX_CONNECTIONS
                if not full:
                    self._conns[conn] = None
            if full:
                self._log.warning("fast path: %d connections open, refusing pid %d",
                                  MAX_CONNECTIONS, peer.pid, key="full")
                conn.close()  # the client falls back to gRPC
                continue
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True,
                             name=f"fast-{peer.pid}").start()

    def _serve(self, conn: socket.socket, peer: Peer) -> None:
        try:
            conn.settimeout(HELLO_TIMEOUT_SECONDS)
            magic, version, _, _ = w.HELLO.unpack(w.recv_exact(conn, w.HELLO.size))
            conn.sendall(w.HELLO.pack(w.MAGIC, w.VERSION, 0, self.max_frame_bytes))
            if magic != w.MAGIC or version != w.VERSION:
                return  # the client reads our version and speaks gRPC instead
            conn.settimeout(None)
            frames = w.FrameSocket(conn, self.spin_us, self.body_timeout, self.budget)
            with self._lock:
                self._conns[conn] = frames
            while not self._closing:
                try:
                    (_, rid, method, low, high), body = frames.read(w.REQUEST,
                                                                    self.max_frame_bytes)
                except (w.FrameTooLarge, w.FrameTooSlow) as bad:
                    self._refuse(conn, bad, peer)
                    return  # the body is not read: the stream cannot go on
                conn.sendall(self._call(rid, method, w.join_flags(low, high), body, peer))
        except (EOFError, OSError, struct.error):
            pass  # the worker went away (or closed its end): nothing to answer
        finally:
            with self._lock:
                frames_gone = self._conns.pop(conn, None)
                if frames_gone is not None:
                    self._closed_polls = sum_counts(self._closed_polls,
                                                    frames_gone.poll.counts())
            if frames_gone is not None:
                frames_gone.close()  # its bytes go back to the budget, outside our lock
            conn.close()

    def _refuse(self, conn: socket.socket, bad: Exception, peer: Peer) -> None:
        """A frame the daemon will not read to its end: counted, logged (rate-limited),
        answered where the header came whole, and the connection closed."""
        m = self.envelope.metrics
        if isinstance(bad, w.FrameTooLarge):
            length, rid = bad.fields[0], bad.fields[1]
            m.fast_dropped.labels("too_large").inc()
            exc: HiCacheError = ResourceExhausted(
                f"a fast path frame of {length} bytes exceeds the daemon's "
                f"{self.max_frame_bytes}", metadata={
                    "field": "frame", "length": length, "limit": self.max_frame_bytes})
        elif isinstance(bad, w.FrameNotAdmitted):
            m.fast_dropped.labels("overloaded").inc()
            rid = bad.fields[1] if bad.fields else -1
            exc = Overloaded(
                f"{self.budget.in_use} bytes of fast path frames are being read, the "
                f"daemon's fast_path_inflight_bytes; retry in {RETRY_AFTER_MS} ms",
                metadata={"in_use": self.budget.in_use, "limit": self.budget.limit,
                          "retry_after_ms": RETRY_AFTER_MS})
        else:
            assert isinstance(bad, w.FrameTooSlow)
            m.fast_dropped.labels("body_timeout").inc()
            self._log.warning("fast path: pid %d uid %d sent %d of a frame's %d bytes in %.1f "
                              "s: connection closed", peer.pid, peer.uid, bad.got, bad.need,
                              self.body_timeout, key="body_timeout")
            return  # a peer this slow is not waiting for an answer
        self._log.warning("fast path: pid %d uid %d refused: %s", peer.pid, peer.uid, exc,
                          key=exc.reason)
        m.rejected.labels(exc.reason).inc()
        if rid < 0:
            return  # the header did not say which request: nothing to answer to
        conn.settimeout(1.0)
        conn.sendall(_error(rid, to_rpc_status(exc)))

    # -- one call ----------------------------------------------------------------------------

    def _call(self, rid: int, method: int, flags: int, body: bytes, peer: Peer) -> bytes:
        entry = self._methods.get(method)
        if entry is None:
            return _error(rid, to_rpc_status(SpecInvalid(
                f"the fast path has no method {method}",
                metadata={"field": "method", "method": method})))
        name, codec, handler = entry
        daemon, max_keys = self.daemon, self._max_keys
        try:
            out: bytes = self.envelope.run(
                Call(name, "fast", peer=peer),
                lambda: codec.decode(w.Reader(body), flags, max_keys),
                lambda request: codec.encode(handler(daemon, request), flags))
        except Refused as refused:
            return _error(rid, refused.status)
        return w.REPLY.pack(len(out), rid, w.OK) + out


def _error(rid: int, status: status_pb2.Status) -> bytes:
    data: bytes = status.SerializeToString()
    return w.REPLY.pack(len(data), rid, w.ERROR) + data
