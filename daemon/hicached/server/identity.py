"""Who is calling on a Unix socket: the identity channel beside each API socket.

gRPC in Python carries no peer credentials for Unix sockets, so the daemon serves a tiny
channel at ``<api socket>.id``: a worker connects, the daemon reads the kernel's SO_PEERCRED
of that connection (pid, uid, gid; supplementary groups from ``/proc/<pid>/status``) and answers
one JSON line with a one-time token bound to that identity. ``OpenSession`` redeems it
(``peer_token``), so the session knows its worker's uid and the pool's access rules can be
enforced. The token is short-lived and single-use; only the process that connected learns it.

Primitives:

- ``Peer``: pid, uid, gid, groups.
- ``AccessRule`` (config): pools matching a glob may be opened only by the listed uids / gids.
- ``IdentityChannel(path, mode, gid)``: ``start()``, ``redeem(token) -> Peer | None``,
  ``close()``.
- ``check_access(rules, pool, peer)``: ``PEER_NOT_ALLOWED`` when a rule covers the pool and the
  peer is unknown or not listed.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass

from hicache.errors import PeerNotAllowed

log = logging.getLogger(__name__)

TOKEN_TTL_SECONDS = 30.0


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()


@dataclass(frozen=True)
class AccessRule:
    """Pools whose names match ``pools`` (a glob) may be opened only by these users / groups."""

    pools: str
    """Glob over pool names, e.g. ``sgl-*``."""
    uids: tuple[int, ...] = ()
    """Users allowed (by uid)."""
    gids: tuple[int, ...] = ()
    """Groups allowed (primary or supplementary gid of the worker process)."""


def check_access(rules: tuple[AccessRule, ...], pool: str, peer: Peer | None) -> None:
    covering = [r for r in rules if fnmatch.fnmatchcase(pool, r.pools)]
    if not covering:
        return
    if peer is None:
        raise PeerNotAllowed(f"pool {pool} is open only to listed users: identify through the "
                             "daemon's identity socket (<socket>.id) first",
                             metadata={"pool": pool})
    gids = {peer.gid, *peer.groups}
    if not any(peer.uid in r.uids or gids & set(r.gids) for r in covering):
        raise PeerNotAllowed(f"uid {peer.uid} (gids {sorted(gids)}) may not open pool {pool}",
                             metadata={"pool": pool, "uid": peer.uid})


def _groups(pid: int) -> tuple[int, ...]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return tuple(int(g) for g in line.split()[1:])
    except OSError:
        pass
    return ()


class IdentityChannel:
    def __init__(self, path: str, mode: int = 0o600, gid: int = -1) -> None:
        self.path = path
        self._mode, self._gid = mode, gid
        self._tokens: dict[str, tuple[Peer, float]] = {}
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if os.path.exists(self.path):  # left by a killed daemon (the API socket's lock is ours)
            os.unlink(self.path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(self.path)
        if self._gid >= 0:
            os.chown(self.path, -1, self._gid)
        os.chmod(self.path, self._mode)
        s.listen(64)
        self._sock = s
        self._thread = threading.Thread(target=self._serve, name="identity", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    conn.settimeout(2.0)
                    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                          struct.calcsize("3i"))
                    pid, uid, gid = struct.unpack("3i", raw)
                    peer = Peer(pid, uid, gid, _groups(pid))
                    token = secrets.token_hex(16)
                    now = time.monotonic()
                    with self._lock:
                        self._tokens = {t: v for t, v in self._tokens.items() if v[1] > now}
                        self._tokens[token] = (peer, now + TOKEN_TTL_SECONDS)
                    conn.sendall(json.dumps({"token": token, "pid": pid, "uid": uid,
                                             "gid": gid, "ttl_s": TOKEN_TTL_SECONDS}
                                            ).encode() + b"\n")
                except OSError as exc:
                    log.debug("identity request failed: %s", exc)

    def redeem(self, token: str) -> Peer | None:
        """The peer a token was issued to, once; None when unknown, used or expired."""
        with self._lock:
            entry = self._tokens.pop(token, None)
        if entry is None or entry[1] < time.monotonic():
            return None
        return entry[0]

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
            self._sock = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
