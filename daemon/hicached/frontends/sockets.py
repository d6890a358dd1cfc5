"""The Unix sockets a front end listens on beside an API socket.

Primitives:

- ``listen_beside(path, mode, gid, backlog)``: a listening Unix socket beside an API socket
  (``<socket>.id``, ``<socket>.fast``), whose lock guards it: one a killed daemon left is
  replaced; the API socket's mode and group.
"""

from __future__ import annotations

import os
import socket


def listen_beside(path: str, mode: int, gid: int, backlog: int) -> socket.socket:
    if os.path.exists(path):  # left by a killed daemon (the API socket's lock is ours)
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    if gid >= 0:
        os.chown(path, -1, gid)
    os.chmod(path, mode)
    s.listen(backlog)
    return s
