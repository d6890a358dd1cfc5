"""``[kv_events]``: where and how the daemon publishes its KV events, typed and validated.

The settings are SGLang's ``KVEventsConfig``'s where they mean the same (``endpoint``,
``replay_endpoint``, ``topic``, ``buffer_steps``, ``hwm``, ``max_queue_size``, ``format``), so
an operator who wired a router to an engine wires it to the daemon the same way.

Primitives: ``KvEventsConfig`` (frozen; ``from_mapping`` reads the TOML table; ``enabled``;
``pool_endpoints(pool)``), ``pool_endpoint(template, pool)``: a pool's stream's endpoint,
``check_endpoint(endpoint, field, allow_remote)``: an endpoint the publisher may bind, else
``SPEC_INVALID`` naming it; ``seq_file(state_dir)``: where the stream's last sequence is kept;
``KvEventStats``: what the publisher reports to metrics. Nothing here imports ZeroMQ: a daemon
without ``[kv_events]`` never loads it.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

from hicache.errors import SpecInvalid
from hicached.tiers.config import table_settings

FORMATS = ("default", "dynamo")
_LOOPBACK_NAMES = ("localhost",)


@dataclass(frozen=True)
class KvEventsConfig:
    endpoint: str = ""
    """The PUB socket the daemon binds: ``ipc:///path`` (a directory only the daemon's user
    may write in) or a loopback ``tcp://127.0.0.1:PORT`` / ``tcp://[::1]:PORT``; "" = off
    (the default). Any other address only with ``allow_remote``."""
    replay_endpoint: str = ""
    """The ROUTER socket answering replay requests (SGLang's protocol: the start sequence as
    8 big-endian bytes; the buffered batches, then an empty frame with sequence -1); "" =
    none. The same rules as ``endpoint``."""
    topic: str = ""
    """The first part of every message's topic frame; the pool's name follows it (one pool:
    subscribe to ``topic + pool``). Events of the whole daemon (``AllBlocksCleared`` at a
    start or a resync) carry ``topic`` alone."""
    buffer_steps: int = 10_000
    """Batches kept for replay; a replay from an older sequence gets a snapshot instead."""
    hwm: int = 100_000
    """ZeroMQ's high-water mark of each socket: past it a slow subscriber misses messages
    (it sees the gap in the sequence and asks the replay socket)."""
    max_queue_size: int = 100_000
    """Events waiting to be published; past it new ones are dropped (counted) and, once the
    queue drains, a snapshot replaces what was lost. The data path never waits."""
    format: str = "default"
    """``default`` (SGLang's) or ``dynamo``: the two differ only for pages of LoRA adapters
    or salted requests, whose namespace the daemon is not told; its events are the same."""
    gather_ms: int = 20
    """How long events gather once one arrived before they are published together: one
    message (and one turn of the publisher in the daemon's interpreter) per interval while
    Stores keep coming, not one per Store. Events reach subscribers this much later."""
    allow_remote: bool = False
    """Bind an endpoint that is not loopback (``tcp://*:5557``, an interface's address):
    every peer that reaches it learns which prefixes the node caches."""
    chain_bytes: int = 32 << 20
    """Per pool, the memory kept of the chains of recently stored keys (parent, tokens), so
    that a key's spill, put or promotion is published with them again."""
    pool_endpoint: str = ""
    """A stream per pool, for routers that follow engine instances: ``ipc:///dir/{pool}``,
    ``{pool}`` replaced by the pool's name (by ``pool-`` and a digest of it where the path
    would be longer than ZeroMQ allows), or ``tcp://HOST:*``, each pool's stream on a port
    the system picks (for routers on other hosts; a loopback HOST unless ``allow_remote``;
    the ports are this daemon run's: a router takes them from ``GetPool`` again after a
    restart). Each carries that pool's events only, numbered on its own, and a snapshot of
    the pool to every subscriber that joins: register each engine instance with the stream
    of the pool it loads from (``GetPool``'s ``kv_events_endpoint``). "" = none (the
    default)."""
    pool_replay_endpoint: str = ""
    """The replay socket of each pool's stream (``ipc:///dir/{pool}.replay`` or
    ``tcp://HOST:*``), answering in SGLang's frames; "" = none. Needs ``pool_endpoint``."""

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value:
                check_endpoint(value, f"kv_events.{name}", self.allow_remote)
        if self.replay_endpoint and not self.endpoint:
            raise SpecInvalid("kv_events.replay_endpoint needs kv_events.endpoint")
        for name in ("pool_endpoint", "pool_replay_endpoint"):
            value = getattr(self, name)
            if not value:
                continue
            if value.startswith("tcp://") and value.endswith(":*"):
                check_endpoint(value[:-1] + "1", f"kv_events.{name}", self.allow_remote)
                continue
            if "{pool}" not in value or not value.startswith("ipc://"):
                raise SpecInvalid(f"kv_events.{name} is an ipc:///path with {{pool}} in it, "
                                  "or tcp://HOST:* (one socket per pool, on a port the system "
                                  "picks)",
                                  metadata={"field": f"kv_events.{name}", "endpoint": value})
            check_endpoint(pool_endpoint(value, "p"), f"kv_events.{name}", self.allow_remote)
        if self.pool_replay_endpoint and not self.pool_endpoint:
            raise SpecInvalid("kv_events.pool_replay_endpoint needs kv_events.pool_endpoint")
        if (self.pool_replay_endpoint and self.pool_replay_endpoint == self.pool_endpoint
                and not self.pool_endpoint.endswith(":*")):  # (each tcp://HOST:* its port)
            raise SpecInvalid("kv_events.pool_replay_endpoint and pool_endpoint must differ",
                              metadata={"endpoint": self.pool_endpoint})
        if self.replay_endpoint and self.replay_endpoint == self.endpoint:
            raise SpecInvalid("kv_events.replay_endpoint and endpoint must differ",
                              metadata={"endpoint": self.endpoint})
        if self.format not in FORMATS:
            raise SpecInvalid(f"kv_events.format is one of {FORMATS}",
                              metadata={"format": self.format})
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not 1 <= getattr(self, name) <= 10_000_000:
                raise SpecInvalid(f"kv_events.{name} is within 1 .. 10000000",
                                  metadata={name: getattr(self, name)})
        if not 0 <= self.gather_ms <= 1000:
            raise SpecInvalid("kv_events.gather_ms is within 0 .. 1000",
                              metadata={"gather_ms": self.gather_ms})
        if not 0 <= self.chain_bytes <= 1 << 40:
            raise SpecInvalid("kv_events.chain_bytes must be >= 0",
                              metadata={"chain_bytes": self.chain_bytes})

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint or self.pool_endpoint)

    def pool_endpoints(self, pool: str) -> tuple[str, str]:
        """The endpoint and replay endpoint ``pool``'s own stream binds ("" where none; a
        ``tcp://HOST:*`` as it is: the port is known once bound)."""
        return (pool_endpoint(self.pool_endpoint, pool) if self.pool_endpoint else "",
                pool_endpoint(self.pool_replay_endpoint, pool)
                if self.pool_replay_endpoint else "")

    @classmethod
    def from_mapping(cls, d: Mapping[str, object], parse_size: Callable[[object], int]
                     ) -> KvEventsConfig:
        """The ``[kv_events]`` table (names and sizes read as ``tiers.config`` reads a
        table), each value then of its field's type; else ``SPEC_INVALID``."""
        d = table_settings(cls, d, parse_size, "kv_events", {})
        kinds = {f.name: f.type for f in fields(cls)}
        try:
            kwargs = {k: (v if kinds[k] == "str" and isinstance(v, str)
                          else _BOOL[str(v).lower()] if kinds[k] == "bool"
                          else int(str(v)) if kinds[k] == "int" and not isinstance(v, bool)
                          else _refuse(k, v))
                      for k, v in d.items()}
        except (KeyError, ValueError, TypeError):
            raise SpecInvalid("kv_events settings have the wrong type",
                              metadata={"settings": ",".join(sorted(d))}) from None
        return cls(**kwargs)  # type: ignore[arg-type]


IPC_PATH_BYTES = 100
"""The longest ipc:// path an endpoint may have (the socket address holds 107 bytes)."""


def pool_endpoint(template: str, pool: str) -> str:
    """``template`` with ``{pool}`` replaced by the pool's name, or by ``pool-`` and 16 hex
    digits of its SHA-256 where the path would be longer than ``IPC_PATH_BYTES`` (a
    ``tcp://HOST:*`` as it is)."""
    if template.startswith("tcp://"):
        return template
    out = template.replace("{pool}", pool)
    if len(out.encode()) - len("ipc://") <= IPC_PATH_BYTES:
        return out
    return template.replace("{pool}", "pool-" + hashlib.sha256(pool.encode()).hexdigest()[:16])


def check_endpoint(endpoint: str, field: str, allow_remote: bool) -> None:
    """``ipc://`` with an absolute path, or ``tcp://HOST:PORT`` on loopback (any host with
    ``allow_remote``); ``SPEC_INVALID`` naming ``field`` otherwise."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if not os.path.isabs(path) or len(path.encode()) > IPC_PATH_BYTES:
            raise SpecInvalid(f"{field}: an ipc:// endpoint is an absolute path of at most 100 "
                              "bytes", metadata={"field": field, "endpoint": endpoint})
        return
    if not endpoint.startswith("tcp://"):
        raise SpecInvalid(f"{field} is ipc:///path or tcp://HOST:PORT", metadata={
            "field": field, "endpoint": endpoint})
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if not port.isdigit() or not 0 < int(port) <= 65535 or not host:
        raise SpecInvalid(f"{field}: {endpoint!r} has no port (tcp://HOST:PORT)",
                          metadata={"field": field, "endpoint": endpoint})
    if allow_remote or _loopback(host.strip("[]")):
        return
    raise SpecInvalid(
        f"{field}: {endpoint} is not a loopback address; every peer that reaches it learns "
        "which prefixes this node caches: set kv_events.allow_remote to bind it",
        metadata={"field": field, "endpoint": endpoint})


_BOOL = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _refuse(key: str, value: object) -> object:
    raise TypeError(f"{key}: {value!r}")


def _loopback(host: str) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class KvEventStats:
    published: int
    """Engine events sent (BlockStored, BlockRemoved, AllBlocksCleared)."""
    dropped: int
    """Cache events dropped because the queue was full (a snapshot followed)."""
    messages: int
    resyncs: int
    replays: int
    """Replay requests answered."""
    bad_replays: int
    """Replay requests that were not SGLang's three frames with an 8-byte start."""
    queued: int
    subscribers: int
    """Connections on the PUB sockets now (the node's stream and every pool's)."""
    replay_subscribers: int
    """Connections on the replay sockets now."""
    last_seq: int
    """The node's stream's last sequence."""
    pool_streams: int = 0
    """Pools' own streams open now."""

def seq_file(state_dir: str) -> str:
    """Where the stream's last sequence is kept ("" without a state directory)."""
    return os.path.join(state_dir, "kv-events.seq") if state_dir else ""

