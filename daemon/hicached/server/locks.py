"""The locks that make one daemon own its sockets and its state directory.

Primitives:

- ``AlreadyServing``: another daemon holds the lock (its pid in the message).
- ``SocketLock(socket_path)``: ``<socket>.lock`` flock'ed for the daemon's life (opened
  without following a symlink, refused when not the daemon's own file: ``UntrustedPath``); a
  socket a killed daemon left is replaced; ``release()`` removes both.
- ``state_lock(state_dir)``: the state directory's ``.lock``.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable

from hicache.paths import remove_if_there
from hicached.core.trusted_paths import open_own

log = logging.getLogger(__name__)


class AlreadyServing(RuntimeError):
    """Another hicached holds the socket."""


class PidLock:
    """An flock on ``lock_path`` held for the daemon's life, the file holding its pid;
    ``AlreadyServing`` (``busy(holder pid)`` says why) when another daemon holds it."""

    def __init__(self, lock_path: str, busy: Callable[[str], str]) -> None:
        self.lock_path = lock_path
        self.fd = open_own(lock_path, os.O_RDWR | os.O_CREAT)  # never through a symlink
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise AlreadyServing(busy(holder)) from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        remove_if_there(self.lock_path)
        os.close(self.fd)


class SocketLock(PidLock):
    """The lock of one API socket (``<socket>.lock``); a socket a killed daemon left behind
    is replaced."""

    def __init__(self, socket_path: str) -> None:
        super().__init__(socket_path + ".lock", lambda holder: (
            f"another hicached (pid {holder}) is serving on {socket_path}; stop it first or "
            "choose another --listen path"))
        self.socket_path = socket_path
        if os.path.exists(socket_path):  # left by a daemon that was killed
            log.warning("removing stale socket %s", socket_path)
            os.unlink(socket_path)

    def release(self) -> None:
        remove_if_there(self.socket_path)
        super().release()


def state_lock(state_dir: str) -> PidLock:
    """One daemon per state directory: its ``.lock``."""
    return PidLock(os.path.join(state_dir, ".lock"), lambda holder: (
        f"another hicached (pid {holder}) uses the state directory {state_dir}; give each "
        "daemon its own --state-dir"))
