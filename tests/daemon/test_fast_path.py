"""The fast path (``<socket>.fast``): offered, chosen, exact, and refusing what gRPC refuses.

Each test runs a daemon in this process on a temp socket (a real Unix socket, real shared
memory buffers) and compares the fast path with gRPC on the same daemon: the same bytes, the
same reason codes and metadata, the same metrics, the same gates.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache import fast_wire as w
from hicache.error_mapping import from_status_bytes
from hicache.errors import Draining, HiCacheError, Overloaded, PeerNotAllowed
from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers
from hicache_client.fast_path import FastPath
from hicached.server.app import HiCacheServer, create_server
from hicached.server.config import ServerConfig
from hicached.service.identity import AccessRule

GEOMETRIES = {
    "mha-bf16": KVGeometry(PoolKind.MHA, DType.BFLOAT16, 3, head_num=2, head_dim=8),
    "mla-fp8": KVGeometry(PoolKind.MLA, DType.FLOAT8_E4M3, 2, kv_lora_rank=16,
                          qk_rope_head_dim=8),
    "mha-f32": KVGeometry(PoolKind.MHA, DType.FLOAT32, 2, head_num=1, head_dim=4),
}
SPEC = PoolSpec("fp", GEOMETRIES["mha-bf16"], 4, size_tokens=4 * 64)
DEVICE_TOKENS = 4 * 32


def _serve(tmp_path: Path, *specs: PoolSpec, **cfg: object) -> tuple[HiCacheServer, str, str]:
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    config = ServerConfig(listen=(f"unix:{tmp_path}/s.sock",), shm_dir=str(shm), state_dir="",
                          metrics_listen="", memory_budget_bytes=256 << 20, reserve_bytes=0,
                          pools=specs or (SPEC,), grace_seconds=2, **cfg)  # type: ignore[arg-type]
    server, bound = create_server(config)
    return server, bound[0], str(shm)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[HiCacheServer, str, str]]:
    server, target, shm = _serve(tmp_path)
    yield server, target, shm
    server.drain_and_stop(1.0)


def fast_count(server: HiCacheServer, method: str) -> float:
    return server.registry.get_sample_value("hicache_fast_path_requests_total",
                                            {"method": method}) or 0.0


def test_offered_chosen_and_said(served: tuple[HiCacheServer, str, str]) -> None:
    server, target, _ = served
    with HiCacheClient(target) as fast, HiCacheClient(target, fast_path=False) as slow:
        info = fast.get_info()
        assert info.fast_path == target[len("unix:"):] + ".fast"
        assert info.fast_path_version == w.VERSION
        assert os.stat(info.fast_path).st_mode & 0o777 == 0o600
        assert fast.data_path == "fast" and slow.data_path == "grpc"
        fast.lookup("fp", [b"k"])
        slow.lookup("fp", [b"k"])
    assert fast_count(server, "Lookup") == 1
    assert server.registry.get_sample_value("hicache_rpc_requests_total",
                                            {"method": "Lookup", "code": "OK"}) == 2


def test_calls_stay_counted_once_their_connections_are_gone(
        served: tuple[HiCacheServer, str, str]) -> None:
    """Each connection's thread counts its calls in its own rows; the rows of connections
    that closed are folded into the totals once, never lost nor counted twice."""
    server, target, _ = served
    for round_ in range(1, 4):
        with HiCacheClient(target) as c:  # a connection (a thread in the daemon) per round
            for _ in range(7):
                c.lookup("fp", [b"k"])
            assert fast_count(server, "Lookup") == 7 * round_  # while it is open
        deadline = time.monotonic() + 10
        while any(re.fullmatch(r"fast-\d+", t.name) for t in threading.enumerate()):
            assert time.monotonic() < deadline, "the connection's thread did not end"
            time.sleep(0.01)
        for _ in range(2):  # after: its rows were folded in, once
            assert fast_count(server, "Lookup") == 7 * round_
            assert server.registry.get_sample_value(
                "hicache_rpc_duration_seconds_count", {"method": "Lookup"}) == 7 * round_


def test_hicachectl_says_which_path(served: tuple[HiCacheServer, str, str],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    from hicache_client.cli import main as hicachectl

    _, target, _ = served
    assert hicachectl(["--target", target, "status"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"fast path\s+/\S+\.sock\.fast", out)
    assert re.search(r"data calls over\s+fast", out)


def test_not_offered_when_turned_off(tmp_path: Path) -> None:
    server, target, _ = _serve(tmp_path, fast_path=False)
    try:
        with HiCacheClient(target) as c:
            assert c.get_info().fast_path == "" and c.data_path == "grpc"
            assert not os.path.exists(target[len("unix:"):] + ".fast")
    finally:
        server.drain_and_stop(1.0)


@pytest.mark.parametrize("layout", [Layout.LAYER_FIRST, Layout.PAGE_FIRST])
@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_exact_bytes_both_ways(tmp_path: Path, geometry: str, layout: Layout) -> None:
    spec = PoolSpec("fp", GEOMETRIES[geometry], 4, layout, size_tokens=4 * 64)
    server, target, shm = _serve(tmp_path, spec)
    try:
        with HiCacheClient(target) as c, ShmDeviceBuffers.create(spec, DEVICE_TOKENS, shm) as b:
            s = c.open_session("fp", "w", b.descriptors, heartbeat=False)
            assert c.data_path == "fast"
            g = torch.Generator().manual_seed(7)
            for t in b.all_tensors():
                t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                        dtype=torch.uint8, generator=g))
            want = [t.clone() for t in b.all_tensors()]
            keys = [bytes([i]) * 32 for i in range(3)]
            src = torch.cat([torch.arange(4) + 4 * p for p in (5, 1, 9)])
            assert s.store(keys, src).stored == 3
            host = s.alloc(8)
            s.backup(host, torch.arange(8) + 4 * 20)
            for t in b.all_tensors():
                t.zero_()
            dst = torch.cat([torch.arange(4) + 4 * p for p in (2, 3, 7)])
            assert s.load_keys(keys, dst).pages == 3
            assert s.load(host, torch.arange(8) + 4 * 12).pages == 2
            for got, ref in zip(b.all_tensors(), want, strict=True):
                rows = got.view(torch.uint8).view(got.shape[0], -1)  # bytes: NaN != NaN
                ref_rows = ref.view(torch.uint8).view(ref.shape[0], -1)
                for d, sp in ((2, 5), (3, 1), (7, 9), (12, 20), (13, 21)):
                    assert torch.equal(rows[4 * d:4 * d + 4], ref_rows[4 * sp:4 * sp + 4])
                assert not rows[:8].any()  # untouched rows stay zero
            s.close()
        for method in ("Store", "LoadKeys", "Backup", "Load"):
            assert fast_count(server, method) >= 1, method
    finally:
        server.drain_and_stop(1.0)


BAD = st.fixed_dictionaries({
    "op": st.sampled_from(["store", "load_keys", "backup", "load"]),
    "pages": st.lists(st.integers(-3, 40), min_size=0, max_size=5),
    "keys": st.integers(0, 6),
    "known": st.booleans(),
    "layers": st.sampled_from([(0, 0), (0, 1), (2, 1), (0, 9)]),
    "session": st.sampled_from(["ok", "bogus"]),
})


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=BAD)
def test_refusals_match_grpc(served: tuple[HiCacheServer, str, str],
                             case: dict[str, Any]) -> None:
    """Any batch, valid or not, gets the same outcome over both paths: the same reason (and,
    past the index fields' names, the same metadata), and a refusal changes nothing."""
    server, target, shm = served
    with HiCacheClient(target, reconnect_seconds=0.2) as fast, \
            HiCacheClient(target, fast_path=False, reconnect_seconds=0.2) as slow, \
            ShmDeviceBuffers.create(SPEC, DEVICE_TOKENS, shm) as b:
        s = fast.open_session("fp", "w", b.descriptors, heartbeat=False)
        slow._page_sizes[s.session_id] = 4  # (it did not open the session)
        known = [b"known-%d" % i for i in range(6)]
        s.store(known, torch.arange(4 * 6))
        host = s.alloc(8)
        sid = s.session_id if case["session"] == "ok" else "bogus"
        tokens = torch.tensor([4 * p + i for p in case["pages"] for i in range(4)],
                              dtype=torch.int64)
        keys = (known if case["known"] else [b"new-%d" % i for i in range(6)])[:case["keys"]]
        outcomes = []
        for c in (fast, slow):
            for t in b.all_tensors():
                t.zero_()
            before = (server.daemon.pools.cache("fp").key_count, fast_count(server, "Load"))
            try:
                if case["op"] == "store":
                    c.store(sid, [b"s" + k for k in keys], tokens)
                    c.remove_keys("fp", [b"s" + k for k in keys])
                    got = "ok"
                elif case["op"] == "load_keys":
                    c.load_keys(sid, keys, tokens, *case["layers"])
                    got = "ok"
                else:
                    hp = host[:tokens.numel()] if tokens.numel() <= 8 else host
                    getattr(c, case["op"])(sid, hp, tokens, *case["layers"])
                    got = "ok"
            except HiCacheError as exc:
                got = exc.reason
                md = {k: v for k, v in exc.metadata.items() if k != "field"}
                assert server.daemon.pools.cache("fp").key_count == before[0]
                if case["op"] in ("load_keys", "load"):
                    assert not any(t.any() for t in b.all_tensors())  # nothing landed
                outcomes.append((got, md if got in ("SESSION_NOT_FOUND", "KEY_NOT_FOUND",
                                                    "LAYER_OUT_OF_RANGE") else None))
                continue
            outcomes.append((got, None))
        assert outcomes[0] == outcomes[1], case
        s.close()


def test_malformed_frames_are_refused_and_the_daemon_serves_on(
        served: tuple[HiCacheServer, str, str]) -> None:
    server, target, _ = served
    path = target[len("unix:"):] + ".fast"

    def exchange(frames: bytes) -> tuple[int, bytes]:
        with socket.socket(socket.AF_UNIX) as sk:
            sk.settimeout(5)
            sk.connect(path)
            sk.sendall(w.HELLO.pack(w.MAGIC, w.VERSION, 0, 0))
            assert w.HELLO.unpack(sk.recv(w.HELLO.size))[0] == w.MAGIC
            sk.sendall(frames)
            (_, _, status), body = w.FrameSocket(sk).read(w.REPLY)
            return status, body

    for method, body, reason in ((99, b"", "SPEC_INVALID"),
                                 (w.Method.LOOKUP, b"\x05\x00ab", "INDICES_MALFORMED"),
                                 (w.Method.STORE, b"\x00\x00" + b"\x00" * 8 + b"\xff" * 3,
                                  "INDICES_MALFORMED")):
        status, data = exchange(w.REQUEST.pack(len(body), 1, method, 0, 0) + body)
        assert status == w.ERROR and from_status_bytes(data).reason == reason
    too_big = server.config.max_message_bytes + 1
    status, data = exchange(w.REQUEST.pack(too_big, 2, w.Method.LOOKUP, 0, 0))
    assert from_status_bytes(data).reason == "RESOURCE_EXHAUSTED"
    with socket.socket(socket.AF_UNIX) as sk:  # another version: told ours, then closed
        sk.settimeout(5)
        sk.connect(path)
        sk.sendall(w.HELLO.pack(w.MAGIC, w.VERSION + 1, 0, 0))
        assert w.HELLO.unpack(sk.recv(w.HELLO.size))[1] == w.VERSION
        assert sk.recv(1) == b""
    with HiCacheClient(target) as c:
        assert c.lookup("fp", [b"x"]).hits == 0 and c.data_path == "fast"


def test_access_rules_use_the_connections_own_peer(tmp_path: Path) -> None:
    me = os.getuid()
    spec_open = PoolSpec("mine", SPEC.geometry, 4, size_tokens=4 * 16)
    spec_closed = PoolSpec("theirs", SPEC.geometry, 4, size_tokens=4 * 16)
    server, target, _ = _serve(tmp_path, spec_open, spec_closed,
                               access=(AccessRule("mine", uids=(me,)),
                                       AccessRule("theirs", uids=(me + 1,))))
    try:
        fast = FastPath(target[len("unix:"):] + ".fast", 5.0)
        from hicache_client.fast_path import decode_lookup, lookup_body

        assert decode_lookup(fast.call(w.Method.LOOKUP,
                                       lookup_body("mine", "", [b"k"]))).hits == 0
        with pytest.raises(PeerNotAllowed):
            fast.call(w.Method.LOOKUP, lookup_body("theirs", "", [b"k"]))
        with pytest.raises(PeerNotAllowed):  # a capability of nothing proves nothing
            fast.call(w.Method.LOOKUP, lookup_body("theirs", "not-a-session", [b"k"]))
        fast.close()
        assert server.registry.get_sample_value("hicache_rejected_requests_total",
                                                {"reason": "PEER_NOT_ALLOWED"}) == 2
    finally:
        server.drain_and_stop(1.0)


def test_one_bound_over_both_paths_and_the_drain_gate(
        served: tuple[HiCacheServer, str, str]) -> None:
    server, target, shm = served
    with HiCacheClient(target, reconnect_seconds=0.3) as c, \
            ShmDeviceBuffers.create(SPEC, DEVICE_TOKENS, shm) as b:
        s = c.open_session("fp", "w", b.descriptors, heartbeat=False)
        gate = server.admission
        for _ in range(gate.limit):  # every slot taken (as by gRPC transfers in flight)
            gate.enter()
        try:
            with pytest.raises(Overloaded) as exc:
                s.store([b"a" * 32], torch.arange(4))
            assert exc.value.metadata["limit"] == str(gate.limit)
        finally:
            for _ in range(gate.limit):
                gate.leave()
        assert s.store([b"a" * 32], torch.arange(4)).stored == 1
        assert c.data_path == "fast"
        fast = FastPath(target[len("unix:"):] + ".fast", 5.0)
        from hicache_client.fast_path import keyed_body, lookup_body

        server.daemon.draining.set()
        try:
            with pytest.raises(Draining):
                fast.call(w.Method.LOAD_KEYS, keyed_body(s.session_id, [b"a" * 32],
                                                         torch.tensor([1]).numpy()))
            fast.call(w.Method.LOOKUP, lookup_body("fp", "", [b"a" * 32]))  # still answers
        finally:
            server.daemon.draining.clear()
            fast.close()
        s.close()


def test_a_lost_fast_path_falls_back_to_grpc(served: tuple[HiCacheServer, str, str]) -> None:
    server, target, shm = served
    with HiCacheClient(target) as c, ShmDeviceBuffers.create(SPEC, DEVICE_TOKENS, shm) as b:
        s = c.open_session("fp", "w", b.descriptors, heartbeat=False)
        assert s.store([b"a" * 32], torch.arange(4)).stored == 1 and c.data_path == "fast"
        for fp in server.fast_paths:
            fp.close()
            assert fp._accepting is not None and not fp._accepting.is_alive()
            assert fp.connections == 0 or _drained(fp)
        grpc_before = server.registry.get_sample_value(
            "hicache_rpc_requests_total", {"method": "LoadKeys", "code": "OK"}) or 0
        assert s.load_keys([b"a" * 32], torch.arange(4) + 4).pages == 1
        assert c.data_path == "grpc"
        assert server.registry.get_sample_value(
            "hicache_rpc_requests_total", {"method": "LoadKeys", "code": "OK"}) == grpc_before + 1
        s.close()


def test_a_threads_connection_closes_with_the_thread(
        served: tuple[HiCacheServer, str, str]) -> None:
    """Calls from many short-lived threads leave no connection behind (on either side)."""
    server, target, _ = served
    with HiCacheClient(target) as c:
        c.lookup("fp", [b"k"])
        for _ in range(20):
            t = threading.Thread(target=c.lookup, args=("fp", [b"k"]))
            t.start()
            t.join()
        assert c._fast is not None and c._fast.connections == 1  # this thread's
        assert _drained_to(server.fast_paths[0], 1)
    assert _drained_to(server.fast_paths[0], 0)


def _drained_to(fp: object, n: int) -> bool:
    for _ in range(200):
        if fp.connections == n:  # type: ignore[attr-defined]
            return True
        time.sleep(0.02)
    return False


def _drained(fp: object) -> bool:
    """Every connection's thread saw its socket shut (they leave within moments)."""
    for _ in range(100):
        if fp.connections == 0:  # type: ignore[attr-defined]
            return True
        time.sleep(0.02)
    return False


def test_many_threads_share_a_client(served: tuple[HiCacheServer, str, str]) -> None:
    """Eight threads, each its own connection, store and load their own pages at once."""
    server, target, shm = served
    with HiCacheClient(target) as c, ShmDeviceBuffers.create(SPEC, DEVICE_TOKENS, shm) as b:
        s = c.open_session("fp", "w", b.descriptors, heartbeat=False)
        for buf in b.all_tensors():  # every row different: a load that did not land shows
            buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.view(torch.uint8).shape,
                                                      dtype=torch.uint8))
        # the path is chosen before the threads start: a thread that found another asking
        # for it past its own deadline would go over gRPC (by design), and not be counted
        assert c.data_path == "fast"
        errors: list[BaseException] = []
        barrier = threading.Barrier(8)

        def work(i: int) -> None:
            try:
                barrier.wait()
                for n in range(30):
                    key = struct.pack("<II", i, n) * 4
                    s.store([key], torch.arange(4) + 4 * i)
                    s.load_keys([key], torch.arange(4) + 4 * (8 + i))
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors, errors
        for buf in b.all_tensors():
            r = buf.view(torch.uint8).view(buf.shape[0], -1)
            for i in range(8):
                assert torch.equal(r[4 * (8 + i):4 * (9 + i)], r[4 * i:4 * (i + 1)])
        assert fast_count(server, "Store") == 240 and fast_count(server, "LoadKeys") == 240
        s.close()


def test_heartbeats_keep_a_session_over_the_fast_path_past_a_full_gate(
        served: tuple[HiCacheServer, str, str]) -> None:
    server, target, shm = served
    with HiCacheClient(target) as c, ShmDeviceBuffers.create(SPEC, DEVICE_TOKENS, shm) as b:
        s = c.open_session("fp", "w", b.descriptors, lease_ms=300, heartbeat=True)
        gate = server.admission
        for _ in range(gate.limit):  # the data path full: a heartbeat is control
            gate.enter()
        try:
            time.sleep(1.2)  # four leases
            assert s.heartbeat_error is None
            assert server.daemon.sessions.count("fp") == 1
        finally:
            for _ in range(gate.limit):
                gate.leave()
        assert fast_count(server, "Heartbeat") >= 3
        s.close()
        with pytest.raises(HiCacheError) as exc:
            c.beat(s.session_id)
        assert exc.value.reason == "SESSION_NOT_FOUND"


def test_a_forked_child_opens_its_own_connection(served: tuple[HiCacheServer, str, str]
                                                 ) -> None:
    """A worker that forks after using the fast path: parent and child each keep a stream of
    their own (a shared one would interleave their frames)."""
    _server, target, _ = served
    with HiCacheClient(target) as c:
        assert c.lookup("fp", [b"p"]).hits == 0 and c.data_path == "fast"
        parent_sock = c._fast._local.conn  # type: ignore[union-attr]
        pid = os.fork()
        if pid == 0:  # the child: its own connection, then a clean exit code
            ok = False
            try:
                for _ in range(50):
                    c.lookup("fp", [b"c"])
                ok = c._fast._local.conn is not parent_sock  # type: ignore[union-attr]
            except BaseException as exc:
                os.write(2, f"child: {exc!r}\n".encode())
            finally:
                os._exit(0 if ok else 1)
        for _ in range(50):
            assert c.lookup("fp", [b"p"]).hits == 0
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert c._fast._local.conn is parent_sock  # type: ignore[union-attr]
        assert c.lookup("fp", [b"p"]).hits == 0


def _polls(server: HiCacheServer) -> tuple[float, float, float]:
    def get(name: str, labels: dict[str, str] | None = None) -> float:
        return server.registry.get_sample_value(name, labels or {}) or 0.0
    return (get("hicache_fast_path_polls_total", {"result": "caught"}),
            get("hicache_fast_path_polls_total", {"result": "slept"}),
            get("hicache_fast_path_poll_seconds_total"))


@pytest.mark.parametrize("spin_us", [20_000, 0])
def test_back_to_back_calls_are_polled_for_both_ways(tmp_path: Path, spin_us: int) -> None:
    """Calls that come back to back: the daemon's connection catches the next request by
    polling, the client catches its reply; the counts outlive the connection. With both
    windows at 0 nothing polls. The window is 20 ms, not the default 200 us: on a loaded test
    machine a wait of more than 200 us shrinks the window to 0 and then nothing polls, which
    is right but not what this test is about. Daemon and client share this process, so it
    lets two threads poll at once (two processes would have a limit each); the busy-node check
    is off (it has a test of its own)."""
    from hicache import _poll  # type: ignore[attr-defined]
    from hicache.polling import native_available

    assert native_available()  # loaded now: loading sets the limit of pollers
    server, target, _ = _serve(tmp_path, fast_path_spin_us=spin_us)
    busy_check = _poll.set_busy_check(False)
    pollers = _poll.set_max_pollers(2)
    try:
        with HiCacheClient(target, spin_us=spin_us) as c:
            for _ in range(200):
                c.lookup("fp", [b"k"])
            client_poll = c._fast._local.conn.frames.poll  # type: ignore[union-attr]
            mine = (client_poll.caught, client_poll.polls)
        deadline = time.monotonic() + 5
        while server.fast_paths[0].connections and time.monotonic() < deadline:
            time.sleep(0.01)
        caught, slept, seconds = _polls(server)
        if spin_us:
            assert caught >= 100 and seconds > 0, (caught, slept, seconds)
            assert mine[0] >= 100, mine
        else:
            assert (caught, slept, seconds) == (0, 0, 0) and mine == (0, 0)
    finally:
        _poll.set_busy_check(busy_check)
        _poll.set_max_pollers(pollers)
        server.drain_and_stop(1.0)


def test_a_refusal_added_to_the_envelope_shows_on_both_front_ends(
        served: tuple[HiCacheServer, str, str]) -> None:
    """One check, added once, where every call goes through: gRPC and the fast path refuse
    alike (reason, metadata, code, counted the same), and nothing was written twice."""
    from hicache.errors import PoolClosed
    from hicached.frontends.envelope import Call

    server, target, _ = served
    seen: list[tuple[str, str]] = []

    def closed_for_maintenance(call: Call, request: object) -> None:
        seen.append((call.method, call.front))
        if call.method == "Lookup" and getattr(request, "pool", "") == "fp":
            raise PoolClosed("pool fp is closed for maintenance", metadata={"pool": "fp"})

    server.envelope.add_check(closed_for_maintenance)
    outcomes = []
    with HiCacheClient(target) as fast, HiCacheClient(target, fast_path=False) as slow:
        for c in (fast, slow):
            with pytest.raises(HiCacheError) as exc:
                c.lookup("fp", [b"k"])
            outcomes.append((exc.value.reason, exc.value.metadata, exc.value.grpc_code,
                             exc.value.from_daemon))
        assert fast.data_path == "fast" and slow.data_path == "grpc"
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][:2] == ("POOL_CLOSED", {"pool": "fp"}) and outcomes[0][3]
    assert ("Lookup", "fast") in seen and ("Lookup", "grpc") in seen
    assert server.registry.get_sample_value(
        "hicache_rpc_requests_total", {"method": "Lookup", "code": "FAILED_PRECONDITION"}) == 2
    assert server.registry.get_sample_value(
        "hicache_rejected_requests_total", {"reason": "POOL_CLOSED"}) == 2


def _page_ids_by_definition(rows: list[int], page_size: int) -> list[int] | None:
    if len(rows) % page_size:
        return None
    out = []
    for at in range(0, len(rows), page_size):
        first = rows[at]
        if first % page_size or rows[at:at + page_size] != list(
                range(first, first + page_size)):
            return None
        out.append(first // page_size)
    return out


@st.composite
def _token_rows(draw: st.DrawFn) -> tuple[list[int], int]:
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    pages = draw(st.lists(st.integers(0, 40), max_size=6))
    rows = [p * page_size + j for p in pages for j in range(page_size)]
    how = draw(st.sampled_from(["pages", "run", "swap", "shift", "cut", "dup"]))
    if how == "run" and pages:  # one run of consecutive pages
        rows = list(range(pages[0] * page_size, (pages[0] + len(pages)) * page_size))
    elif how == "swap" and len(rows) > 2:  # same first and last row, not ascending
        i = draw(st.integers(1, len(rows) - 2))
        rows[i], rows[i - 1] = rows[i - 1], rows[i]
    elif how == "shift" and rows:
        rows = [r + draw(st.integers(1, 3)) for r in rows]
    elif how == "cut" and rows:
        rows = rows[:-1]
    elif how == "dup" and len(rows) > 1:
        rows[-1] = rows[-2]
    return rows, page_size


@settings(max_examples=400, deadline=None)
@given(_token_rows(), st.sampled_from(["tensor", "list", "bytes"]))
def test_page_ids_are_whole_aligned_pages_and_nothing_else(
        case: tuple[list[int], int], form: str) -> None:
    from hicache.indices import indices_to_bytes
    from hicache_client.fast_path import page_ids

    rows, page_size = case
    indices: object = {"tensor": torch.tensor(rows, dtype=torch.int64), "list": rows,
                       "bytes": indices_to_bytes(rows)}[form]
    got = page_ids(indices, page_size)
    want = rows if page_size == 1 else _page_ids_by_definition(rows, page_size)
    assert (None if got is None else got.tolist()) == want


@pytest.mark.parametrize("fast", [True, False])
def test_a_touching_lookup_keeps_its_hits_from_eviction_on_both_paths(tmp_path: Path,
                                                                       fast: bool) -> None:
    """``lookup(touch=True)`` over either wire makes the hit's pages the most recently used:
    the next Store into the full pool evicts the others; a plain Lookup changes nothing."""
    spec = PoolSpec("small", GEOMETRIES["mha-bf16"], 4, size_tokens=4 * 4)  # 4 pages
    server, target, shm = _serve(tmp_path, spec)
    try:
        with HiCacheClient(target, fast_path=fast) as c, \
                ShmDeviceBuffers.create(spec, DEVICE_TOKENS, shm) as b:
            s = c.open_session("small", "w", b.descriptors, heartbeat=False)
            keys = [bytes([i]) * 32 for i in range(6)]
            assert s.store(keys[:4], torch.arange(16)).stored == 4
            assert c.lookup("small", keys[2:4]).hit_prefix == 2  # no touch: still oldest
            assert s.lookup(keys[:2], touch=True).hits == 2
            assert c.data_path == ("fast" if fast else "grpc")
            assert s.store(keys[4:], torch.arange(8)).stored == 2
            assert c.lookup("small", keys).tiers == b"\x01\x01\x00\x00\x01\x01"
            s.close()
        assert (fast_count(server, "Lookup") > 0) is fast
    finally:
        server.drain_and_stop(1.0)


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "grpc"])
def test_store_async_is_store_on_another_thread(served: tuple[HiCacheServer, str, str],
                                                fast_path: bool) -> None:
    """``store_async`` goes through the one call path on either wire: the same result as
    ``store``, the same domain error (from the daemon, with its reason), and an Overloaded
    data path answered as ``store`` answers it."""
    from hicache.errors import SessionNotFound

    server, target, shm = served
    with HiCacheClient(target, fast_path=fast_path, reconnect_seconds=0.3) as c, \
            ShmDeviceBuffers.create(SPEC, DEVICE_TOKENS, shm) as b:
        s = c.open_session("fp", "w", b.descriptors, heartbeat=False)
        assert c.data_path == ("fast" if fast_path else "grpc")
        got = s.store_async([b"async-%d" % i for i in range(3)], torch.arange(12)).result(10)
        want = s.store([b"sync-%d" % i for i in range(3)], torch.arange(12))
        assert type(got) is type(want) and got.stored == want.stored == 3
        again = c.store_async(s.session_id, [b"async-0"], torch.arange(4)).result(10)
        assert again.stored == 0  # present already: the same answer store gives
        with pytest.raises(SessionNotFound) as exc:
            c.store_async("bogus", [b"x" * 32], torch.arange(4)).result(10)
        assert exc.value.from_daemon
        gate = server.admission
        for _ in range(gate.limit):
            gate.enter()
        try:
            errors = []
            for call in (lambda: s.store([b"o" * 32], torch.arange(4)),
                         lambda: s.store_async([b"o" * 32], torch.arange(4)).result(10)):
                with pytest.raises(Overloaded) as over:
                    call()
                errors.append((type(over.value), over.value.metadata["limit"]))
            assert errors[0] == errors[1]
        finally:
            for _ in range(gate.limit):
                gate.leave()
