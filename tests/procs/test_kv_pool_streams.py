"""Each pool's own KV event stream (``[kv_events] pool_endpoint``) through real daemon and
worker processes, read with plain ZeroMQ sockets: that pool's messages only, numbered one after
another, replays in SGLang's frames, a snapshot for each subscriber that joins, and joins that
come in a storm sharing snapshots. (A real router on these streams:
tests/procs/test_router_dynamo.py.)
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
import zmq

from tests.daemon_proc import DaemonProc, Daemons
from tests.kv_event_workers import OTHER, SPEC, Worker, chain, pool_stream_args, pool_streams


@pytest.fixture
def daemon(daemons: Daemons, tmp_path: Path) -> DaemonProc:
    return daemons.start(*pool_stream_args(tmp_path))


def clears(sub: zmq.Socket[bytes], seconds: float) -> int:
    """``AllBlocksCleared`` events ``sub`` receives within ``seconds`` (snapshots' openings)."""
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if sub.poll(50):
            events = msgspec.msgpack.decode(sub.recv_multipart()[2])[1]
            n += sum(1 for e in events if e.get("type") == "AllBlocksCleared")
    return n


def settle(sub: zmq.Socket[bytes]) -> int:
    """``AllBlocksCleared`` events ``sub`` receives until none came for 1.2 s (more than a
    join's snapshot interval), within 10 s."""
    n, end = 0, time.monotonic() + 10
    while time.monotonic() < end:
        got = clears(sub, 1.2)
        n += got
        if not got:
            break
    return n


def test_a_pool_stream_numbers_its_own_messages_and_replays_in_sglangs_frames(
        daemon: DaemonProc) -> None:
    """A subscriber of one pool sees that pool's messages only, numbered one after another
    (another pool's traffic makes no gap), and a replay answers ``[identity, "", seq,
    payload]`` frames up to the end marker: what Dynamo's replay client and SGLang's read."""
    a, b = Worker(daemon, SPEC), Worker(daemon, OTHER)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        endpoint, replay = pool_streams(daemon)["kv-a"]
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        seqs: list[int] = []
        deadline = time.monotonic() + 5
        while not seqs and time.monotonic() < deadline:  # the snapshot a join gets
            if sub.poll(100):
                seqs.append(int.from_bytes(sub.recv_multipart()[1], "big"))
        assert seqs, "no snapshot for a subscriber that joined"
        for i in range(3):
            b.store(*chain(20 + i, 1))  # kv-b's traffic: nothing on kv-a's stream
            a.store(*chain(30 + i, 1))
        deadline = time.monotonic() + 5
        while len(seqs) < 6 and time.monotonic() < deadline:
            if sub.poll(100):
                topic, seq, _ = sub.recv_multipart()
                assert topic == b"kv-a"
                seqs.append(int.from_bytes(seq, "big"))
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and len(seqs) >= 4
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay)
        dealer.send_multipart([b"", seqs[1].to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(5000)
            frames = dealer.recv_multipart()
            assert len(frames) == 3 and frames[0] == b""
            if not frames[2]:
                assert frames[1] == (-1).to_bytes(8, "big", signed=True)
                break
            got.append(int.from_bytes(frames[1], "big"))
            batch = msgspec.msgpack.decode(frames[2])
            assert isinstance(batch, list) and len(batch) == 3  # [ts, events, dp rank]
        assert got[:len(seqs) - 1] == seqs[1:]
        dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        ctx.destroy(linger=0)  # every socket, the ones an assertion left open too
        a.close()
        b.close()


def test_subscribers_joining_in_a_storm_share_snapshots_and_each_gets_one(
        daemon: DaemonProc) -> None:
    """Forty connections to a pool's stream within a second (a process reconnecting in a
    loop) cost the daemon a few snapshots, not forty; the last to join still gets one."""
    a = Worker(daemon, SPEC)
    ctx = zmq.Context()
    watcher = ctx.socket(zmq.SUB)
    try:
        a.store(*chain(1, 6))
        endpoint = pool_streams(daemon)["kv-a"][0]
        watcher.setsockopt(zmq.SUBSCRIBE, b"")
        watcher.connect(endpoint)
        # its own join's snapshot; the stream may still be opening when GetPool names it,
        # and a subscriber that connects during the opening gets that too: two at most
        assert 1 <= settle(watcher) <= 2
        last = None
        for _ in range(40):
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(endpoint)
            time.sleep(0.025)
            if last is not None:
                last.close(linger=0)
            last = s
        assert last is not None
        seen = clears(watcher, 2.5)
        assert 1 <= seen <= 4, seen
        assert clears(last, 0.5) >= 1  # queued for it meanwhile: the snapshot it was owed
        last.close(linger=0)
    finally:
        watcher.close(linger=0)
        ctx.destroy(linger=0)  # every socket, the ones an assertion left open too
        a.close()


def test_hicachectl_pools_says_where_each_pools_stream_is(
        daemon: DaemonProc, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hicache_client.cli import main as hicachectl

    a = Worker(daemon, SPEC)
    try:
        capsys.readouterr()
        assert hicachectl(["--target", daemon.target, "pools"]) == 0
        out = capsys.readouterr().out
        assert (f"kv-a: KV events on ipc://{tmp_path}/ev/kv-a "
                f"(replay ipc://{tmp_path}/ev/kv-a.replay)") in out
    finally:
        a.close()


def test_pool_streams_on_tcp_ports_the_system_picks(daemons: Daemons) -> None:
    """``--kv-events-pool-endpoint tcp://127.0.0.1:*``: each pool's stream on a port of its
    own, which ``GetPool`` names once bound; a subscriber there gets the pool's snapshot."""
    d = daemons.start("--kv-events-pool-endpoint", "tcp://127.0.0.1:*",
                      "--kv-events-pool-replay-endpoint", "tcp://127.0.0.1:*")
    a, b = Worker(d, SPEC), Worker(d, OTHER)
    ctx = zmq.Context()
    try:
        a.store(*chain(1, 3))
        deadline = time.monotonic() + 5
        got = pool_streams(d)
        while not all(e for ends in got.values() for e in ends):
            assert time.monotonic() < deadline, got
            time.sleep(0.05)
            got = pool_streams(d)
        ports = {e.rsplit(":", 1)[1] for ends in got.values() for e in ends}
        assert len(ports) == 4 and all(e.startswith("tcp://127.0.0.1:")
                                       for ends in got.values() for e in ends)
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(got["kv-a"][0])
        assert settle(sub) >= 1  # the snapshot of a pool that holds three pages
    finally:
        ctx.destroy(linger=0)
        a.close()
        b.close()
