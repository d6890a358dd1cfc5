"""Session identity: the capability a worker holds vs the name everyone may see.

A session id is a 128-bit random capability: transfers, heartbeats and keyed calls name the
session by it, and the daemon hands it only to the worker that opened the session (the
``OpenSession`` reply). Everyone else — ``ListSessions``, ``hicachectl sessions``, logs — sees
the public id derived from it, which names the session (``CloseSession`` accepts it, for
operators) but cannot move a byte.

Where ``[[access]]`` rules cover a pool, its pool-level calls (Lookup, Alloc, Free,
RemoveKeys, ClearPool, CreatePool, DeletePool, WatchEvents, CloseSession by public id) carry a
credential in the call's metadata: ``SESSION_HEADER`` with the capability of an open session on
that pool, or ``PEER_TOKEN_HEADER`` with a one-time token from the identity socket.

Primitives:

- ``SESSION_HEADER`` / ``PEER_TOKEN_HEADER``: the metadata keys of those credentials.
- ``public_session_id(session_id)``: ``s-`` + 16 hex digits of SHA-256 of the capability.
- ``is_public_id(text)``: whether ``text`` has that form.
"""

from __future__ import annotations

import hashlib
import re

SESSION_HEADER = "hicache-session"
PEER_TOKEN_HEADER = "hicache-peer-token"

_PUBLIC = re.compile(r"^s-[0-9a-f]{16}$")


def public_session_id(session_id: str) -> str:
    return "s-" + hashlib.sha256(session_id.encode()).hexdigest()[:16]


def is_public_id(text: str) -> bool:
    return bool(_PUBLIC.match(text))
