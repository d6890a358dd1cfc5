"""The worker's side of the daemon's identity socket (``<api socket>.id``).

One request per token: connect, send ``{"fds": n}`` and a newline with ``n`` fds attached
(SCM_RIGHTS), read one JSON line back. The token names this process's uid / gid / pid as the
kernel reported them to the daemon, and the fds handed over; ``OpenSession`` (``peer_token``)
or a pool-level call's ``hicache-peer-token`` metadata redeems it, once.

Primitives:

- ``identity_path(target)``: the identity socket of a ``unix:`` target, None for TCP.
- ``request_token(target, fds, trusted)``: the token ("" when there is no identity socket to
  ask); ``FD_REJECTED`` when the daemon refused the fds; ``DAEMON_UNTRUSTED`` (nothing sent)
  when what listens there runs as a uid not in ``trusted``.
- ``trusted_uids(daemon_uid)``: the users a client believes to be its daemon: its own, root,
  and ``daemon_uid`` or ``$HICACHE_DAEMON_UID`` (a daemon running as a service user).
- ``check_daemon(sock, path, trusted)``: the connected peer's uid (``SO_PEERCRED``) is one of
  them, else ``DAEMON_UNTRUSTED``: a client never hands its writable KV memory, or trusts the
  replies of, a process another user planted on the daemon's socket.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Collection, Sequence

from hicache import paths
from hicache.errors import DaemonUntrusted, FdRejected

TIMEOUT_SECONDS = 5.0


def identity_path(target: str) -> str | None:
    if not target.startswith("unix:"):
        return None
    return paths.beside(paths.unix_path(target), paths.IDENTITY_SUFFIX)


DAEMON_UID_ENV = "HICACHE_DAEMON_UID"
_PEERCRED = struct.Struct("3i")


def trusted_uids(daemon_uid: int | None = None) -> frozenset[int]:
    uids = {os.geteuid(), 0}
    configured = os.environ.get(DAEMON_UID_ENV, "") if daemon_uid is None else str(daemon_uid)
    if configured.strip():
        uids.add(int(configured))
    return frozenset(uids)


def check_daemon(sock: socket.socket, path: str, trusted: Collection[int]) -> None:
    pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                   _PEERCRED.size))
    if uid not in trusted:
        raise DaemonUntrusted(
            f"{path} is served by pid {pid} running as uid {uid}, not a user this client "
            f"trusts ({sorted(trusted)}): nothing was sent; set {DAEMON_UID_ENV} (or "
            "HiCacheClient(daemon_uid=...)) if the daemon runs as that user",
            metadata={"path": path, "uid": uid, "pid": pid})


def request_token(target: str, fds: Sequence[int] = (),
                  trusted: Collection[int] | None = None) -> str:
    path = identity_path(target)
    if path is None:
        return ""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(TIMEOUT_SECONDS)
            s.connect(path)
            check_daemon(s, path, trusted_uids() if trusted is None else trusted)
            socket.send_fds(s, [json.dumps({"fds": len(fds)}).encode() + b"\n"], list(fds))
            reply = json.loads(s.makefile("rb").readline(4096))
    except (OSError, ValueError):
        return ""
    if "error" in reply:
        raise FdRejected(f"the identity socket refused: {reply['error']}",
                         metadata={"fds": len(fds)})
    return str(reply.get("token", ""))
