"""The daemon's KV event stream: what every tier of the node gains and loses, in the format
SGLang's and vLLM's routers consume (``kv_event_format``), with SGLang's replay socket.

One stream per daemon, one sequence number over it. Every message is one pool's (its topic
frame is ``topic + pool``) or the daemon's (``topic`` alone: the ``AllBlocksCleared`` that
opens a start and a resync). The sequence goes on from where the previous daemon stopped (it
is saved in the state directory before each message is sent), so a restart is a gap to a
subscriber that was following, never a repeat, and what follows it says what is true now:
``AllBlocksCleared`` first, then every pool's contents as it attaches.

Nothing the daemon serves waits for the stream: pools' event logs hand their events to
``offer``, which queues them (``max_queue_size``) and wakes the publishing thread; an event
that finds the queue full is dropped, counted, and the thread publishes a snapshot (the
daemon's ``AllBlocksCleared``, then every pool's contents) once the queue has drained. A
subscriber that falls behind ZeroMQ's high-water mark sees a gap in the sequence and asks the
replay socket: from a sequence still buffered (``buffer_steps`` batches) it gets those batches
again, from an older one a snapshot (every message numbered with the last sequence sent),
then the end marker (an empty topic, sequence -1, an empty payload), as SGLang's publisher
answers. At most ``REPLAYS_PER_TURN`` requests are served between two turns of publishing
and a snapshot is built at most once per ``SNAPSHOT_REUSE_SECONDS``. Events are published
``gather_ms`` after the first of them arrived, together.

Primitives:

- ``KvEventPublisher(config, seq_path, socket_mode)``: ``start()`` (binds, publishes the start's
  ``AllBlocksCleared``), ``attached(name, stack)`` / ``deleting(name, stack)`` (a
  ``PoolListener``: the pool's events followed, its contents published; on deletion its
  contents published as removed), ``offer(pool, event)``, ``close()``, ``stats()``
  (``kv_event_config.KvEventStats``), ``endpoint`` / ``replay_endpoint`` (as bound).
- ``END_SEQ``: the replay's end marker.
"""

from __future__ import annotations

import functools
import logging
import os
import stat
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq

from hicache import seams
from hicached.cache.events import CacheEvent
from hicached.core.log_limit import LimitedLog
from hicached.core.trusted_paths import UntrustedPath, open_own, socket_dir
from hicached.publish.kv_event_config import KvEventsConfig, KvEventStats
from hicached.publish.kv_event_format import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Encoder,
    EngineEvent,
    contents_events,
    engine_events,
    messages,
)
from hicached.tiers.stack import TierStack

log = logging.getLogger(__name__)
_limited = LimitedLog(log)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
BUFFER_MAX_BYTES = 64 << 20
"""The replay buffer's bound in bytes, beside ``buffer_steps`` messages (a replay from before
what it keeps gets a snapshot)."""
DRAIN_ITEMS = 4096
"""Queued items one turn of the thread publishes before it looks at the replay socket."""
REPLAYS_PER_TURN = 8
SNAPSHOT_REUSE_SECONDS = 1.0
IDLE_POLL_MS = 200
_MONITOR_EVENT = struct.Struct("=H")


_Item = tuple[str, Any]
"""(pool, a ``CacheEvent``, or engine events: a start's ``AllBlocksCleared``, an attached
pool's contents, a deleted pool's removals)."""


class KvEventPublisher:
    def __init__(self, config: KvEventsConfig, seq_path: str = "",
                 socket_mode: int = 0o600) -> None:
        self.config = config
        self.seq_path, self.socket_mode = seq_path, socket_mode
        self.endpoint = self.replay_endpoint = ""
        self._prefix = config.topic.encode()
        self._pools: dict[str, TierStack] = {}
        self._queue: deque[_Item] = deque()
        self._buffer: deque[tuple[int, bytes, bytes]] = deque()
        self._buffer_bytes = 0
        self._encoder = Encoder()
        self._ctx = zmq.Context()
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        self._monitors: dict[Any, str] = {}
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._seq_fd = -1
        self._next_seq = 0
        self._lock = threading.Lock()
        self._resync = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._snapshot: tuple[float, int, list[tuple[bytes, bytes]]] | None = None
        self._counts = dict.fromkeys(("published", "dropped", "messages", "resyncs",
                                      "replays", "bad_replays", "pub", "replay"), 0)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self.seq_path:
            self._next_seq = self._open_seq() + 1
        self._pub = self._bind(zmq.PUB, self.config.endpoint, "pub")
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.config.replay_endpoint:
            self._replay = self._bind(zmq.ROUTER, self.config.replay_endpoint, "replay")
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._queue.appendleft(("", [AllBlocksCleared()]))  # before any pool's contents
        self._thread.start()
        log.info("KV events on %s (replay %s, topic %r, first sequence %d)", self.endpoint,
                 self.replay_endpoint or "off", self.config.topic, self._next_seq)

    def _bind(self, kind: int, endpoint: str, name: str) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.config.hwm)
        sock.setsockopt(zmq.RCVHWM, 64)
        # what a peer may send: a subscription (a topic prefix), a replay request (8 bytes)
        sock.setsockopt(zmq.MAXMSGSIZE, 4096 if kind == zmq.PUB else 64)
        if endpoint.startswith("ipc://"):
            self._clear_ipc(endpoint[len("ipc://"):])
        sock.bind(endpoint)
        if endpoint.startswith("ipc://"):
            os.chmod(endpoint[len("ipc://"):], self.socket_mode)
        self._monitors[sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
                       ] = name
        return sock

    @staticmethod
    def _clear_ipc(path: str) -> None:
        """The socket's directory trusted; a socket file a killed daemon left (ours) is
        replaced, anything else there refuses the start (``UntrustedPath``)."""
        socket_dir(os.path.dirname(path))
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
            raise UntrustedPath(path, "a file the daemon did not make is where its KV event "
                                "socket goes", "remove it, or choose another endpoint")
        os.unlink(path)

    def _open_seq(self) -> int:
        """The last sequence the previous daemon sent (its file trusted), or -1."""
        self._seq_fd = open_own(self.seq_path, os.O_RDWR | os.O_CREAT)
        raw = os.pread(self._seq_fd, 8, 0)
        return int.from_bytes(raw, "big", signed=True) if len(raw) == 8 else -1

    def close(self) -> None:
        self._stop.set()
        os.eventfd_write(self._wake_fd, 1)
        if self._thread.is_alive():
            self._thread.join(5)
        for sock in (*self._monitors, self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
        for fd in (self._wake_fd, self._seq_fd):
            if fd >= 0:
                os.close(fd)
        self._wake_fd = self._seq_fd = -1

    # -- what the pools say ----------------------------------------------------------------

    def attached(self, name: str, stack: TierStack) -> None:
        with self._lock:
            self._pools[name] = stack
        stack.cache.events.listener = functools.partial(self.offer, name)
        # its contents now, before it serves: what it holds when its events begin (a change
        # between these two lines would be told twice, never lost)
        self._put((name, self._contents(name)))

    def deleting(self, name: str, stack: TierStack) -> None:
        stack.cache.events.listener = None
        gone = [BlockRemoved(block_hashes=e.block_hashes, medium=e.medium)
                for e in self._contents(name)]
        with self._lock:
            self._pools.pop(name, None)
        self._put((name, gone))

    def offer(self, pool: str, event: CacheEvent) -> None:
        """A pool's event (its log's listener, called under the log's lock): queued, or
        dropped and counted when the queue is full. Never blocks."""
        if len(self._queue) >= self.config.max_queue_size:
            with self._lock:
                self._counts["dropped"] += 1
                self._resync = True
            return
        self._put((pool, event))

    def _put(self, item: _Item) -> None:
        empty = not self._queue
        self._queue.append(item)
        if empty and self._wake_fd >= 0:
            os.eventfd_write(self._wake_fd, 1)

    def stats(self) -> KvEventStats:
        with self._lock:
            c = dict(self._counts)
        return KvEventStats(c["published"], c["dropped"], c["messages"], c["resyncs"],
                            c["replays"], c["bad_replays"], len(self._queue), c["pub"],
                            c["replay"], self._next_seq - 1)

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_fd, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        for mon in self._monitors:
            poller.register(mon, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(0 if self._queue else IDLE_POLL_MS))
                if self._wake_fd in ready:
                    os.eventfd_read(self._wake_fd)
                    del ready[self._wake_fd]
                    if self.config.gather_ms and len(self._queue) < DRAIN_ITEMS:
                        # a batch gathers: one message (and one turn of this thread in the
                        # daemon's interpreter) per interval, not one per Store; the queue
                        # stays non-empty meanwhile, so no Store writes the eventfd again
                        ready.update(poller.poll(self.config.gather_ms))
                self._drain()
                if self._replay is not None and self._replay in ready:
                    self._serve_replays()
                for mon, name in self._monitors.items():
                    if mon in ready:
                        self._watch(mon, name)
                if self._resync and not self._queue:
                    self._publish_snapshot()
            except Exception:  # never let the stream die of one bad turn
                log.exception("KV event publisher: a turn failed")
                time.sleep(0.1)

    def _drain(self) -> None:
        seams.reached("kv_events.turn")
        group: list[CacheEvent] = []
        pool = ""
        for _ in range(min(len(self._queue), DRAIN_ITEMS)):
            name, item = self._queue.popleft()
            if isinstance(item, CacheEvent) and name == pool:
                group.append(item)
                continue
            self._flush(pool, group)
            group, pool = [], name
            if isinstance(item, CacheEvent):
                group.append(item)
            else:  # a start's AllBlocksCleared, a pool's contents or removals
                self._send(name, item)
        self._flush(pool, group)

    def _flush(self, pool: str, group: list[CacheEvent]) -> None:
        if group and pool in self._pools:
            self._send(pool, engine_events(group, self._pools[pool].pool.page_size))

    def _contents(self, name: str) -> list[BlockStored]:
        """What the pool's tiers hold now, as ``BlockStored`` events."""
        with self._lock:
            stack = self._pools.get(name)
        if stack is None:
            return []
        return contents_events(stack.contents(), stack.pool.page_size,
                               stack.cache.events.chains)

    def _topic(self, pool: str) -> bytes:
        return self._prefix + pool.encode()

    def _send(self, pool: str, events: Sequence[EngineEvent]) -> None:
        assert self._pub is not None
        topic = self._topic(pool)
        for chunk in messages(events):
            payload = self._encoder.batch(chunk)
            seq = self._next_seq
            self._next_seq += 1
            if self._seq_fd >= 0:  # saved before it is sent: a restart never repeats it
                os.pwrite(self._seq_fd, seq.to_bytes(8, "big", signed=True), 0)
            self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, topic, payload))
            self._buffer_bytes += len(payload)
            while (len(self._buffer) > self.config.buffer_steps
                   or self._buffer_bytes > BUFFER_MAX_BYTES):
                self._buffer_bytes -= len(self._buffer.popleft()[2])
            with self._lock:
                self._counts["published"] += len(chunk)
                self._counts["messages"] += 1

    def _snapshot_events(self) -> list[tuple[str, Sequence[EngineEvent]]]:
        with self._lock:
            names = list(self._pools)
        return [("", [AllBlocksCleared()]), *((n, self._contents(n)) for n in names)]

    def _publish_snapshot(self) -> None:
        with self._lock:
            self._resync = False
            self._counts["resyncs"] += 1
        _limited.warning("KV events were dropped (the queue of %d was full): publishing a "
                         "snapshot of every pool", self.config.max_queue_size, key="resync")
        for pool, events in self._snapshot_events():
            self._send(pool, events)

    # -- replay ----------------------------------------------------------------------------

    def _serve_replays(self) -> None:
        assert self._replay is not None
        for _ in range(REPLAYS_PER_TURN):
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                with self._lock:
                    self._counts["bad_replays"] += 1
                _limited.warning("KV events: a replay request of %d frame(s) ignored",
                                 len(frames), key="bad replay")
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            with self._lock:
                self._counts["replays"] += 1
            oldest = self._buffer[0][0] if self._buffer else self._next_seq
            if start < oldest:
                answer = self._replay_snapshot()
            else:
                answer = [(s.to_bytes(8, "big"), t, p) for s, t, p in self._buffer
                          if s >= start]
            try:
                for seq, topic, payload in answer:
                    self._replay.send_multipart((client, b"", topic, seq, payload),
                                                zmq.NOBLOCK)
                self._replay.send_multipart((client, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
            except zmq.Again:  # that client's queue is full: it asks again
                pass

    def _replay_snapshot(self) -> list[tuple[bytes, bytes, bytes]]:
        """The snapshot a replay from before the buffer gets: every message numbered with
        the last sequence sent (the stream goes on from the next), built at most once per
        ``SNAPSHOT_REUSE_SECONDS``."""
        now, last = time.monotonic(), self._next_seq - 1
        cached = self._snapshot
        if cached is None or now - cached[0] > SNAPSHOT_REUSE_SECONDS or cached[1] != last:
            frames = [(self._topic(pool), self._encoder.batch(chunk))
                      for pool, events in self._snapshot_events()
                      for chunk in messages(events)]
            cached = self._snapshot = (now, last, frames)
        seq = max(last, 0).to_bytes(8, "big")
        return [(seq, topic, payload) for topic, payload in cached[2]]

    def _watch(self, mon: zmq.Socket[bytes], name: str) -> None:
        """Connections accepted and gone on a socket: the subscriber gauges."""
        while True:
            try:  # ZeroMQ's monitor message: u16 event, u32 value; then the endpoint
                frames = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            (event,) = _MONITOR_EVENT.unpack_from(frames[0])
            step = 1 if event == zmq.EVENT_ACCEPTED else -1 if event == zmq.EVENT_DISCONNECTED \
                else 0
            with self._lock:
                self._counts[name] = max(self._counts[name] + step, 0)

