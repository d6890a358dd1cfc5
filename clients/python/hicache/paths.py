"""Where a local daemon listens by default, so workers find it without configuration.

Primitives:

- ``default_socket_path()``: ``$XDG_RUNTIME_DIR/hicached/hicached.sock``, or
  ``/tmp/hicached-<uid>/hicached.sock`` when there is no runtime directory.
- ``default_target()``: the same as a gRPC target (``unix:...``).
- ``DEFAULT_STATE_DIR``: where a daemon keeps pools that outlive it
  (``/dev/shm/hicached-<uid>``: one per user, so no other user's directory is ever taken);
  ``STATE_SUFFIXES``: the files of one saved pool there (``<pool>.meta``, ``.data``, and a
  ``.meta.new`` a killed daemon may leave mid-creation).
"""

from __future__ import annotations

import os

DEFAULT_STATE_DIR = f"/dev/shm/hicached-{os.getuid()}"
STATE_SUFFIXES = (".meta", ".data", ".meta.new")


def default_socket_path() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = os.path.join(runtime, "hicached") if runtime else f"/tmp/hicached-{os.getuid()}"
    return os.path.join(base, "hicached.sock")


def default_target() -> str:
    return f"unix:{default_socket_path()}"
