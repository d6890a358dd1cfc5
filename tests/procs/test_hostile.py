"""No neighbour can hurt the node: hostile input against the real daemon's front ends.

What a buggy or hostile local process can send, tried on both front ends where it applies:
key batches too large or all bad (the refusal stays small: under 64 KiB whatever the input),
a long Lookup (other calls go in between its chunks), fuzzed fast-path bodies and byte
streams (a domain error or a closed connection, never an INTERNAL and never a dead daemon),
slow and partial bodies (closed after ``fast_path_body_timeout_s``), frames that do not fit
``fast_path_inflight_bytes`` (``OVERLOADED``), and, with a daemon process, 1,024 connections
each announcing a 60 MiB body (its RSS stays under the budget plus 64 MiB).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache import fast_wire as w
from hicache import seams
from hicache.error_mapping import from_rpc_error, from_status_bytes
from hicache.specs import PoolSpec
from hicache.v1 import hicache_pb2 as pb
from hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache_client import HiCacheClient
from hicached.cache.holds import Holder, HoldPolicy
from hicached.cache.pool_cache import LOOKUP_CHUNK, PoolCache
from hicached.server.app import HiCacheServer, create_server
from hicached.server.config import ServerConfig
from hicached.service.identity import Peer
from tests.daemon_proc import start_daemon
from tests.helpers import make_pool, mha, spec

SPEC = PoolSpec("hp", mha(), 4, size_tokens=4 * 64)
SMALL_REPLY = 64 << 10


def _serve(tmp_path: Path, **cfg: object) -> tuple[HiCacheServer, str]:
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    config = ServerConfig(listen=(f"unix:{tmp_path}/s.sock",), shm_dir=str(shm), state_dir="",
                          metrics_listen="", memory_budget_bytes=256 << 20, reserve_bytes=0,
                          pools=(SPEC,), grace_seconds=1, **cfg)  # type: ignore[arg-type]
    server, bound = create_server(config)
    return server, bound[0]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[HiCacheServer, str]]:
    server, target = _serve(tmp_path, fast_path_body_timeout_s=1.0,
                            fast_path_inflight_bytes=4 << 20)
    yield server, target
    server.drain_and_stop(1.0)


def _connect(target: str) -> socket.socket:
    sk = socket.socket(socket.AF_UNIX)
    sk.settimeout(10)
    sk.connect(target[len("unix:"):] + ".fast")
    sk.sendall(w.HELLO.pack(w.MAGIC, w.VERSION, 0, 0))
    assert w.HELLO.unpack(w.recv_exact(sk, w.HELLO.size))[0] == w.MAGIC
    return sk


def _keys_frame(method: int, keys: list[bytes], rid: int = 1) -> bytes:
    out: list[bytes] = []
    w.put_string(out, SPEC.name)
    w.put_string(out, "")
    w.put_keys(out, keys)
    body = b"".join(out)
    return w.REQUEST.pack(len(body), rid, method, 0, 0) + body


def _reply(sk: socket.socket) -> tuple[int, int, bytes]:
    (_, rid, status), body = w.FrameSocket(sk).read(w.REPLY)
    return rid, status, body


def _dropped(server: HiCacheServer, reason: str) -> float:
    return server.registry.get_sample_value(
        "hicache_fast_path_dropped_connections_total", {"reason": reason}) or 0.0


# -- key batches -------------------------------------------------------------------------------

@pytest.mark.parametrize("count, reason", [(65_536, "KEY_INVALID"), (65_537, "TOO_MANY_KEYS"),
                                           (1_000_000, "TOO_MANY_KEYS")])
def test_a_batch_of_bad_keys_gets_a_small_refusal_on_both_paths(
        served: tuple[HiCacheServer, str], count: int, reason: str) -> None:
    """1M empty keys once built a 67 MB trailer gRPC itself refused to deliver."""
    _, target = served
    with grpc.insecure_channel(target) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.HostCacheStub(channel).Lookup(pb.LookupRequest(pool=SPEC.name,
                                                                   keys=[b""] * count))
    trailer = sum(len(k) + len(v) for k, v in err.value.trailing_metadata() or ())
    assert trailer < SMALL_REPLY
    got = from_rpc_error(err.value)
    assert got.reason == reason and got.from_daemon
    with _connect(target) as sk:
        sk.sendall(_keys_frame(w.Method.LOOKUP, [b""] * count))
        _, status, body = _reply(sk)
    assert status == w.ERROR and len(body) < SMALL_REPLY
    fast = from_status_bytes(body)
    assert fast.reason == reason and fast.metadata == got.metadata
    if reason == "TOO_MANY_KEYS":
        assert got.metadata == {"field": "keys", "count": str(count), "max": "65536"}
    else:
        assert got.metadata["count"] == str(count) and got.metadata["position"] == "0"


def test_too_many_keys_on_every_keyed_call(served: tuple[HiCacheServer, str]) -> None:
    _, target = served
    keys = [b"k%d" % i for i in range(65_537)]
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.HostCacheStub(channel)
        for call, request in ((stub.RemoveKeys, pb.RemoveKeysRequest(pool=SPEC.name, keys=keys)),
                              (stub.Store, pb.StoreRequest(session_id="x", keys=keys)),
                              (stub.LoadKeys, pb.LoadKeysRequest(session_id="x", keys=keys))):
            with pytest.raises(grpc.RpcError) as err:
                call(request)
            assert from_rpc_error(err.value).reason == "TOO_MANY_KEYS"
    with _connect(target) as sk:  # the fast path refuses before it builds the keys
        out: list[bytes] = []
        w.put_string(out, "x")
        w.put_layers(out, 0, 0)
        w.put_keys(out, keys)
        w.put_pages(out, np.zeros(0, "<i8"))
        body = b"".join(out)
        sk.sendall(w.REQUEST.pack(len(body), 3, w.Method.STORE, 0, 0) + body)
        rid, status, data = _reply(sk)
    assert (rid, status) == (3, w.ERROR) and from_status_bytes(data).reason == "TOO_MANY_KEYS"


def test_a_long_lookup_lets_other_calls_in_between_its_chunks() -> None:
    """Deterministic: the long Lookup is stopped between two chunks while another caller
    stores, removes and looks up on the same pool; the Lookup's holds then stop at the key
    removed meanwhile (a hold never names a key the pool no longer has)."""
    pool = make_pool(spec(mha(), page_size=4, size_tokens=4 * 16))
    cache = PoolCache(pool, policy=HoldPolicy(max_held_fraction=1.0))
    try:
        stored = [b"s%d" % i for i in range(8)]
        cache.finish_store(cache.begin_store(stored), True)
        batch = stored + [b"absent%d" % i for i in range(2 * LOOKUP_CHUNK)]
        out: list[tuple[int, bytes, int]] = []
        with seams.Pause("lookup.chunk") as stop:
            t = threading.Thread(target=lambda: out.append(
                cache.lookup_held(batch, Holder(7, 30.0))))
            t.start()
            assert stop.wait_reached()
            # the lock is free: another caller's calls run while the long Lookup waits
            assert cache.lookup([b"s0"]) == (1, b"\x01")
            assert cache.remove_keys([b"s5"]) == [b"s5"]
            cache.finish_store(cache.begin_store([b"new"]), True)
            assert cache.lookup([b"new"])[0] == 1
        t.join(10)
        hit_prefix, tiers, held = out[0]
        assert hit_prefix == 8
        assert tiers[:8] == b"\x01" * 8  # what its first chunk saw
        assert held == 5  # s5 left before the holds were taken
        assert cache.holds.table.count(7) == 5
    finally:
        pool.close()


# -- fuzzed fast-path bodies and streams ---------------------------------------------------------

@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from([*map(int, w.Method), 0, 99]), flags=st.integers(0, 255),
       body=st.one_of(st.binary(max_size=300),
                      st.builds(lambda pool, keys, tail: pool + keys + tail,
                                st.sampled_from([b"\x02\x00hp\x00\x00", b"\x01\x00x",
                                                 b"\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"]),
                                st.binary(max_size=64), st.binary(max_size=64))))
def test_fuzzed_bodies_get_a_domain_error_or_an_answer(served: tuple[HiCacheServer, str],
                                                       method: int, flags: int,
                                                       body: bytes) -> None:
    """Whatever a body holds, the reply is an answer or a bounded domain error: never an
    INTERNAL (an exception the decoder did not expect)."""
    server, _ = served
    fast = server.fast_paths[0]
    reply = fast._call(9, method, flags, body, Peer(os.getpid(), os.getuid(), os.getgid(), ()))
    length, rid, status = w.REPLY.unpack_from(reply)
    assert rid == 9 and length == len(reply) - w.REPLY.size
    if status == w.ERROR:
        err = from_status_bytes(reply[w.REPLY.size:])
        assert err.reason != "INTERNAL" and err.from_daemon, err
        assert length < SMALL_REPLY


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunks=st.lists(st.binary(min_size=1, max_size=64), min_size=1, max_size=6))
def test_fuzzed_streams_end_in_replies_or_a_closed_connection(
        served: tuple[HiCacheServer, str], chunks: list[bytes]) -> None:
    _, target = served
    with _connect(target) as sk:
        for c in chunks:
            try:
                sk.sendall(c)
            except OSError:
                break  # closed by the daemon: allowed
        sk.shutdown(socket.SHUT_WR)
        sk.settimeout(5)
        t0 = time.monotonic()
        try:
            while sk.recv(1 << 16):
                pass
        except (ConnectionResetError, TimeoutError) as exc:
            assert not isinstance(exc, TimeoutError), "the daemon neither answered nor closed"
        assert time.monotonic() - t0 < 3


def test_the_daemon_serves_on_after_the_fuzzing(served: tuple[HiCacheServer, str]) -> None:
    _, target = served
    with _connect(target) as sk:
        sk.sendall(os.urandom(4096))
    with HiCacheClient(target) as c:
        assert c.lookup(SPEC.name, [b"x"]).hits == 0 and c.data_path == "fast"


# -- slow bodies and the frame budget ----------------------------------------------------------

def test_a_slow_body_is_cut_off_at_the_body_timeout(served: tuple[HiCacheServer, str]) -> None:
    server, target = served
    with _connect(target) as sk:
        sk.sendall(w.REQUEST.pack(60 << 20, 1, w.Method.STORE, 0, 0) + b"x")
        t0 = time.monotonic()
        assert sk.recv(1) == b""  # closed, nothing said: the peer is not listening
        took = time.monotonic() - t0
    assert 0.9 <= took < 3.0
    assert _dropped(server, "body_timeout") == 1
    header_only = _connect(target)  # a header that never completes is bounded the same
    header_only.sendall(b"\x01\x02")
    assert header_only.recv(1) == b""
    header_only.close()
    assert _dropped(server, "body_timeout") == 2


def test_a_frame_larger_than_the_budget_is_refused_overloaded(
        served: tuple[HiCacheServer, str]) -> None:
    server, target = served
    with _connect(target) as sk:
        body = b"\x00" * (8 << 20)  # the budget is 4 MiB
        sk.sendall(w.REQUEST.pack(len(body), 5, w.Method.LOOKUP, 0, 0))
        try:
            sk.sendall(body)
        except OSError:
            pass
        rid, status, data = _reply(sk)
    err = from_status_bytes(data)
    assert (rid, status, err.reason) == (5, w.ERROR, "OVERLOADED")
    assert err.metadata["limit"] == str(4 << 20) and "retry_after_ms" in err.metadata
    assert _dropped(server, "overloaded") == 1
    deadline = time.monotonic() + 5  # its connection's thread gives the budget back as it ends
    while server.frame_budget.in_use:
        assert time.monotonic() < deadline, server.frame_budget.in_use
        time.sleep(0.01)


def test_a_frame_waits_for_room_a_stalled_one_gives_back(served: tuple[HiCacheServer, str]
                                                          ) -> None:
    """A stalled sender holds what its buffer grew to; a second frame that does not fit
    beside it waits, and goes through once the stalled one is cut off."""
    server, target = served
    stalled = _connect(target)
    stalled.sendall(w.REQUEST.pack(1536 << 10, 1, w.Method.LOOKUP, 0, 0)
                    + b"\x00" * (1200 << 10))
    deadline = time.monotonic() + 5
    while server.frame_budget.in_use < 1 << 20:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    out: list[bytes] = []
    w.put_string(out, SPEC.name)
    w.put_string(out, "")
    w.put_keys(out, [b"k%031d" % i for i in range(60_000)])  # 1.9 MB: does not fit beside
    body = b"".join(out)
    with _connect(target) as sk:
        t0 = time.monotonic()
        sk.sendall(w.REQUEST.pack(len(body), 2, w.Method.LOOKUP, 0, 0) + body)
        rid, status, data = _reply(sk)
        waited = time.monotonic() - t0
    assert (rid, status) == (2, w.OK), from_status_bytes(data)
    assert w.LOOKUP_REPLY.unpack_from(data)[2] == 60_000
    assert waited > 0.2  # it waited for the stalled frame to be cut off
    assert stalled.recv(1) == b""
    stalled.close()
    assert server.frame_budget.in_use == 0


# -- many connections against a daemon process --------------------------------------------------

def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("sent", [1, 200 << 10], ids=["one-byte", "200KiB"])
def test_many_connections_announcing_60MiB_stay_within_the_budget(tmp_path: Path,
                                                                  sent: int) -> None:
    budget = 64 << 20
    d = start_daemon(tmp_path, "--fast-path-body-timeout-s", "3",
                     "--fast-path-inflight-bytes", str(budget))
    conns: list[socket.socket] = []
    try:
        with HiCacheClient(d.target) as c:
            c.create_pool(SPEC)
            c.lookup(SPEC.name, [b"warm"])
        time.sleep(0.2)
        before = peak = _rss(d.proc.pid)
        stop = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, _rss(d.proc.pid))
                time.sleep(0.01)

        sampler = threading.Thread(target=sample)
        sampler.start()
        frame = w.REQUEST.pack(60 << 20, 1, w.Method.STORE, 0, 0) + b"\x00" * sent
        for _ in range(1024):
            sk = _connect(d.target)
            sk.setblocking(False)
            try:
                sk.send(frame)
            except BlockingIOError:
                pass
            conns.append(sk)
        with HiCacheClient(d.target) as c:  # the node's other workers are still served
            assert c.lookup(SPEC.name, [b"warm"]).hits == 0
        deadline = time.monotonic() + 20
        open_ = list(conns)
        while open_ and time.monotonic() < deadline:
            still = []
            for sk in open_:
                try:
                    if sk.recv(1 << 16) == b"":
                        continue
                except BlockingIOError:
                    pass
                except ConnectionResetError:
                    continue
                still.append(sk)
            open_ = still
            time.sleep(0.05)
        stop.set()
        sampler.join()
        assert not open_, f"{len(open_)} connections still open"
        grew = peak - before
        assert grew < budget + (64 << 20), f"RSS grew by {grew >> 20} MiB"
        with HiCacheClient(d.target) as c:
            assert c.lookup(SPEC.name, [b"warm"]).hits == 0 and c.data_path == "fast"
    finally:
        for sk in conns:
            sk.close()
        d.stop()



def _h2_frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") \
        + payload


def _hpack_literal(name: bytes, value: bytes) -> bytes:
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def _stalled_grpc_call(path: str, announced: int, sent: int) -> socket.socket:
    """A raw HTTP/2 connection to the gRPC socket that starts a Lookup whose message announces
    ``announced`` bytes, sends ``sent`` of them and stalls."""
    sk = socket.socket(socket.AF_UNIX)
    sk.settimeout(10)
    sk.connect(path)
    headers = b"".join(_hpack_literal(n, v) for n, v in (
        (b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"localhost"),
        (b":path", b"/hicache.v1.HostCache/Lookup"), (b"content-type", b"application/grpc"),
        (b"te", b"trailers")))
    body = b"\x00" + announced.to_bytes(4, "big") + b"\x0a" * sent
    sk.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _h2_frame(4, 0, 0, b"")
               + _h2_frame(1, 4, 1, headers) + _h2_frame(0, 0, 1, body))
    return sk


def test_stalled_grpc_calls_hold_no_memory_beyond_what_arrived(tmp_path: Path) -> None:
    """The hostile case of the fast path's test on the gRPC socket: 256 calls each announcing
    a 60 MiB message and sending 16 KiB of it. gRPC buffers what arrives (HTTP/2 flow
    control), never what a message announces; other workers are served meanwhile."""
    d = start_daemon(tmp_path)
    conns: list[socket.socket] = []
    try:
        with HiCacheClient(d.target, fast_path=False) as c:
            c.create_pool(SPEC)
            c.lookup(SPEC.name, [b"warm"])
            time.sleep(0.2)
            before = _rss(d.proc.pid)
            for _ in range(256):
                conns.append(_stalled_grpc_call(d.socket, 60 << 20, 16 << 10))
            time.sleep(1.0)
            grew = _rss(d.proc.pid) - before
            assert c.lookup(SPEC.name, [b"warm"]).hits == 0  # still served
        assert grew < 64 << 20, f"RSS grew by {grew >> 20} MiB"
    finally:
        for sk in conns:
            sk.close()
        d.stop()
