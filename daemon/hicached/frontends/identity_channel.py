"""The identity socket beside each Unix API socket: who is calling, and the fds it hands over.

gRPC in Python carries neither peer credentials nor file descriptors over Unix sockets, so the
daemon serves a tiny channel at ``<api socket>.id``. A worker connects and sends one JSON line
``{"fds": n}`` with ``n`` fds attached (SCM_RIGHTS; 0 when it only identifies itself). The
daemon reads the kernel's SO_PEERCRED of the connection (pid, uid, gid) and SO_PEERGROUPS
(its supplementary groups), both as they were when it connected, and answers one JSON line,
``{"token": ..., "uid": ...}`` or ``{"error": ...}``. The token names a ``Grant`` (that peer,
those fds); ``OpenSession`` redeems it once (``peer_token``) within ``TOKEN_TTL_SECONDS``.
Only the process that connected learns it.

One thread serves every connection with non-blocking sockets, so idle or slow connections cost
an fd and nothing else: each gets ``REQUEST_TIMEOUT_SECONDS`` to send its line, at most
``MAX_CONNECTIONS`` are open at once (newer ones are closed), at most ``MAX_FDS_PER_REQUEST``
fds come with one request and ``MAX_HELD_FDS`` wait for their OpenSession; fds of expired or
refused grants are closed.

Primitives:

- ``IdentityChannel(path, mode, gid)``: ``start()``, ``redeem(token) -> Grant | None`` (the
  caller owns the grant's fds), ``close()``.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field, replace

from hicache.buffers import MAX_FDS
from hicache.locks import lock
from hicache.paths import remove_if_there
from hicached.frontends.sockets import listen_beside
from hicached.service.identity import Grant, Peer, close_all, peer_of

log = logging.getLogger(__name__)

TOKEN_TTL_SECONDS = 30.0
REQUEST_TIMEOUT_SECONDS = 2.0
MAX_REQUEST_BYTES = 4096
MAX_FDS_PER_REQUEST = MAX_FDS  # what one session may hand over (hicache.buffers)
MAX_HELD_FDS = 4096
MAX_CONNECTIONS = 256


@dataclass
class _Conn:
    sock: socket.socket
    peer: Peer
    deadline: float
    data: bytes = b""
    fds: list[int] = field(default_factory=list)


class IdentityChannel:
    def __init__(self, path: str, mode: int = 0o600, gid: int = -1) -> None:
        self.path = path
        self._mode, self._gid = mode, gid
        self._grants: dict[str, Grant] = {}
        self._lock = lock("identity_channel")
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._closing = False

    def start(self) -> None:
        s = listen_beside(self.path, self._mode, self._gid, 64)
        s.setblocking(False)
        self._sock = s
        self._thread = threading.Thread(target=self._loop, name="identity", daemon=True)
        self._thread.start()

    # -- the loop --------------------------------------------------------------------------

    @property
    def grants(self) -> int:
        """Tokens handed out and not yet used or expired."""
        with self._lock:
            return len(self._grants)

    def _loop(self) -> None:
        assert self._sock is not None
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        conns: dict[socket.socket, _Conn] = {}
        try:
            while not self._closing:
                # asleep until a connection, a request, the close, or the next deadline
                timeout = (max(min(c.deadline for c in conns.values()) - time.monotonic(), 0)
                           if conns else None)
                for key, _ in sel.select(timeout=timeout):
                    if key.fileobj is self._sock:
                        self._accept(sel, conns)
                    elif key.fileobj in conns:
                        c = conns[key.fileobj]  # type: ignore[index]
                        if self._read(c):
                            sel.unregister(c.sock)
                            self._finish(conns.pop(c.sock))
                now = time.monotonic()
                for c in [c for c in conns.values() if c.deadline < now]:
                    sel.unregister(c.sock)
                    self._drop(conns.pop(c.sock), "no request line in time")
        finally:
            for c in conns.values():
                self._drop(c, "")
            sel.close()

    def _accept(self, sel: selectors.BaseSelector, conns: dict[socket.socket, _Conn]) -> None:
        assert self._sock is not None
        while True:
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.debug("identity accept failed: %s", exc)
                return
            if len(conns) >= MAX_CONNECTIONS:
                sock.close()  # a flood of idle connections: drop, never hold without bound
                continue
            try:
                peer = peer_of(sock)
            except OSError:
                sock.close()
                continue
            sock.setblocking(False)
            conns[sock] = _Conn(sock, peer, time.monotonic() + REQUEST_TIMEOUT_SECONDS)
            sel.register(sock, selectors.EVENT_READ)

    @staticmethod
    def _read(c: _Conn) -> bool:
        """Take what arrived; True once the request line is complete or the peer is done."""
        try:
            chunk, anc, flags, _ = c.sock.recvmsg(
                MAX_REQUEST_BYTES, socket.CMSG_SPACE(MAX_FDS_PER_REQUEST * 4))
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                n = len(payload) // 4
                c.fds.extend(struct.unpack(f"{n}i", payload[: n * 4]))
        if flags & socket.MSG_CTRUNC:
            c.data = b"!ctrunc"
            return True
        c.data += chunk
        return not chunk or b"\n" in c.data or len(c.data) > MAX_REQUEST_BYTES

    def _finish(self, c: _Conn) -> None:
        try:
            want = _parse(c.data)
            if want != len(c.fds):
                raise ValueError(f"the request names {want} fds, {len(c.fds)} arrived")
            token = self._grant(Grant(c.peer, tuple(c.fds)))
            c.fds = []  # the grant owns them now
            reply = {"token": token, "pid": c.peer.pid, "uid": c.peer.uid, "gid": c.peer.gid,
                     "ttl_s": TOKEN_TTL_SECONDS}
        except ValueError as exc:
            reply = {"error": str(exc)}
        self._drop(c, json.dumps(reply))

    @staticmethod
    def _drop(c: _Conn, reply: str) -> None:
        close_all(c.fds)
        try:
            if reply:
                c.sock.send(reply.encode() + b"\n")  # a few bytes: fits the socket buffer
        except OSError:
            pass
        c.sock.close()

    def _grant(self, grant: Grant) -> str:
        token = secrets.token_hex(16)
        now = time.monotonic()
        with self._lock:
            for t in [t for t, g in self._grants.items() if g.expires < now]:
                self._grants.pop(t).close()
            held = sum(len(g.fds) for g in self._grants.values())
            if held + len(grant.fds) > MAX_HELD_FDS:
                raise ValueError(f"{held} handed-over fds await their OpenSession; "
                                 f"at most {MAX_HELD_FDS} are held")
            self._grants[token] = replace(grant, expires=now + TOKEN_TTL_SECONDS)
        return token

    # -- the daemon's side -----------------------------------------------------------------

    def redeem(self, token: str) -> Grant | None:
        """What a token was issued for, once; None when unknown, used or expired. The caller
        owns the grant's fds from then on (``Grant.close``)."""
        with self._lock:
            grant = self._grants.pop(token, None)
        if grant is not None and grant.expires < time.monotonic():
            grant.close()
            return None
        return grant

    def close(self) -> None:
        """Stop serving, close what it holds; a second call does nothing (its wake-up fds
        are closed: writing to one again could hit a file opened since)."""
        if self._closing:
            return
        self._closing = True
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            grants, self._grants = list(self._grants.values()), {}
        for g in grants:
            g.close()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        close_all((self._wake_r, self._wake_w))
        remove_if_there(self.path)


def _parse(data: bytes) -> int:
    if data == b"!ctrunc":
        raise ValueError(f"more than {MAX_FDS_PER_REQUEST} fds in one request")
    if not data.endswith(b"\n") or len(data) > MAX_REQUEST_BYTES:
        raise ValueError('no request line (JSON {"fds": n} and a newline)')
    try:
        req = json.loads(data)
    except ValueError:
        raise ValueError('the request line is not JSON {"fds": n}') from None
    want = req.get("fds", 0) if isinstance(req, dict) else None
    if not isinstance(want, int) or isinstance(want, bool) or want < 0:
        raise ValueError('the request line is not {"fds": <count>}')
    return want
