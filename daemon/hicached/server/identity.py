"""Who a Unix-socket caller is, what it handed over, and who may open which pool.

The identity channel (``identity_channel``) learns a worker's pid / uid / gid from the kernel
and receives its memfds; ``OpenSession`` redeems the resulting ``Grant``. Access rules from the
config decide which peers may use which pools.

Primitives:

- ``Peer``: pid, uid, gid, supplementary groups; ``read_groups(pid)``.
- ``Grant``: the peer and the fds of one identity request; ``close()`` closes the fds.
- ``AccessRule`` (config): pools matching a glob may be used only by the listed uids / gids.
- ``check_access(rules, pool, peer)``: ``PEER_NOT_ALLOWED`` when a rule covers the pool and the
  peer is unknown or not listed.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable
from dataclasses import dataclass

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


def read_groups(pid: int) -> tuple[int, ...]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return tuple(int(g) for g in line.split()[1:])
    except OSError:
        pass
    return ()
