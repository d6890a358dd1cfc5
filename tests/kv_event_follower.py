"""A router's side of the daemon's KV event stream, written the way SGLang's consumers follow an
engine's: a SUB socket, the sequence checked for gaps, the replay socket asked for what was
missed; every payload decoded with SGLang 0.5.23's own ``KVEventBatch`` decoder, never ours.

``Follower(endpoint, replay_endpoint, subscribe, topic)`` keeps what the stream says each pool
holds, per medium (``blocks[(pool, medium)]``: block hashes), the events in the order applied
(and each as its undecoded map: ``stored_maps``), and counts the gaps it saw and the replays it
asked for.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from sglang.srt.disaggregation.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

END = (-1).to_bytes(8, "big", signed=True)


class Follower:
    def __init__(self, endpoint: str, replay_endpoint: str = "", subscribe: bytes = b"",
                 topic: bytes = b"") -> None:
        """``subscribe``: the SUB socket's filter (a pool's topic, or b"": everything);
        ``topic``: the daemon's ``[kv_events] topic`` (the part before each pool's name)."""
        # one context for all: a collected context would wait for its sockets forever
        self.ctx: zmq.Context[Any] = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, subscribe)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)
        self.replay: Any = None
        if replay_endpoint:
            self.replay = self.ctx.socket(zmq.DEALER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.connect(replay_endpoint)
        self.prefix, self.subscribe = topic, subscribe
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.last = -1
        self.blocks: defaultdict[tuple[str, str], set[int]] = defaultdict(set)
        self.events: list[tuple[str, int, Any]] = []
        self.maps: list[dict[str, Any]] = []
        """Each of ``events`` as the message's map, undecoded by SGLang's types (the fields
        SGLang's events have no place for: vLLM 0.34's ``lookahead_token_ids``)."""
        self.gaps = 0
        self.replays = 0
        self.seqs: list[int] = []

    def close(self) -> None:
        self.sub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)

    # -- the state the stream describes ------------------------------------------------------

    def _apply(self, topic: bytes, payload: bytes, seq: int) -> None:
        pool = topic[len(self.prefix):].decode()
        batch = self.decoder.decode(payload)
        for ev, raw in zip(batch.events, msgspec.msgpack.decode(payload)[1], strict=True):
            self.events.append((pool, seq, ev))
            self.maps.append(raw)
            if isinstance(ev, AllBlocksCleared):
                for key in [k for k in self.blocks if not pool or k[0] == pool]:
                    del self.blocks[key]
            elif isinstance(ev, BlockStored):
                self.blocks[(pool, str(ev.medium))].update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.blocks[(pool, str(ev.medium))].difference_update(ev.block_hashes)

    def held(self, pool: str, medium: str) -> set[int]:
        return set(self.blocks.get((pool, medium), ()))

    def stored(self, pool: str | None = None, medium: str | None = None) -> list[Any]:
        return [e for p, _, e in self.events if isinstance(e, BlockStored)
                and (pool is None or p == pool) and (medium is None or e.medium == medium)]

    def stored_maps(self) -> list[dict[str, Any]]:
        """Every ``BlockStored`` as its undecoded map, in order."""
        return [m for m in self.maps if m.get("type") == "BlockStored"]

    def removed(self, pool: str | None = None, medium: str | None = None) -> list[Any]:
        return [e for p, _, e in self.events if isinstance(e, BlockRemoved)
                and (pool is None or p == pool) and (medium is None or e.medium == medium)]

    # -- following -------------------------------------------------------------------------

    def poll(self, timeout: float = 0.2) -> int:
        """Apply what arrives within ``timeout``; a gap in the sequence is replayed (as a
        router does). Returns the messages applied."""
        n = 0
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sub.poll(max(int(left * 1000), 1)):
                return n
            topic, seq_b, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            self.seqs.append(seq)
            if seq <= self.last:
                continue  # replayed already
            if seq > self.last + 1:  # (a first message after 0: joined late)
                self.gaps += 1
                self.sync()
                if seq <= self.last:
                    continue
            self._apply(topic, payload, seq)
            self.last = seq
            n += 1

    def sync(self, timeout: float = 5.0) -> int:
        """Ask the replay socket for everything after the last message applied."""
        assert self.replay is not None
        self.replays += 1
        since = self.last
        self.replay.send_multipart([b"", (since + 1).to_bytes(8, "big")])
        n = 0
        deadline = time.monotonic() + timeout
        while True:
            assert self.replay.poll(max(int((deadline - time.monotonic()) * 1000), 1)), \
                "the replay socket did not answer"
            _, topic, seq_b, payload = self.replay.recv_multipart()
            if seq_b == END:
                return n
            seq = int.from_bytes(seq_b, "big")
            if topic != self.prefix and not topic.startswith(self.subscribe):
                continue  # another pool's (the daemon's own, topic alone, concern every pool)
            if seq > since:  # a snapshot's messages all carry the last sequence sent
                self._apply(topic, payload, seq)
                self.last = max(self.last, seq)
                n += 1

    def until(self, what: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline, "the stream never said it"
            self.poll(0.1)
