"""The worker's side of the daemon's identity socket (``<api socket>.id``).

One request per token: connect, send ``{"fds": n}`` and a newline with ``n`` fds attached
(SCM_RIGHTS), read one JSON line back. The token names this process's uid / gid / pid as the
kernel reported them to the daemon, and the fds handed over; ``OpenSession`` (``peer_token``)
or a pool-level call's ``hicache-peer-token`` metadata redeems it, once.

Primitives:

- ``identity_path(target)``: the identity socket of a ``unix:`` target, None for TCP.
- ``request_token(target, fds)``: the token ("" when there is no identity socket to ask);
  ``FD_REJECTED`` when the daemon refused the fds.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence

from hicache.errors import FdRejected

TIMEOUT_SECONDS = 5.0


def identity_path(target: str) -> str | None:
    if not target.startswith("unix:"):
        return None
    return target[len("unix:"):].removeprefix("//") + ".id"


def request_token(target: str, fds: Sequence[int] = ()) -> str:
    path = identity_path(target)
    if path is None:
        return ""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(TIMEOUT_SECONDS)
            s.connect(path)
            socket.send_fds(s, [json.dumps({"fds": len(fds)}).encode() + b"\n"], list(fds))
            reply = json.loads(s.makefile("rb").readline(4096))
    except (OSError, ValueError):
        return ""
    if "error" in reply:
        raise FdRejected(f"the identity socket refused: {reply['error']}",
                         metadata={"fds": len(fds)})
    return str(reply.get("token", ""))
