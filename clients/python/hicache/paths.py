"""Where a local daemon listens by default, so workers find it without configuration.

Primitives:

- ``default_socket_path()``: ``$XDG_RUNTIME_DIR/hicached/hicached.sock``, or
  ``/tmp/hicached-<uid>/hicached.sock`` when there is no runtime directory.
- ``default_target()``: the same as a gRPC target (``unix:...``).
- ``DEFAULT_STATE_DIR``: where a daemon keeps pools that outlive it
  (``/dev/shm/hicached-<uid>``: one per user, so no other user's directory is ever taken);
  ``STATE_SUFFIXES``: the files of one saved pool there (``<pool>.meta``, ``.data``, and a
  ``.meta.new`` a killed daemon may leave mid-creation); ``remove_state(state_dir, name)``
  deletes them (the daemon's DeletePool, ``hicachectl drop-state``).
- ``remove_if_there(path)``: unlink a file; already gone is fine.
- ``unix_path(target)``: the file of a ``unix:`` target (``unix:PATH`` or ``unix://PATH``).
- The sockets a daemon listens on beside each Unix API socket: ``beside(path, suffix)``,
  ``IDENTITY_SUFFIX`` (``<socket>.id``, where a worker proves who it is) and
  ``FAST_PATH_SUFFIX`` (``<socket>.fast``, the data calls' framing); ``UNIX_PATH_MAX``: the
  bytes a Unix socket's path may have (Linux's ``sun_path`` less its NUL), which
  ``too_long(path, suffixes)`` checks of an API socket and the sockets beside it.
"""

from __future__ import annotations

import contextlib
import os

DEFAULT_STATE_DIR = f"/dev/shm/hicached-{os.getuid()}"
STATE_SUFFIXES = (".meta", ".data", ".meta.new")

IDENTITY_SUFFIX = ".id"
FAST_PATH_SUFFIX = ".fast"
UNIX_PATH_MAX = 107


def unix_path(target: str) -> str:
    return target[len("unix:"):].removeprefix("//")


def beside(path: str, suffix: str) -> str:
    """The socket ``suffix`` names beside the API socket at ``path``."""
    return path + suffix


def too_long(path: str, suffixes: tuple[str, ...] = ()) -> str | None:
    """The first of ``path`` and the sockets ``suffixes`` name beside it whose path has more
    than ``UNIX_PATH_MAX`` bytes (no socket can be bound or reached there), else None."""
    for p in (path, *(beside(path, s) for s in suffixes)):
        if len(os.fsencode(p)) > UNIX_PATH_MAX:
            return p
    return None


def default_socket_path() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = os.path.join(runtime, "hicached") if runtime else f"/tmp/hicached-{os.getuid()}"
    return os.path.join(base, "hicached.sock")


def default_target() -> str:
    return f"unix:{default_socket_path()}"


def remove_if_there(path: str) -> None:
    """Unlink ``path``; already gone is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def remove_state(state_dir: str, name: str) -> None:
    """Delete a pool's saved state, whatever it holds."""
    for suffix in STATE_SUFFIXES:
        remove_if_there(os.path.join(state_dir, name + suffix))
