"""Paths a daemon can trust on a node it shares with other users: its directories verified
before use, its files opened without following links and checked after.

A directory another user created first (and may still write into), a symlink planted where a
lock file goes, or saved state files another user wrote must never be used: the daemon would
follow the link (truncating its target), let others move its socket away, or re-attach and
serve pages it never wrote.

Primitives:

- ``UntrustedPath``: a path the daemon will not use; its message names the path, why and what
  to do (the daemon refuses to start with it).
- ``own_dir(path, group=False, gid=-1)``: a directory only the daemon uses (its default socket
  directory, its state directory, its disk tier's): created if missing (0700, or 0750 and
  group ``gid`` with ``group``: the socket group may reach a socket in it), then verified: a
  directory, not a symlink, owned by the daemon's uid, writable by no one else; read or
  search access for others (or the group, without ``group``) is taken away, logged.
- ``socket_dir(path, group=False, gid=-1)``: the directory of a configured socket: created as
  ``own_dir`` when missing; an existing one must be a directory, not a symlink, owned by the
  daemon's uid or root, and writable by no one else unless sticky (as ``/tmp``: others cannot
  move what is ours).
- ``open_own(path, flags, mode)``: ``os.open`` with ``O_NOFOLLOW | O_CLOEXEC`` (add
  ``O_CREAT | O_EXCL`` to create), then ``untrusted_file`` on what was opened.
- ``untrusted_file(st)``: why a file (its ``os.stat_result``) is not the daemon's own: not a
  regular file, another owner, writable by others; "" when it is.
"""

from __future__ import annotations

import logging
import os
import stat

log = logging.getLogger(__name__)


class UntrustedPath(PermissionError):
    """A path the daemon will not use (another user's, a symlink, open to others)."""

    def __init__(self, path: str, why: str, fix: str = "") -> None:
        self.path, self.why = path, why
        super().__init__(f"{path}: {why}" + (f"; {fix}" if fix else ""))


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _not_a_dir(path: str, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise UntrustedPath(path, "is a symlink, not a directory",
                            "remove it; the daemon creates its own")
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedPath(path, "is not a directory")


def _create(path: str, group: bool, gid: int) -> os.stat_result:
    parent = os.path.dirname(path.rstrip("/")) or "/"
    os.makedirs(parent, mode=0o755, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
        if group:  # the group may reach the socket: it owns the directory too
            os.chown(path, -1, gid)
            os.chmod(path, 0o750)
    except FileExistsError:
        pass  # made meanwhile: verified below like any existing one
    st = _lstat(path)
    assert st is not None
    return st


def own_dir(path: str, group: bool = False, gid: int = -1) -> None:
    st = _lstat(path) or _create(path, group, gid)
    _not_a_dir(path, st)
    uid = os.geteuid()
    if st.st_uid != uid:
        raise UntrustedPath(path, f"is owned by uid {st.st_uid}, not the daemon's {uid}",
                            "remove it (another user may have planted it) or choose "
                            "another path")
    allowed = 0o750 if group else 0o700
    mode = stat.S_IMODE(st.st_mode)
    extra = mode & ~allowed & 0o777
    if extra & 0o022:  # others could have put files in it: nothing there can be trusted
        raise UntrustedPath(path, f"has mode {mode:04o}: others may {_what(extra)} it",
                            f"chmod {allowed:04o} {path}, or remove it and let the daemon "
                            "create it")
    if extra:  # the daemon's own, only readable: closed to others now
        os.chmod(path, mode & ~extra)
        log.warning("%s had mode %04o: others may %s it; now %04o", path, mode, _what(extra),
                    mode & ~extra)


def socket_dir(path: str, group: bool = False, gid: int = -1) -> None:
    st = _lstat(path)
    if st is None:
        own_dir(path, group, gid)
        return
    _not_a_dir(path, st)
    if st.st_uid not in (os.geteuid(), 0):
        raise UntrustedPath(path, f"is owned by uid {st.st_uid}: that user could move the "
                            "daemon's socket away", "choose a directory of the daemon's user")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022 and not mode & stat.S_ISVTX:
        raise UntrustedPath(path, f"has mode {mode:04o}: others could move the daemon's "
                            "socket away", f"chmod o-w,g-w {path} (or +t)")


def _what(bits: int) -> str:
    said = [w for w, m in (("read", 0o044), ("write", 0o022), ("enter", 0o011)) if bits & m]
    return " and ".join(said)


def untrusted_file(st: os.stat_result) -> str:
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    uid = os.geteuid()
    if st.st_uid != uid:
        return f"owned by uid {st.st_uid}, not the daemon's {uid}"
    if st.st_mode & 0o022:
        return f"writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return ""


def open_own(path: str, flags: int, mode: int = 0o600) -> int:
    """Open a file of the daemon's without following a symlink; ``UntrustedPath`` when what
    is there is not its own (another owner, writable by others, not a regular file)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == 40:  # ELOOP: a symlink where the file should be
            raise UntrustedPath(path, "is a symlink", "remove it") from None
        raise
    why = untrusted_file(os.fstat(fd))
    if why:
        os.close(fd)
        raise UntrustedPath(path, f"is {why}", "remove it")
    return fd
