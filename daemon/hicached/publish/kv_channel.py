"""One ZeroMQ stream of KV events: a PUB socket, its sequence, the batches kept for replay,
and the ROUTER socket that answers replay requests.

The daemon publishes on one such stream for the whole node (``[kv_events] endpoint``: every
pool's messages, each under its pool's topic) and, with ``pool_endpoint``, on one per pool
that carries that pool's messages only, numbered on its own: a router that follows one engine
instance's pool sees consecutive sequence numbers, and a gap only where it missed something.

Every message is three frames, as SGLang and vLLM publish them: the topic, the sequence (8
bytes, big-endian) and the msgpack batch. A replay request is SGLang's (an empty frame and the
first sequence wanted, 8 bytes, after the requester's identity); the answer is every batch
kept from there (a snapshot numbered with the last sequence sent when that is older than what
is kept), then the end marker (sequence -1, an empty payload). A pool's stream answers in
SGLang's frames (``[identity, "", seq, payload]``: what Dynamo's indexer and SGLang's
subscriber read); the node's stream puts the topic before the sequence
(``[identity, "", topic, seq, payload]``), since its batches are of many pools.

A pool's stream binds an XPUB socket that hears each subscription (``XPUB_VERBOSE``): a
router that connects late, or comes back after a restart, is a new subscription, and the
publisher answers it with a snapshot of the pool (``joined``), so it knows the whole pool
without asking for a replay it has no gap to ask for.

Primitives:

- ``Channel(ctx, config, socket_mode, first_seq, save_seq, replay_topic, announce)``:
  ``bind(endpoint, replay_endpoint)`` (the endpoints as bound: ``endpoint``,
  ``replay_endpoint``), ``send(topic, payload)``, ``last_seq``, ``serve_replays(snapshot)``,
  ``joined()``, ``sockets()`` (what the publisher's thread polls), ``watch(sock)``,
  ``counts``, ``close()``.
- ``END_SEQ``: the replay's end marker; ``REPLAYS_PER_TURN``, ``SNAPSHOT_REUSE_SECONDS``.
"""

from __future__ import annotations

import logging
import os
import stat
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from hicache.locks import lock
from hicache.log_limit import LimitedLog
from hicached.core.trusted_paths import UntrustedPath, socket_dir
from hicached.publish.kv_event_config import KvEventsConfig

log = logging.getLogger(__name__)
_limited = LimitedLog(log)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
BUFFER_MAX_BYTES = 64 << 20
"""The replay buffer's bound in bytes, beside ``buffer_steps`` messages (a replay from before
what it keeps gets a snapshot)."""
REPLAYS_PER_TURN = 8
SNAPSHOT_REUSE_SECONDS = 1.0
_MONITOR_EVENT = struct.Struct("=H")

Snapshot = Callable[[], list[tuple[bytes, bytes]]]
"""What a stream holds now, as (topic, payload) messages (built on demand, possibly large)."""


class Channel:
    def __init__(self, ctx: zmq.Context[Any], config: KvEventsConfig, socket_mode: int,
                 first_seq: int = 0, save_seq: Callable[[int], None] | None = None,
                 replay_topic: bool = False, announce: bool = False) -> None:
        """``first_seq``: the first message's sequence; ``save_seq(seq)``: called before a
        message is sent (the node's stream keeps its sequence across restarts);
        ``replay_topic``: replay frames carry the topic (the node's stream); ``announce``:
        an XPUB socket whose subscriptions are reported by ``joined`` (a pool's stream)."""
        self.config = config
        self._ctx, self._mode = ctx, socket_mode
        self._save_seq, self._replay_topic, self._announce = save_seq, replay_topic, announce
        self.endpoint = self.replay_endpoint = ""
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        self._monitors: dict[zmq.Socket[bytes], str] = {}
        self._next_seq = first_seq
        self._buffer: deque[tuple[int, bytes, bytes]] = deque()
        self._buffer_bytes = 0
        self._snapshot: tuple[float, int, list[tuple[bytes, bytes]]] | None = None
        self._joined = False
        self._lock = lock("kv_channel")
        self.counts = dict.fromkeys(("messages", "replays", "bad_replays", "pub", "replay"), 0)
        """Messages sent, replay requests answered and refused, connections now."""

    # -- sockets -----------------------------------------------------------------------------

    def bind(self, endpoint: str, replay_endpoint: str = "") -> None:
        kind = zmq.XPUB if self._announce else zmq.PUB
        self._pub = self._bind(kind, endpoint, "pub")
        if self._announce:
            self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's, not the first
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        if replay_endpoint:
            self._replay = self._bind(zmq.ROUTER, replay_endpoint, "replay")
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    def _bind(self, kind: int, endpoint: str, name: str) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if endpoint.startswith("tcp://["):  # an IPv6 address: ZeroMQ binds it only so (and
            sock.setsockopt(zmq.IPV6, 1)  # then names an IPv4 one as ::ffff:a.b.c.d)
        sock.setsockopt(zmq.SNDHWM, self.config.hwm)
        sock.setsockopt(zmq.RCVHWM, 64)
        # what a peer may send: a subscription (a topic prefix), a replay request (8 bytes)
        sock.setsockopt(zmq.MAXMSGSIZE, 64 if kind == zmq.ROUTER else 4096)
        try:
            if endpoint.startswith("ipc://"):
                _clear_ipc(endpoint[len("ipc://"):])
            sock.bind(endpoint)
            if endpoint.startswith("ipc://"):
                os.chmod(endpoint[len("ipc://"):], self._mode)
        except BaseException:
            sock.close(linger=0)  # else the context never terminates
            raise
        self._monitors[sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
                       ] = name
        return sock

    def sockets(self) -> list[zmq.Socket[bytes]]:
        """What the publisher's thread polls for this stream: the replay socket, the XPUB's
        subscriptions and the connection monitors."""
        out = list(self._monitors)
        if self._replay is not None:
            out.append(self._replay)
        if self._announce and self._pub is not None:
            out.append(self._pub)
        return out

    def close(self) -> None:
        for sock in (*self._monitors, self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        for endpoint in (self.endpoint, self.replay_endpoint):
            if endpoint.startswith("ipc://"):
                try:
                    os.unlink(endpoint[len("ipc://"):])
                except OSError:
                    pass
        self._monitors = {}
        self._pub = self._replay = None

    # -- the stream ------------------------------------------------------------------------

    @property
    def last_seq(self) -> int:
        return self._next_seq - 1

    def send(self, topic: bytes, payload: bytes) -> None:
        """One message, numbered next, kept for replay."""
        assert self._pub is not None
        seq = self._next_seq
        self._next_seq += 1
        if self._save_seq is not None:  # saved before it is sent: a restart never repeats it
            self._save_seq(seq)
        self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, topic, payload))
        self._buffer_bytes += len(payload)
        while (len(self._buffer) > self.config.buffer_steps
               or self._buffer_bytes > BUFFER_MAX_BYTES):
            self._buffer_bytes -= len(self._buffer.popleft()[2])
        with self._lock:
            self.counts["messages"] += 1

    def joined(self) -> bool:
        """Whether a subscription arrived since the last call (XPUB only): a subscriber that
        just joined, owed a snapshot."""
        if not (self._announce and self._pub is not None):
            return False
        while True:
            try:
                frame = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if frame[:1] == b"\x01":  # a subscription (\x00: one ended)
                self._joined = True
        joined, self._joined = self._joined, False
        return joined

    # -- replay ----------------------------------------------------------------------------

    def serve_replays(self, snapshot: Snapshot) -> None:
        """Answer up to ``REPLAYS_PER_TURN`` waiting replay requests."""
        if self._replay is None:
            return
        for _ in range(REPLAYS_PER_TURN):
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                with self._lock:
                    self.counts["bad_replays"] += 1
                _limited.warning("KV events: a replay request of %d frame(s) ignored",
                                 len(frames), key="bad replay")
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            with self._lock:
                self.counts["replays"] += 1
            oldest = self._buffer[0][0] if self._buffer else self._next_seq
            if start < oldest:
                answer = self._replay_snapshot(snapshot)
            else:
                answer = [(s.to_bytes(8, "big"), t, p) for s, t, p in self._buffer
                          if s >= start]
            try:
                for seq, topic, payload in answer:
                    head = (client, b"", topic) if self._replay_topic else (client, b"")
                    self._replay.send_multipart((*head, seq, payload), zmq.NOBLOCK)
                end = (client, b"", b"") if self._replay_topic else (client, b"")
                self._replay.send_multipart((*end, END_SEQ, b""), zmq.NOBLOCK)
            except zmq.Again:  # that client's queue is full: it asks again
                pass

    def _replay_snapshot(self, snapshot: Snapshot) -> list[tuple[bytes, bytes, bytes]]:
        """The snapshot a replay from before the buffer gets: every message numbered with
        the last sequence sent (the stream goes on from the next), built at most once per
        ``SNAPSHOT_REUSE_SECONDS``."""
        now, last = time.monotonic(), self.last_seq
        cached = self._snapshot
        if cached is None or now - cached[0] > SNAPSHOT_REUSE_SECONDS or cached[1] != last:
            cached = self._snapshot = (now, last, snapshot())
        seq = max(last, 0).to_bytes(8, "big")
        return [(seq, topic, payload) for topic, payload in cached[2]]

    def watch(self, mon: zmq.Socket[bytes]) -> None:
        """Connections accepted and gone on one of this stream's sockets (``mon`` is among
        ``sockets()``): the subscriber gauges."""
        name = self._monitors[mon]
        while True:
            try:  # ZeroMQ's monitor message: u16 event, u32 value; then the endpoint
                frames = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            (event,) = _MONITOR_EVENT.unpack_from(frames[0])
            step = 1 if event == zmq.EVENT_ACCEPTED else -1 if event == zmq.EVENT_DISCONNECTED \
                else 0
            with self._lock:
                self.counts[name] = max(self.counts[name] + step, 0)

    def owns_monitor(self, sock: object) -> bool:
        return sock in self._monitors

    def is_replay(self, sock: object) -> bool:
        return sock is not None and sock is self._replay

    def is_pub(self, sock: object) -> bool:
        return sock is not None and sock is self._pub


def _clear_ipc(path: str) -> None:
    """The socket's directory trusted; a socket file a killed daemon left (ours) is replaced,
    anything else there refuses the bind (``UntrustedPath``)."""
    socket_dir(os.path.dirname(path))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        raise UntrustedPath(path, "a file the daemon did not make is where its KV event "
                            "socket goes", "remove it, or choose another endpoint")
    os.unlink(path)
