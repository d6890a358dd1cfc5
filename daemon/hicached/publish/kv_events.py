"""The daemon's KV event stream: what every tier of the node gains and loses, in the format
SGLang's and vLLM's routers consume (``kv_event_format``), with SGLang's replay socket.

Two kinds of streams (``kv_channel.Channel``), both optional:

- **The node's** (``endpoint``): every pool's messages, each under its topic frame
  (``topic + pool``), and the daemon's (``topic`` alone: the ``AllBlocksCleared`` that opens
  a start and a resync). One sequence over all of them; it goes on from where the previous
  daemon stopped (saved in the state directory before each message is sent), so a restart is
  a gap to a subscriber that was following, never a repeat, and what follows it says what is
  true now: ``AllBlocksCleared`` first, then every pool's contents as it attaches.
- **Each pool's** (``pool_endpoint``): that pool's messages only, for a router that follows
  engine instances (Dynamo's indexer registers an instance with one endpoint and counts all
  it hears for that instance): an instance is registered with the stream of the pool it
  loads from and is told exactly what that pool holds. Each opens with
  ``AllBlocksCleared`` and the pool's contents, numbers its messages on its own (from the
  node's sequence when it opened: never below what an earlier daemon sent on it), answers
  replays in SGLang's frames, and sends a snapshot (``AllBlocksCleared``, then the contents)
  whenever a subscriber joins: a router started late or restarted knows the whole pool.

Nothing the daemon serves waits for the streams: pools' event logs hand their events to
``offer``, which queues them (``max_queue_size``) and wakes the publishing thread; an event
that finds the queue full is dropped, counted, and the thread publishes a snapshot on every
stream once the queue has drained. A subscriber that falls behind ZeroMQ's high-water mark
sees a gap in the sequence and asks the replay socket: from a sequence still buffered
(``buffer_steps`` batches) it gets those batches again, from an older one a snapshot, then
the end marker. Events are published ``gather_ms`` after the first of them arrived,
together; a pool's stream and the node's carry the same payloads.

Primitives:

- ``KvEventPublisher(config, seq_path, socket_mode)``: ``start()`` (binds, publishes the start's
  ``AllBlocksCleared``), ``attached(name, stack)`` / ``deleting(name, stack)`` (a
  ``PoolListener``: the pool's events followed, its contents published, its stream opened; on
  deletion its contents published as removed and its stream closed), ``offer(pool, event)``,
  ``close()``, ``stats()`` (``kv_event_config.KvEventStats``), ``endpoint`` /
  ``replay_endpoint`` (the node's, as bound), ``pool_endpoints(name)`` (a pool's).
- ``END_SEQ``: the replay's end marker.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from hicache import seams
from hicache.locks import lock
from hicache.log_limit import LimitedLog
from hicached.cache.events import CacheEvent
from hicached.core.trusted_paths import open_own
from hicached.publish.kv_channel import END_SEQ, Channel
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

__all__ = ["END_SEQ", "KvEventPublisher"]

log = logging.getLogger(__name__)
_limited = LimitedLog(log)

JOIN_SNAPSHOT_SECONDS = 1.0
"""The least time between two snapshots a pool's stream sends for subscribers that joined:
joins within it share the next one (a process that connects again and again costs the
daemon one snapshot of the pool per interval, not one per connection)."""
DRAIN_ITEMS = 4096
"""Queued items one turn of the thread publishes before it looks at the replay sockets."""
IDLE_POLL_MS = 200


@dataclass(frozen=True)
class _Attach:
    """A pool attached: its contents when its events began (its stream opens with them)."""

    contents: list[BlockStored]


@dataclass(frozen=True)
class _Detach:
    """A pool going: its contents, as removed (its stream closes after them)."""

    gone: list[BlockRemoved]


_Item = tuple[str, Any]


class KvEventPublisher:
    def __init__(self, config: KvEventsConfig, seq_path: str = "",
                 socket_mode: int = 0o600) -> None:
        self.config = config
        self.seq_path, self.socket_mode = seq_path, socket_mode
        self.endpoint = self.replay_endpoint = ""
        self._prefix = config.topic.encode()
        self._pools: dict[str, TierStack] = {}
        self._queue: deque[_Item] = deque()
        self._encoder = Encoder()
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._node: Channel | None = None
        """The node's stream (``endpoint``), if configured."""
        self._streams: dict[str, Channel] = {}
        """Each pool's own stream (``pool_endpoint``), opened and closed on the thread."""
        self._owed: dict[str, float] = {}
        """Pools whose stream owes joined subscribers a snapshot -> when it may go."""
        self._snapped: dict[str, float] = {}
        """Pools -> when their stream last sent a snapshot for a join."""
        self._failed: set[str] = set()
        """Pools whose own stream could not bind (no endpoint is told for them)."""
        self._polled: dict[Any, Channel] = {}
        self._poller_stale = True
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._seq_fd = -1
        self._next_seq = 0
        self._lock = lock("kv_events")
        self._resync = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._counts = dict.fromkeys(("published", "dropped", "resyncs"), 0)
        self._gone = dict.fromkeys(("messages", "replays", "bad_replays"), 0)
        """What closed pool streams counted (the totals keep them)."""

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self.seq_path:
            self._next_seq = self._open_seq() + 1
        if self.config.endpoint:
            self._node = Channel(self._ctx, self.config, self.socket_mode, self._next_seq,
                                 self._save_seq, replay_topic=True)
            self._node.bind(self.config.endpoint, self.config.replay_endpoint)
            self.endpoint, self.replay_endpoint = (self._node.endpoint,
                                                   self._node.replay_endpoint)
            self._queue.appendleft(("", [AllBlocksCleared()]))  # before any pool's contents
        self._thread.start()
        log.info("KV events on %s (replay %s, topic %r, first sequence %d); pools' own "
                 "streams %s", self.endpoint or "no node stream", self.replay_endpoint or "off",
                 self.config.topic, self._next_seq, self.config.pool_endpoint or "off")

    def _open_seq(self) -> int:
        """The last sequence the previous daemon sent (its file trusted), or -1."""
        self._seq_fd = open_own(self.seq_path, os.O_RDWR | os.O_CREAT)
        raw = os.pread(self._seq_fd, 8, 0)
        return int.from_bytes(raw, "big", signed=True) if len(raw) == 8 else -1

    def _save_seq(self, seq: int) -> None:
        self._next_seq = seq + 1
        if self._seq_fd >= 0:
            os.pwrite(self._seq_fd, seq.to_bytes(8, "big", signed=True), 0)

    def close(self) -> None:
        self._stop.set()
        os.eventfd_write(self._wake_fd, 1)
        if self._thread.is_alive():
            self._thread.join(5)
        for ch in (self._node, *self._streams.values()):
            if ch is not None:
                ch.close()
        self._streams = {}
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
        self._put((name, _Attach(self._contents(name))))

    def deleting(self, name: str, stack: TierStack) -> None:
        stack.cache.events.listener = None
        gone = [BlockRemoved(block_hashes=e.block_hashes, medium=e.medium)
                for e in self._contents(name)]
        with self._lock:
            self._pools.pop(name, None)
        self._put((name, _Detach(gone)))

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

    def pool_endpoints(self, name: str) -> tuple[str, str]:
        """Where ``name``'s own stream is (endpoint, replay endpoint; "" where none): as
        bound, or, opening on the publisher's thread, where it will be (an ``ipc://`` path;
        a ``tcp://HOST:*`` stream has its port once bound: "" until then)."""
        with self._lock:
            if name not in self._pools or name in self._failed:
                return "", ""
            stream = self._streams.get(name)
            if stream is not None:
                return stream.endpoint, stream.replay_endpoint
        endpoint, replay = self.config.pool_endpoints(name)
        return (endpoint if endpoint.startswith("ipc://") else "",
                replay if replay.startswith("ipc://") else "")

    def stats(self) -> KvEventStats:
        with self._lock:
            c = dict(self._counts)
            channels = [ch for ch in (self._node, *self._streams.values()) if ch is not None]
            totals = {k: self._gone.get(k, 0) + sum(ch.counts[k] for ch in channels)
                      for k in ("messages", "replays", "bad_replays", "pub", "replay")}
            streams = len(self._streams)
        return KvEventStats(c["published"], c["dropped"], totals["messages"], c["resyncs"],
                            totals["replays"], totals["bad_replays"], len(self._queue),
                            totals["pub"], totals["replay"], self._next_seq - 1, streams)

    # -- the thread ------------------------------------------------------------------------

    def _poller(self) -> zmq.Poller:
        poller = zmq.Poller()
        poller.register(self._wake_fd, zmq.POLLIN)
        self._polled = {sock: ch for ch in (self._node, *self._streams.values())
                        if ch is not None for sock in ch.sockets()}
        for sock in self._polled:
            poller.register(sock, zmq.POLLIN)
        self._poller_stale = False
        return poller

    def _run(self) -> None:
        poller = self._poller()
        while not self._stop.is_set():
            try:
                if self._poller_stale:
                    poller = self._poller()
                wait = 0 if self._queue else IDLE_POLL_MS
                if self._owed and wait:  # a snapshot owed: wake when it is due
                    due = min(self._owed.values()) - time.monotonic()
                    wait = min(wait, max(int(due * 1000) + 1, 0))
                ready = dict(poller.poll(wait))
                if self._wake_fd in ready:
                    os.eventfd_read(self._wake_fd)
                    del ready[self._wake_fd]
                    if self.config.gather_ms and len(self._queue) < DRAIN_ITEMS:
                        # a batch gathers: one message (and one turn of this thread in the
                        # daemon's interpreter) per interval, not one per Store; the queue
                        # stays non-empty meanwhile, so no Store writes the eventfd again
                        ready.update(poller.poll(self.config.gather_ms))
                        ready.pop(self._wake_fd, None)
                self._drain()
                self._serve(ready)
                self._send_owed()
                if self._resync and not self._queue:
                    self._publish_snapshot()
            except Exception:  # never let the stream die of one bad turn
                log.exception("KV event publisher: a turn failed")
                time.sleep(0.1)

    def _serve(self, ready: dict[Any, int]) -> None:
        """Replay requests, subscriptions and connection counts on the sockets that have
        something; a pool's stream that a subscriber joined publishes its snapshot."""
        for sock in ready:
            ch = self._polled.get(sock)
            if ch is None or (ch is not self._node and ch not in self._streams.values()):
                continue  # a stream closed this turn
            if ch.is_replay(sock):
                ch.serve_replays(functools.partial(self._snapshot_frames, ch))
            elif ch.is_pub(sock):
                if ch.joined():
                    pool = self._pool_of(ch)
                    self._owed.setdefault(pool, self._snapped.get(pool, 0.0)
                                          + JOIN_SNAPSHOT_SECONDS)
            elif ch.owns_monitor(sock):
                ch.watch(sock)

    def _send_owed(self) -> None:
        """The snapshots owed to subscribers that joined, those whose time has come: the
        joins of one interval share one. Events still queued follow it, each saying what
        became true after it was taken or before."""
        now = time.monotonic()
        for pool, due in list(self._owed.items()):
            stream = self._streams.get(pool)
            if stream is None:
                del self._owed[pool]
            elif now >= due:
                del self._owed[pool]
                self._snapped[pool] = now
                self._publish(pool, self._pool_snapshot(pool), [stream])

    def _pool_of(self, ch: Channel) -> str:
        return next((n for n, c in self._streams.items() if c is ch), "")

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
            elif isinstance(item, _Attach):
                self._open_stream(name)
                self._send(name, item.contents, restate=True)
            elif isinstance(item, _Detach):
                self._send(name, item.gone)
                self._close_stream(name)
            else:  # a start's AllBlocksCleared
                self._send(name, item)
        self._flush(pool, group)

    def _flush(self, pool: str, group: list[CacheEvent]) -> None:
        if group and pool in self._pools:
            spec = self._pools[pool].pool.spec
            self._send(pool, engine_events(group, spec.page_size, spec.key_format))

    def _contents(self, name: str) -> list[BlockStored]:
        """What the pool's tiers hold now, as ``BlockStored`` events."""
        with self._lock:
            stack = self._pools.get(name)
        if stack is None:
            return []
        return contents_events(stack.contents(), stack.pool.page_size,
                               stack.cache.events.chains, stack.pool.spec.key_format)

    def _topic(self, pool: str) -> bytes:
        return self._prefix + pool.encode()

    def _send(self, pool: str, events: Sequence[EngineEvent], restate: bool = False) -> None:
        """``events`` on the node's stream and, for a pool's, on its own stream too (the
        same payloads); ``restate``: ``events`` are the pool's whole contents, so its own
        stream (opening, or after drops) gets ``AllBlocksCleared`` before them."""
        stream = self._streams.get(pool) if pool else None
        if stream is not None and restate:
            self._publish(pool, [AllBlocksCleared()], [stream])
        self._publish(pool, events, [c for c in (self._node, stream) if c is not None])

    def _publish(self, pool: str, events: Sequence[EngineEvent], channels: list[Channel]
                 ) -> None:
        """``events`` on ``channels`` (each message encoded once for all), counted as
        published even where no channel is open."""
        topic = self._topic(pool)
        for chunk in messages(events):
            payload = self._encoder.batch(chunk)
            for channel in channels:
                channel.send(topic, payload)
            with self._lock:
                self._counts["published"] += len(chunk)

    # -- pools' own streams ----------------------------------------------------------------

    def _open_stream(self, name: str) -> None:
        endpoint, replay = self.config.pool_endpoints(name)
        if not endpoint or name in self._streams:
            return
        # numbered from the node's sequence now: above all an earlier daemon sent on it
        stream = Channel(self._ctx, self.config, self.socket_mode,
                         max(self._next_seq, 0), announce=True)
        try:
            stream.bind(endpoint, replay)
        except Exception as exc:  # the pool serves on; its router is told why not
            stream.close()
            with self._lock:
                self._failed.add(name)
            _limited.warning("KV events: pool %s's own stream cannot bind %s: %s", name,
                             endpoint, exc, key=f"bind {name}")
            return
        with self._lock:
            self._streams[name] = stream
        self._poller_stale = True
        log.info("KV events of pool %s on %s (replay %s)", name, stream.endpoint,
                 stream.replay_endpoint or "off")

    def _close_stream(self, name: str) -> None:
        with self._lock:
            self._failed.discard(name)
            stream = self._streams.pop(name, None)
            if stream is not None:
                for k in self._gone:
                    self._gone[k] += stream.counts[k]
        self._owed.pop(name, None)
        self._snapped.pop(name, None)
        if stream is not None:
            stream.close()
            self._poller_stale = True

    # -- snapshots -------------------------------------------------------------------------

    def _pool_snapshot(self, pool: str) -> list[EngineEvent]:
        return [AllBlocksCleared(), *self._contents(pool)]

    def _snapshot_frames(self, ch: Channel) -> list[tuple[bytes, bytes]]:
        """What a stream holds now, as (topic, payload) messages: for the node's stream,
        ``AllBlocksCleared`` and every pool's contents; for a pool's, that pool's."""
        if ch is self._node:
            with self._lock:
                names = list(self._pools)
            groups: list[tuple[str, Sequence[EngineEvent]]] = [
                ("", [AllBlocksCleared()]), *((n, self._contents(n)) for n in names)]
        else:
            pool = self._pool_of(ch)
            groups = [(pool, self._pool_snapshot(pool))]
        return [(self._topic(pool), self._encoder.batch(chunk))
                for pool, events in groups for chunk in messages(events)]

    def _publish_snapshot(self) -> None:
        with self._lock:
            self._resync = False
            self._counts["resyncs"] += 1
            names = list(self._pools)
        _limited.warning("KV events were dropped (the queue of %d was full): publishing a "
                         "snapshot of every pool", self.config.max_queue_size, key="resync")
        if self._node is not None:
            self._send("", [AllBlocksCleared()])
        for name in names:
            self._send(name, self._contents(name), restate=True)
