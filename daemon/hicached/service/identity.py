"""Who a Unix-socket caller is, what it handed over, and who may open which pool.

The identity channel (``identity_channel``) learns a worker's pid / uid / gid from the kernel
and receives its memfds; ``OpenSession`` redeems the resulting ``Grant``. Access rules from the
config decide which peers may use which pools.

Primitives:

- ``Peer``: pid, uid, gid, supplementary groups; ``peer_of(sock)``: a connected Unix
  socket's peer as the kernel recorded it at connect time (``SO_PEERCRED`` and
  ``SO_PEERGROUPS``: no ``/proc`` race, and right in a pod where the worker's pid is 0 here).
- ``Grant``: the peer and the fds of one identity request; ``close()`` closes the fds.
- ``Redeemer``: where a token is turned back into its ``Grant`` (the identity socket, a front
  end: ``hicached.frontends.identity_channel``).
- ``AccessRule`` (config): pools matching a glob may be used only by the listed uids / gids.
- ``check_access(rules, pool, peer)``: ``PEER_NOT_ALLOWED`` when a rule covers the pool and the
  peer is unknown or not listed.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from hicache.errors import PeerNotAllowed


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()


@dataclass(frozen=True)
class Grant:
    """What one identity request established: who connected, and the fds it handed over."""

    peer: Peer
    fds: tuple[int, ...] = ()
    """Sealed memfds for the session's buffers (``MemfdHandle.fd_index`` indexes them)."""
    expires: float = 0.0

    def close(self) -> None:
        close_all(self.fds)


class Redeemer(Protocol):
    def redeem(self, token: str) -> Grant | None:
        """The grant ``token`` names, once (None: unknown, used or stale)."""


def close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


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


SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
"""Linux's supplementary groups of a Unix socket's peer, as they were when it connected."""
_PEERCRED = struct.Struct("3i")


def peer_of(sock: socket.socket) -> Peer:
    """The peer of a connected Unix socket (``OSError`` when the kernel will not say)."""
    pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                     _PEERCRED.size))
    for room in (64, 65536):  # NGROUPS_MAX is 65536
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * room)
        except OSError as exc:
            if exc.errno == errno.ERANGE:
                continue  # more groups than room: ask again with room for all
            if exc.errno in (errno.ENOPROTOOPT, errno.EINVAL):
                break  # a kernel before 4.13: no supplementary groups known
            raise
        return Peer(pid, uid, gid, struct.unpack(f"{len(raw) // 4}I", raw))
    return Peer(pid, uid, gid)
