"""The daemon's KV event stream through real daemon and worker processes, decoded with SGLang's
own ``KVEventBatch`` decoder (``tests.kv_event_follower``): every change of what a tier holds
is told with its medium and SGLang's block hash; a subscriber that joins late, misses
messages or outlives a daemon restart catches up through the replay socket.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import zmq

from hicache import HiCacheError
from hicache.error_mapping import from_rpc_error
from hicache.v1 import hicache_pb2 as pb
from hicache_client import HiCacheClient, ShmDeviceBuffers
from tests import prom
from tests.daemon_proc import DaemonProc, Daemons, start_daemon
from tests.kv_event_follower import Follower
from tests.kv_event_workers import OTHER, PS, SPEC, Worker, chain, kv_args, sglang_hash


@pytest.fixture
def daemon(daemons: Daemons, tmp_path: Path) -> DaemonProc:
    return daemons.start(*kv_args(tmp_path))


def follow(tmp: Path, subscribe: bytes = b"") -> Follower:
    f = Follower(f"ipc://{tmp}/kv.sock", f"ipc://{tmp}/kv-replay.sock", subscribe)
    time.sleep(0.2)  # the subscription reaches the daemon
    f.sync()
    return f


def test_a_store_is_one_chain_with_sglangs_block_hashes_parent_and_tokens(
        daemon: DaemonProc, tmp_path: Path) -> None:
    f = follow(tmp_path)
    w = Worker(daemon)
    try:
        keys, tokens = chain(1, 5)
        assert w.store(keys[:2]) == 2  # the first two pages, no tokens given
        assert w.store(keys[2:], tokens[2 * PS:], parent=keys[1]) == 3  # the rest, with them
        f.until(lambda: len(f.held(SPEC.name, "CPU_PINNED")) == 5)
        # both went over the fast path (the second with FLAG_CHAIN), none over gRPC
        text = daemon.metrics()
        assert prom.value(text, "hicache_fast_path_requests_total", method="Store") == 2, \
            text[-2000:]
    finally:
        w.close()
    first, rest = f.stored(SPEC.name, "CPU_PINNED")
    assert first.block_hashes == [sglang_hash(k) for k in keys[:2]]
    assert first.parent_block_hash is None and first.token_ids == [] and first.block_size == PS
    assert rest.block_hashes == [sglang_hash(k) for k in keys[2:]]
    assert rest.parent_block_hash == sglang_hash(keys[1])
    assert rest.token_ids == tokens[2 * PS:].tolist()
    assert f.gaps == 0


def test_eviction_removal_and_clear_leave_the_stream_equal_to_the_pool(
        daemon: DaemonProc, tmp_path: Path) -> None:
    f = follow(tmp_path)
    w = Worker(daemon)
    try:
        a, _ = chain(2, 6)
        b, _ = chain(3, 4)
        w.store(a)
        w.store(b)  # 10 pages into 8: the older chain's two deepest go, its tail first
        f.until(lambda: len(f.held(SPEC.name, "CPU_PINNED")) == 8)
        assert f.held(SPEC.name, "CPU_PINNED") == {sglang_hash(k) for k in a[:4] + b}
        evicted = [h for e in f.removed(SPEC.name, "CPU_PINNED") for h in e.block_hashes]
        assert evicted == [sglang_hash(k) for k in (a[5], a[4])]
        assert w.client.remove_keys(SPEC.name, b[:2]) == 2
        f.until(lambda: len(f.held(SPEC.name, "CPU_PINNED")) == 6)
        assert w.client.clear_pool(SPEC.name) == 6
        f.until(lambda: not f.held(SPEC.name, "CPU_PINNED"))
        assert w.client.lookup(SPEC.name, a + b).hit_prefix == 0
    finally:
        w.close()


def test_a_refused_store_changes_nothing_and_says_nothing(daemon: DaemonProc,
                                                          tmp_path: Path) -> None:
    f = follow(tmp_path)
    w = Worker(daemon)
    try:
        keys, tokens = chain(4, 2)
        with pytest.raises(HiCacheError) as exc:  # one page's tokens for two keys
            w.store(keys, tokens[:PS])
        assert exc.value.reason == "TOKEN_IDS_INVALID"
        assert exc.value.metadata == {"field": "token_ids", "count": str(PS),
                                      "expected": str(2 * PS)}
        with pytest.raises(HiCacheError) as exc:
            w.store(keys, -tokens)
        assert exc.value.reason == "TOKEN_IDS_INVALID"
        with pytest.raises(HiCacheError) as exc:
            w.store(keys, tokens, parent=b"x" * 65)
        assert exc.value.reason == "KEY_INVALID" and exc.value.metadata["field"] == "parent_key"
        assert w.client.lookup(SPEC.name, keys).hits == 0
        w.store(keys[:1])  # and the stream goes on
        f.until(lambda: bool(f.stored()))
        assert [e.block_hashes for e in f.stored()] == [[sglang_hash(keys[0])]]
    finally:
        w.close()


def test_pools_are_told_apart_by_topic_and_a_subscriber_may_follow_one(
        daemon: DaemonProc, tmp_path: Path) -> None:
    every, only_b = follow(tmp_path), follow(tmp_path, OTHER.name.encode())
    wa, wb = Worker(daemon, SPEC), Worker(daemon, OTHER)
    try:
        keys, _ = chain(5, 2)
        wa.store(keys)
        wb.store(keys)  # the same pages in another pool: another topic
        every.until(lambda: len(every.held(OTHER.name, "CPU_PINNED")) == 2)
        assert every.held(SPEC.name, "CPU_PINNED") == every.held(OTHER.name, "CPU_PINNED")
        only_b.until(lambda: len(only_b.held(OTHER.name, "CPU_PINNED")) == 2)
        assert {p for (p, m), held in only_b.blocks.items() if held} == {OTHER.name}
        assert only_b.gaps >= 1  # kv-a's messages are numbered too: a filter sees gaps
    finally:
        wa.close()
        wb.close()


def test_a_late_subscriber_replays_the_buffer_then_follows_live(daemon: DaemonProc,
                                                                tmp_path: Path) -> None:
    w = Worker(daemon)
    try:
        keys, _ = chain(6, 4)
        for k in keys:
            w.store([k])
        late = Follower(f"ipc://{tmp_path}/kv.sock", f"ipc://{tmp_path}/kv-replay.sock")
        time.sleep(0.2)
        late.sync()  # from sequence 0: the start's AllBlocksCleared, then the four stores
        assert late.held(SPEC.name, "CPU_PINNED") == {sglang_hash(k) for k in keys}
        assert late.seqs == [] and late.replays == 1  # nothing live yet: all replayed
        more, _ = chain(7, 1)
        w.store(more)
        late.until(lambda: sglang_hash(more[0]) in late.held(SPEC.name, "CPU_PINNED"))
        assert late.gaps == 0
    finally:
        w.close()


def test_a_gap_older_than_the_buffer_is_answered_with_a_snapshot(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, *kv_args(tmp_path, config="[kv_events]\nbuffer_steps = 2\n"))
    w = Worker(d)
    try:
        keys, _ = chain(8, 6)
        w.store(keys[:3])
        for k in keys[3:]:  # a message each (events published together are one message)
            time.sleep(0.1)
            w.store([k])
        time.sleep(0.1)
        w.client.remove_keys(SPEC.name, keys[:1])
        f = Follower(f"ipc://{tmp_path}/kv.sock", f"ipc://{tmp_path}/kv-replay.sock")
        time.sleep(0.2)
        assert f.sync() >= 2  # the daemon's AllBlocksCleared and the pool's contents
        assert f.held(SPEC.name, "CPU_PINNED") == {sglang_hash(k) for k in keys[1:]}
        assert any(e.__class__.__name__ == "AllBlocksCleared" for _, _, e in f.events)
        # the snapshot keeps what the pool knows of chains: keys[1], keys[2] follow keys[0]
        stored = {tuple(e.block_hashes): e.parent_block_hash for e in f.stored()}
        assert stored[(sglang_hash(keys[1]), sglang_hash(keys[2]))] == sglang_hash(keys[0])
        w.store(keys[:1])
        f.until(lambda: len(f.held(SPEC.name, "CPU_PINNED")) == 6)
        assert f.gaps == 0
    finally:
        w.close()
        d.stop()


def test_a_daemon_restart_is_a_gap_whose_replay_restates_what_is_held(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, *kv_args(tmp_path))
    f = follow(tmp_path)
    w = Worker(d)
    keys, _ = chain(9, 3)
    w.store(keys)
    f.until(lambda: len(f.held(SPEC.name, "CPU_PINNED")) == 3)
    before = f.last
    w.session.stop_heartbeat()
    d.stop(signal.SIGKILL)
    f.blocks[(SPEC.name, "CPU_PINNED")].add(12345)  # what the old daemon never removed
    d = start_daemon(tmp_path, *kv_args(tmp_path), socket=d.socket)
    try:
        with HiCacheClient(d.target) as c:
            c.create_pool(SPEC)  # re-attached: its keys survived
            assert c.lookup(SPEC.name, keys).hit_prefix == 3
            time.sleep(0.5)
            f.sync()
        assert f.held(SPEC.name, "CPU_PINNED") == {sglang_hash(k) for k in keys}
        assert min(s for _, s, _ in f.events if s > before) > before  # never a repeat
    finally:
        d.stop()


def test_a_hostile_replay_request_is_ignored_and_the_stream_goes_on(daemon: DaemonProc,
                                                                     tmp_path: Path) -> None:
    bad: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    bad.connect(f"ipc://{tmp_path}/kv-replay.sock")
    bad.send_multipart([b"", b"\x00" * 3])  # not 8 bytes
    bad.send_multipart([b"", b"\x00" * 8, b"extra"])  # four frames
    bad.send_multipart([b"", b"\x00" * 4096])  # past the socket's message limit: cut off
    f = follow(tmp_path)
    w = Worker(daemon)
    try:
        keys, _ = chain(10, 1)
        w.store(keys)
        f.until(lambda: bool(f.held(SPEC.name, "CPU_PINNED")))
        assert not bad.poll(200)  # no answer to any of them
        text = daemon.metrics()
        assert prom.value(text, "hicache_kv_events_bad_replays_total") == 2
        assert prom.value(text, "hicache_kv_events_replays_total") >= 1
        assert prom.value(text, "hicache_kv_events_subscribers") >= 1
        assert prom.value(text, "hicache_kv_events_dropped_total") == 0
    finally:
        w.close()
        bad.close()


def test_spill_eviction_promotion_and_removal_below_host_memory(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, *kv_args(tmp_path, "--disk-path", str(tmp_path / "disk"),
                                        "--disk-capacity", "64GiB"))
    f = follow(tmp_path)
    w = Worker(d)
    try:
        a, tokens = chain(11, 6)
        b, _ = chain(12, 4)
        w.store(a, tokens)
        f.until(lambda: len(f.held(SPEC.name, "DISK")) == 6)  # spilled ahead of eviction
        w.store(b)  # a's two deepest leave host memory (its tail first): the disk keeps them
        f.until(lambda: len(f.held(SPEC.name, "CPU_PINNED")) == 8)
        assert f.held(SPEC.name, "CPU_PINNED") == {sglang_hash(k) for k in a[:4] + b}
        assert {sglang_hash(k) for k in a} <= f.held(SPEC.name, "DISK")
        w.load(a[4:])  # promoted: stored in host memory again, with what the Store said
        f.until(lambda: sglang_hash(a[4]) in f.held(SPEC.name, "CPU_PINNED"))
        again = [e for e in f.stored(SPEC.name, "CPU_PINNED")
                 if sglang_hash(a[4]) in e.block_hashes][-1]
        assert again.block_hashes[:2] == [sglang_hash(k) for k in a[4:]]
        assert again.token_ids[:2 * PS] == tokens[4 * PS:6 * PS].tolist()
        assert w.client.remove_keys(SPEC.name, a[4:5]) == 1
        f.until(lambda: sglang_hash(a[4]) not in f.held(SPEC.name, "DISK"))
        assert sglang_hash(a[4]) not in f.held(SPEC.name, "CPU_PINNED")
        tiers = w.client.lookup(SPEC.name, a + b).tiers
        host, disk = f.held(SPEC.name, "CPU_PINNED"), f.held(SPEC.name, "DISK")
        for k, t in zip(a + b, tiers, strict=True):  # the stream says what Lookup says
            assert (sglang_hash(k) in host) == (t == 1), k
            assert t != 2 or sglang_hash(k) in disk, k
            assert t != 0 or sglang_hash(k) not in disk, k
    finally:
        w.close()
        d.stop()


def test_watch_events_carries_tier_medium_parent_and_tokens(daemon: DaemonProc) -> None:
    w = Worker(daemon)
    try:
        keys, tokens = chain(13, 2)
        w.store(keys, tokens, parent=b"p" * 32)
        w.client.remove_keys(SPEC.name, keys[1:])
        stream = w.client.watch_events(SPEC.name, all_tiers=True)
        events = iter(stream)
        got = [next(events), next(events)]
        stream.cancel()
    finally:
        w.close()
    stored, removed = got
    assert (stored.kind, stored.keys, stored.tier, stored.medium) == (
        "STORED", tuple(keys), 1, "CPU_PINNED")
    assert stored.parent_key == b"p" * 32 and stored.token_ids == tuple(tokens.tolist())
    assert stored.block_size == PS
    assert (removed.kind, removed.keys, removed.medium) == ("REMOVED", (keys[1],), "CPU_PINNED")


def test_get_info_and_hicachectl_say_where_to_subscribe(daemon: DaemonProc, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    from hicache_client.cli import main as hicachectl

    with HiCacheClient(daemon.target) as c:
        info = c.get_info()
    assert info.kv_events_endpoint == f"ipc://{tmp_path}/kv.sock"
    assert info.kv_events_replay_endpoint == f"ipc://{tmp_path}/kv-replay.sock"
    assert info.kv_events_topic == ""
    capsys.readouterr()
    assert hicachectl(["--target", daemon.target, "status"]) == 0
    assert re.search(rf"kv events\s+ipc://{re.escape(str(tmp_path))}/kv.sock \(replay ipc://",
                     capsys.readouterr().out)
    (tmp_path / "off").mkdir()
    off = start_daemon(tmp_path / "off")
    try:
        with HiCacheClient(off.target) as c:
            assert c.get_info().kv_events_endpoint == ""  # off by default
    finally:
        off.stop()


def test_a_store_over_grpc_says_the_same_of_its_chain(daemon: DaemonProc,
                                                      tmp_path: Path) -> None:
    f = follow(tmp_path)
    keys, tokens = chain(14, 2)
    with HiCacheClient(daemon.target, fast_path=False) as c:
        c.create_pool(SPEC)
        with ShmDeviceBuffers.create(SPEC, device_tokens=2 * PS, sealed=True) as bufs:
            with c.open_session(SPEC.name, "g", bufs.descriptors, fds=bufs.fds) as s:
                s.store(keys, torch.arange(2 * PS), token_ids=tokens, parent_key=keys[0][::-1])
                assert c.data_path == "grpc"
    f.until(lambda: bool(f.stored()))
    (ev,) = f.stored()
    assert ev.block_hashes == [sglang_hash(k) for k in keys]
    assert ev.parent_block_hash == sglang_hash(keys[0][::-1])
    assert ev.token_ids == tokens.tolist()


def test_a_store_s_lora_name_and_cache_salt_reach_routers_on_both_wires(
        daemon: DaemonProc, tmp_path: Path) -> None:
    """What else names a page to a router (the engines' own events carry it): told as the
    Store said over the fast path and over gRPC, on the KV event stream (SGLang's decoder)
    and over WatchEvents; a name too long is refused whole, before anything is stored."""
    f = follow(tmp_path)
    keys, tokens = chain(15, 6)
    lora = "adapter-\u00e9\u4e2d"
    w = Worker(daemon)
    try:
        w.session.store(keys[:2], torch.arange(2 * PS), token_ids=tokens[:2 * PS],
                        lora_name=lora, cache_salt="salt-1")
        with pytest.raises(HiCacheError) as exc:
            w.session.store(keys[2:4], torch.arange(2 * PS), lora_name="x" * 256)
        assert exc.value.reason == "KEY_INVALID"
        assert exc.value.metadata == {"field": "lora_name", "length": "256"}
        assert w.client.lookup(SPEC.name, keys[2:4]).hits == 0
        with HiCacheClient(daemon.target, fast_path=False) as c:
            with c.open_session(SPEC.name, "g", w.bufs.descriptors, fds=w.bufs.fds) as s:
                s.store(keys[2:4], torch.arange(2 * PS), token_ids=tokens[2 * PS:4 * PS],
                        parent_key=keys[1], cache_salt="salt-2")
                with pytest.raises(grpc.RpcError) as rpc:  # the daemon's own check
                    c._stub.Store(pb.StoreRequest(
                        session_id=s.session_id, keys=keys[4:5], cache_salt="\u00e9" * 128,
                        device_indices=np.arange(PS, dtype="<i8").tobytes()))
                refused = from_rpc_error(rpc.value)
                assert refused.reason == "KEY_INVALID"
                assert refused.metadata == {"field": "cache_salt", "length": "256"}
                with pytest.raises(HiCacheError) as exc:  # and the client's, before sending
                    s.store(keys[4:5], torch.arange(PS), cache_salt="\u00e9" * 128)
                assert exc.value.metadata == {"field": "cache_salt", "length": "256"}
        w.session.store(keys[4:], torch.arange(2 * PS), token_ids=tokens[4 * PS:],
                        parent_key=keys[3])
        f.until(lambda: len(f.held(SPEC.name, "CPU_PINNED")) == 6)
        text = daemon.metrics()
        assert prom.value(text, "hicache_fast_path_requests_total", method="Store") == 2, \
            text[-2000:]
        stream = w.client.watch_events(SPEC.name)
        events = iter(stream)
        watched = [next(events) for _ in range(3)]
        stream.cancel()
    finally:
        w.close()
    told = [(e.block_hashes, e.lora_name, e.cache_salt, e.token_ids) for e in f.stored()]
    assert told == [
        ([sglang_hash(k) for k in keys[:2]], lora, "salt-1", tokens[:2 * PS].tolist()),
        ([sglang_hash(k) for k in keys[2:4]], None, "salt-2", tokens[2 * PS:4 * PS].tolist()),
        ([sglang_hash(k) for k in keys[4:]], None, None, tokens[4 * PS:].tolist())]
    assert [(e.keys, e.lora_name, e.cache_salt) for e in watched] == [
        (tuple(keys[:2]), lora, "salt-1"), (tuple(keys[2:4]), "", "salt-2"),
        (tuple(keys[4:]), "", "")]


def test_a_store_s_lookahead_tokens_reach_routers_on_both_wires(daemon: DaemonProc,
                                                                tmp_path: Path) -> None:
    """vLLM's lookahead block hashes: the tokens after each page that its hash covers, given
    with a Store over the fast path and over gRPC, are told per block hash on the KV event
    stream (the field SGLang's decoder has no place for: read from the message's maps, while
    SGLang's decoder reads the rest) and over WatchEvents; a Store without them is told
    without the field. Bad ones are refused whole (TOKEN_IDS_INVALID naming the field), on
    either wire, and nothing of such a Store is stored or told."""
    f = follow(tmp_path)
    keys, tokens = chain(16, 6)
    rows = [[7000 + i, 7100 + i] for i in range(6)]  # 2 tokens after each page
    w = Worker(daemon)
    try:
        w.session.store(keys[:2], torch.arange(2 * PS), token_ids=tokens[:2 * PS],
                        lookahead_token_ids=rows[:2])
        for bad, tokens_given, meta in (
                (rows[:3], True, {"count": "6", "expected": "4"}),
                ([[1, -2], [3, 4]], True, {"position": "1"}),
                (rows[2:4], False, {"token_ids": "0"}),
                ([list(range(17))] * 2, True, {"value": "17", "max": "16"})):
            with pytest.raises(HiCacheError) as exc:  # the daemon's check, on the fast path
                w.session.store(keys[2:4], torch.arange(2 * PS),
                                token_ids=tokens[2 * PS:4 * PS] if tokens_given else None,
                                lookahead_token_ids=bad)
            assert exc.value.reason == "TOKEN_IDS_INVALID"
            field = "lookahead_tokens" if "max" in meta else "lookahead_token_ids"
            assert exc.value.metadata == {"field": field, **meta}
        assert w.client.lookup(SPEC.name, keys[2:]).hits == 0
        with HiCacheClient(daemon.target, fast_path=False) as c:
            with c.open_session(SPEC.name, "g", w.bufs.descriptors, fds=w.bufs.fds) as s:
                with pytest.raises(grpc.RpcError) as rpc:  # the same check over gRPC
                    c._stub.Store(pb.StoreRequest(
                        session_id=s.session_id, keys=keys[2:4],
                        device_indices=np.arange(2 * PS, dtype="<i8").tobytes(),
                        token_ids=tokens[2 * PS:4 * PS].tolist(), lookahead_tokens=2,
                        lookahead_token_ids=[1, 2, 3]))
                refused = from_rpc_error(rpc.value)
                assert refused.reason == "TOKEN_IDS_INVALID"
                assert refused.metadata == {"field": "lookahead_token_ids", "count": "3",
                                            "expected": "4"}
                assert c.lookup(SPEC.name, keys[2:]).hits == 0
                s.store(keys[2:4], torch.arange(2 * PS), token_ids=tokens[2 * PS:4 * PS],
                        parent_key=keys[1], lookahead_token_ids=np.asarray(rows[2:4]))
                assert c.data_path == "grpc"
        w.session.store(keys[4:], torch.arange(2 * PS), token_ids=tokens[4 * PS:],
                        parent_key=keys[3])  # the same chain, without lookahead tokens
        f.until(lambda: len(f.held(SPEC.name, "CPU_PINNED")) == 6)
        text = daemon.metrics()  # lookahead tokens keep a Store on the fast path: the two
        # stored there and the four refused went over it (FLAG_LOOKAHEAD), none over gRPC
        assert prom.value(text, "hicache_fast_path_requests_total", method="Store") == 6, \
            text[-2000:]
        stream = w.client.watch_events(SPEC.name)
        events = iter(stream)
        watched = [next(events) for _ in range(3)]
        stream.cancel()
    finally:
        w.close()
    told: dict[int, list[int] | None] = {}
    for m in f.stored_maps():
        ahead = m.get("lookahead_token_ids")
        assert ahead is None or len(ahead) == len(m["block_hashes"]), m
        for i, h in enumerate(m["block_hashes"]):
            told[h] = ahead[i] if ahead is not None else None
    assert told == {**{sglang_hash(k): r for k, r in zip(keys[:4], rows, strict=False)},
                    **{sglang_hash(k): None for k in keys[4:]}}
    assert [h for e in f.stored() for h in e.block_hashes] == [sglang_hash(k) for k in keys]
    assert [e.token_ids for e in f.stored()][-1] == tokens[4 * PS:].tolist()
    assert [(e.keys, e.lookahead_token_ids) for e in watched] == [
        (tuple(keys[:2]), tuple(map(tuple, rows[:2]))),
        (tuple(keys[2:4]), tuple(map(tuple, rows[2:4]))), (tuple(keys[4:]), ())]
