"""The KV event publisher in-process: SGLang's own event code against ours for the same pages,
the bounded queue under a stalled publisher (a seam holds its thread), the chain table's
budget, and the endpoints it refuses.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st
from sglang.srt.disaggregation.kv_events import KVEventBatch, StorageMedium
from sglang.srt.mem_cache.utils import hash_str_to_int64

from hicache import seams
from hicache.errors import HiCacheError
from hicache.keys import NO_NAMESPACE, Namespace, sglang_page_hashes, sglang_page_keys
from hicache.specs import KeyFormat
from hicached.cache.chains import ENTRY_OVERHEAD_BYTES, ChainTable
from hicached.cache.events import DISK, HOST, EventKind, EventLog
from hicached.cache.pool_cache import PoolCache
from hicached.core.pool import HostPool
from hicached.core.trusted_paths import UntrustedPath
from hicached.publish.kv_event_config import KvEventsConfig
from hicached.publish.kv_event_format import (
    Encoder,
    block_hash,
    block_hashes,
    contents_events,
    engine_events,
)
from hicached.publish.kv_events import KvEventPublisher
from hicached.server.config import parse_size
from hicached.tiers.disk import DiskTier
from hicached.tiers.stack import TierStack
from tests.helpers import make_pool, mha, spec
from tests.kv_event_follower import Follower
from tests.sglang_harness import install_stand_ins

PS = 4


@given(st.binary(min_size=1, max_size=64), st.integers(0, 70))
def test_a_block_hash_is_sglangs_hash_str_to_int64_of_the_key(key: bytes, n: int) -> None:
    assert block_hash(key) == hash_str_to_int64(key.hex())
    keys = [bytes([i % 256]) + key[1:] for i in range(n)]  # one width, or mixed
    assert block_hashes(keys) == [hash_str_to_int64(k.hex()) for k in keys]
    mixed = [*keys, b"x" * 9]
    assert block_hashes(mixed) == [hash_str_to_int64(k.hex()) for k in mixed]


@given(st.lists(st.binary(min_size=32, max_size=32), min_size=1, max_size=40),
       st.integers(0, 2**32 - 1))
def test_a_vllm_pools_block_hash_is_vllms_int_block_hash(hashes: list[bytes], group: int
                                                         ) -> None:
    """vLLM's ``OffloadKey`` = its block hash + a 4-byte group; vLLM's events name the block
    ``int.from_bytes(block_hash, "big") & (2**64 - 1)`` (``maybe_convert_block_hash``, under
    its default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): checked against vLLM itself in
    tests/integrations/vllm/test_router_vllm.py."""
    keys = [h + group.to_bytes(4, "big") for h in hashes]
    want = [int.from_bytes(h, "big") & (2**64 - 1) for h in hashes]
    assert [block_hash(k, KeyFormat.VLLM) for k in keys] == want
    assert block_hashes(keys, KeyFormat.VLLM) == want  # vectorized alike
    assert block_hashes([*keys, b"short"], KeyFormat.VLLM) == [
        *want, block_hash(b"short")]  # too short to be an OffloadKey: named as a digest


def _node(parent: Any, tokens: list[int]) -> Any:
    from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

    node = TreeNode()
    node.parent, node.key = parent, RadixKey(array("q", tokens))
    prior = parent.hash_value[-1] if parent.hash_value else None
    node.hash_value = sglang_page_hashes(tokens, PS, prior)
    return node


def test_a_stores_and_a_removals_events_are_sglangs_own_for_the_same_pages() -> None:
    """SGLang's recorder reports two radix nodes of one prefix being stored in host memory,
    then the second one removed; the daemon's event log sees the same pages stored by two
    Stores (the second naming its parent and both their tokens) and removed: the same
    messages, byte for byte, but for their timestamps."""
    install_stand_ins()  # what SGLang's radix cache imports but never uses here
    from sglang.srt.mem_cache.events import KVCacheEventRecorder
    from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

    tokens = np.random.default_rng(0).integers(0, 150_000, 5 * PS).tolist()
    root = TreeNode()
    root.key, root.hash_value = RadixKey(array("q")), []
    first = _node(root, tokens[:2 * PS])
    second = _node(first, tokens[2 * PS:])
    recorder = KVCacheEventRecorder(enabled=True, page_size=PS)
    recorder.record_store(first, medium=StorageMedium.CPU)
    recorder.record_store(second, medium=StorageMedium.CPU)
    recorder.record_remove(second, medium=StorageMedium.CPU)
    theirs = recorder.take()

    keys = sglang_page_keys(tokens, PS)
    log = EventLog(chains=ChainTable(1 << 20, PS))
    log.chains.note(keys[:2], b"", np.asarray(tokens[:2 * PS]))
    log.append(EventKind.STORED, keys[:2])
    log.chains.note(keys[2:], keys[1], np.asarray(tokens[2 * PS:]))
    log.append(EventKind.STORED, keys[2:])
    log.append(EventKind.REMOVED, keys[2:])
    ours = msgspec.msgpack.Decoder(type=KVEventBatch).decode(
        Encoder().batch(engine_events(log.after(0), PS))).events
    assert msgspec.to_builtins(ours) == msgspec.to_builtins(theirs)
    assert len(ours) == 2 and ours[0].block_hashes == [hash_str_to_int64(h) for h in
                                                         first.hash_value + second.hash_value]


def test_a_store_s_namespace_names_its_pages_in_events_and_snapshots() -> None:
    """Pages of one chain stored under two namespaces (a LoRA adapter's continuation of a
    prompt, a salted request's) are told apart: never merged into one event or one run, each
    named as its Store said, in the live events and in a snapshot of the pool."""
    keys = [bytes([i]) * 32 for i in range(6)]
    tokens = np.arange(6 * PS)
    lora, salted = Namespace("adapter-\u00e9", ""), Namespace("adapter-\u00e9", "salt-1")
    log = EventLog(chains=ChainTable(1 << 20, PS))
    log.chains.note(keys[:2], b"", tokens[:2 * PS])  # the base model's
    log.append(EventKind.STORED, keys[:2])
    log.chains.note(keys[2:4], keys[1], tokens[2 * PS:4 * PS], lora)
    log.append(EventKind.STORED, keys[2:4])
    log.chains.note(keys[4:], keys[3], tokens[4 * PS:], salted)
    log.append(EventKind.STORED, keys[4:])
    assert [e.namespace for e in log.after(0)] == [NO_NAMESPACE, lora, salted]
    ours = msgspec.msgpack.Decoder(type=KVEventBatch).decode(
        Encoder().batch(engine_events(log.after(0), PS))).events
    assert [(e.lora_name, e.cache_salt, len(e.block_hashes)) for e in ours] == [
        (None, None, 2), ("adapter-\u00e9", None, 2), ("adapter-\u00e9", "salt-1", 2)]
    assert ours[1].parent_block_hash == block_hash(keys[1])  # still one chain
    runs = log.chains.runs(keys, chain=False)
    assert [(r.keys, r.namespace) for r in runs] == [(keys[:2], NO_NAMESPACE),
                                                     (keys[2:4], lora), (keys[4:], salted)]
    snap = contents_events({HOST: keys}, PS, log.chains)
    assert [(e.lora_name, e.cache_salt, e.token_ids) for e in snap] == [
        (None, None, tokens[:2 * PS].tolist()), ("adapter-\u00e9", None,
                                                 tokens[2 * PS:4 * PS].tolist()),
        ("adapter-\u00e9", "salt-1", tokens[4 * PS:].tolist())]


def test_lookahead_tokens_are_told_per_block_in_events_spills_and_snapshots() -> None:
    """vLLM's lookahead block hashes: Stores that give the tokens after each page have them
    told, one list per block hash, in the live events (two Stores of one chain still one
    event, their lists joined), in a spill's event and in a snapshot, also for keys asked
    about one by one; a Store without them is never merged with one that has them, and its
    events leave the field out: SGLang's decoder (which has no such field) reads them all."""
    keys = [bytes([i]) * 32 for i in range(6)]
    tokens = np.arange(6 * PS)
    rows = [[100 + 2 * i, 101 + 2 * i] for i in range(6)]  # 2 tokens after each page
    ahead = np.asarray(rows, dtype="<i8")
    table = ChainTable(1 << 20, PS)
    log = EventLog(chains=table)
    table.note(keys[:2], b"", tokens[:2 * PS], NO_NAMESPACE, (2, ahead[:2].tobytes()))
    assert table.bytes_used == 2 * (ENTRY_OVERHEAD_BYTES + 32) + 2 * PS * 8 + 2 * 2 * 8
    log.append(EventKind.STORED, keys[:2])
    table.note(keys[2:4], keys[1], tokens[2 * PS:4 * PS], NO_NAMESPACE,
               (2, ahead[2:4].tobytes()))
    log.append(EventKind.STORED, keys[2:4])
    table.note(keys[4:], keys[3], tokens[4 * PS:])  # the same chain, no lookahead told
    log.append(EventKind.STORED, keys[4:])
    assert [e.lookahead_rows for e in log.after(0)] == [rows[:2], rows[2:4], None]
    payload = Encoder().batch(engine_events(log.after(0), PS))
    raw = msgspec.msgpack.decode(payload)[1]
    assert [e.get("lookahead_token_ids") for e in raw] == [rows[:4], None]
    assert "lookahead_token_ids" not in raw[1]  # left out, not nil
    assert [e["block_hashes"] for e in raw] == [block_hashes(keys[:4]), block_hashes(keys[4:])]
    sglang = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload).events
    assert [(e.block_hashes, e.token_ids) for e in sglang] == [
        (block_hashes(keys[:4]), tokens[:4 * PS].tolist()),
        (block_hashes(keys[4:]), tokens[4 * PS:].tolist())]
    # a spill's (keys one by one, not one Store's batch) and a snapshot's
    log.append(EventKind.STORED, keys[1:5], DISK, chain=False)
    assert [(e.keys, e.lookahead_rows) for e in log.after(3)] == [
        (tuple(keys[1:4]), rows[1:4]), ((keys[4],), None)]
    snap = contents_events({HOST: keys}, PS, table)
    assert [(e.block_hashes, e.lookahead_token_ids) for e in snap] == [
        (block_hashes(keys[:4]), rows[:4]), (block_hashes(keys[4:]), None)]
    assert [msgspec.msgpack.decode(Encoder().batch([e]))[1][0].get("lookahead_token_ids")
            for e in snap] == [rows[:4], None]


def test_the_chain_table_keeps_its_budget_and_the_batch_just_noted() -> None:
    batch = 4 * (ENTRY_OVERHEAD_BYTES + 32) + 32  # four keys and a parent
    table = ChainTable(2 * batch, PS)
    keys = [bytes([i]) * 32 for i in range(40)]
    for i in range(0, 40, 4):
        table.note(keys[i:i + 4], keys[i - 1] if i else b"")
        assert table.bytes_used <= table.max_bytes
    assert table.entries == 8 and table.parent_of(keys[39]) == keys[38]
    assert table.parent_of(keys[32]) == keys[31]  # the parent its Store named
    assert table.parent_of(keys[0]) == b"" and table.parent_of(keys[31]) == b""  # forgotten
    table.note([keys[37]], b"elsewhere")  # noted again: the newer Store's word counts
    assert table.parent_of(keys[37]) == b"elsewhere"
    table.note([keys[37]], keys[36])
    runs = table.runs([keys[0], keys[37], keys[38], keys[39]], chain=False)
    assert [(r.keys, r.parent) for r in runs] == [([keys[0]], b""),
                                                  ([keys[37], keys[38], keys[39]], keys[36])]
    tiny = ChainTable(0, PS)  # no budget: the batch itself still stays, for its own events
    tiny.note(keys[:3], b"p", np.arange(3 * PS))
    (run,) = tiny.runs(keys[:3])
    tokens = run.token_ids()
    assert run.parent == b"p" and tokens is not None and tokens.tolist() == list(range(3 * PS))
    tiny.note(keys[3:4])
    assert tiny.entries == 1


def test_a_chain_lives_as_long_as_its_key_in_the_pools_last_tier() -> None:
    """A key evicted or removed from the last tier loses its entry (and a batch with no key
    left its bytes); from a tier above the last one, it keeps it (the spill below needs it)."""
    table = ChainTable(1 << 30, PS)  # a budget that never binds: presence alone decides
    log = EventLog(chains=table)
    keys = [bytes([i]) * 32 for i in range(8)]
    table.note(keys[:4], b"root")
    table.note(keys[4:], keys[3])
    one_batch = 4 * (ENTRY_OVERHEAD_BYTES + 32)
    log.append(EventKind.EVICTED, keys[:2])  # host memory is the last tier by default
    assert table.entries == 6 and table.parent_of(keys[2]) == keys[1]
    assert table.parent_of(keys[0]) == b""
    log.append(EventKind.REMOVED, keys[2:4])
    assert table.entries == 4 and table.bytes_used == one_batch + len(keys[3])
    table.last_tier = DISK
    log.append(EventKind.EVICTED, keys[4:6])  # spilled: the disk's events still need it
    assert table.entries == 4 and table.parent_of(keys[4]) == keys[3]
    log.append(EventKind.EVICTED, keys[4:6], DISK)
    log.append(EventKind.REMOVED, keys[6:], DISK)
    assert table.entries == 0 and table.bytes_used == 0
    table.note(keys[:2], b"a")
    table.note(keys[:2], b"b")  # stored again: the newer batch has them, the older is gone
    assert table.bytes_used == 2 * (ENTRY_OVERHEAD_BYTES + 32) + 1
    assert table.parent_of(keys[0]) == b"b"


def test_a_host_only_pools_chain_table_stays_the_size_of_the_pool(pool: HostPool) -> None:
    """Stores of fresh keys into a full 64-page pool, as a busy engine makes them: the table
    holds the pool's keys and no others, however many were stored, and each Store's event
    still carries its chain."""
    cache = PoolCache(pool, EventLog(chains=ChainTable(1 << 30, PS)))
    table = cache.events.chains
    TierStack(pool, cache)  # no tier below: host memory is the last
    assert table.last_tier == HOST
    fresh = (os.urandom(32) for _ in itertools.count())
    parent = b""
    for i in range(300):
        keys = [next(fresh) for _ in range(8)]
        table.note(keys, parent, np.arange(8 * PS) + i)
        _store(cache, keys)
        parent = keys[-1]
        assert set(table._entries) <= set(cache.snapshot())
    assert table.entries == 64 and len(table._batches) <= 8 + 2 * 64 + 1
    assert table.bytes_used == 8 * (8 * (ENTRY_OVERHEAD_BYTES + 32) + 32 + 8 * PS * 8)
    last = [e for e in cache.events.after(0) if e.kind is EventKind.STORED][-1]
    assert last.keys[0] == keys[0] and last.parent == cache.events.chains.parent_of(keys[0])
    assert last.token_ids is not None and last.token_ids.tolist() == list(range(299, 299
                                                                                + 8 * PS))


def test_one_long_lived_key_does_not_keep_the_dead_batches_behind_it() -> None:
    table = ChainTable(1 << 30, PS)
    hot, cold = b"h" * 32, b"c" * 32
    table.note([cold, hot], b"root")
    table.forget([cold], HOST)
    for i in range(5000):
        key = i.to_bytes(32, "little")
        table.note([key], hot)
        table.forget([key], HOST)
    assert len(table._batches) <= 2 * 65 + 1 and table.entries == 1
    assert table.parent_of(hot) == cold and table.bytes_used == 2 * (ENTRY_OVERHEAD_BYTES
                                                                     + 32) + 4


def test_a_pool_with_a_disk_tier_keeps_chains_until_the_disk_lets_go(pool: HostPool,
                                                                      tmp_path: Path) -> None:
    cache = PoolCache(pool, EventLog(chains=ChainTable(1 << 30, PS)))
    disk = DiskTier(str(tmp_path), "p", {"spec": "p"}, pool.spec.page_bytes, 16)
    TierStack(pool, cache, disk)
    assert cache.events.chains.last_tier == DISK


@pytest.fixture
def pool() -> Iterator[HostPool]:
    p = make_pool(spec(mha(), page_size=PS, size_tokens=64 * PS))
    yield p
    p.close()


def _store(cache: PoolCache, keys: list[bytes]) -> None:
    ticket = cache.begin_store(keys)
    cache.finish_store(ticket, True)


def test_a_full_queue_drops_and_a_snapshot_makes_the_subscriber_whole(
        pool: HostPool, tmp_path: Path) -> None:
    """The publisher's thread is held while twenty Stores happen against a queue of four:
    sixteen events are dropped and counted, nothing waits; once let go, the thread publishes
    what it had and then a snapshot, after which the subscriber holds exactly the pool."""
    cache = PoolCache(pool, EventLog(chains=ChainTable(1 << 20, PS)))
    stack = TierStack(pool, cache)
    stack.start()
    pub = KvEventPublisher(KvEventsConfig(endpoint=f"ipc://{tmp_path}/kv.sock",
                                          replay_endpoint=f"ipc://{tmp_path}/r.sock",
                                          max_queue_size=4))
    pub.start()
    f = Follower(pub.endpoint, pub.replay_endpoint)
    try:
        time.sleep(0.2)
        pub.attached("p", stack)
        f.until(lambda: f.last >= 0 or bool(f.sync()))
        keys = [os.urandom(32) for _ in range(20)]
        with seams.Pause("kv_events.turn") as held:
            assert held.wait_reached(5)
            t0 = time.perf_counter()
            for k in keys:
                _store(cache, [k])
            assert time.perf_counter() - t0 < 1.0  # never waited for the stalled thread
            assert pub.stats().dropped == 16 and pub.stats().queued == 4
        f.until(lambda: f.held("p", "CPU_PINNED") == {block_hash(k) for k in keys})
        st = pub.stats()
        assert st.resyncs == 1 and st.dropped == 16
        names = [type(e).__name__ for _, _, e in f.events]
        assert names.count("AllBlocksCleared") == 2  # the start's and the snapshot's
        assert f.gaps == 0
    finally:
        f.close()
        pub.close()
        stack.close()


def test_endpoints_are_loopback_or_ipc_unless_allowed() -> None:
    ok = [("tcp://127.0.0.1:5557", False), ("tcp://[::1]:5557", False),
          ("tcp://localhost:1", False), ("ipc:///run/hicached/kv.sock", False),
          ("tcp://*:5557", True), ("tcp://0.0.0.0:5557", True)]
    for endpoint, remote in ok:
        assert KvEventsConfig(endpoint=endpoint, allow_remote=remote).enabled
    bad = [{"endpoint": "tcp://*:5557"}, {"endpoint": "tcp://0.0.0.0:5557"},
           {"endpoint": "tcp://10.1.2.3:5557"}, {"endpoint": "inproc://kv"},
           {"endpoint": "ipc://relative.sock"}, {"endpoint": "tcp://127.0.0.1"},
           {"replay_endpoint": "tcp://127.0.0.1:1"},
           {"endpoint": "tcp://127.0.0.1:1", "replay_endpoint": "tcp://127.0.0.1:1"},
           {"endpoint": "tcp://127.0.0.1:1", "format": "vllm"},
           {"endpoint": "tcp://127.0.0.1:1", "buffer_steps": 0}]
    for kwargs in bad:
        with pytest.raises(HiCacheError) as exc:
            KvEventsConfig(**kwargs)  # type: ignore[arg-type]
        assert exc.value.reason == "SPEC_INVALID", kwargs
    for table in ({"endpoint": "tcp://127.0.0.1:1", "hwm": "many"}, {"nope": 1},
                  {"endpoint": "tcp://127.0.0.1:1", "allow_remote": "perhaps"}):
        with pytest.raises(HiCacheError) as exc:
            KvEventsConfig.from_mapping(table, parse_size)
        assert exc.value.reason == "SPEC_INVALID", table


def test_a_file_planted_where_the_socket_goes_refuses_the_start(tmp_path: Path) -> None:
    planted = tmp_path / "kv.sock"
    planted.write_text("not ours to remove")
    pub = KvEventPublisher(KvEventsConfig(endpoint=f"ipc://{planted}"))
    with pytest.raises(UntrustedPath):
        pub.start()
    pub.close()
    assert planted.read_text() == "not ours to remove"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone may write there (and it is not sticky)
    pub = KvEventPublisher(KvEventsConfig(endpoint=f"ipc://{shared}/kv.sock"))
    with pytest.raises(UntrustedPath):
        pub.start()
    pub.close()


def test_pool_endpoints_are_ipc_templates_and_a_long_name_gets_a_digest() -> None:
    c = KvEventsConfig(pool_endpoint="ipc:///run/h/ev/{pool}",
                       pool_replay_endpoint="ipc:///run/h/ev/{pool}.replay")
    assert c.enabled and not c.endpoint  # a pool's own streams without the node's
    assert c.pool_endpoints("llama-tp0of2") == ("ipc:///run/h/ev/llama-tp0of2",
                                                "ipc:///run/h/ev/llama-tp0of2.replay")
    long = "vllm-" + "x" * 120
    ep, replay = c.pool_endpoints(long)
    digest = hashlib.sha256(long.encode()).hexdigest()[:16]
    assert ep == f"ipc:///run/h/ev/pool-{digest}" and replay == f"{ep}.replay"
    assert c.pool_endpoints(long) == (ep, replay)  # the same after a restart
    assert KvEventsConfig().pool_endpoints("p") == ("", "")
    bad = [{"pool_endpoint": "ipc:///run/h/ev/fixed"},  # one socket for every pool
           {"pool_endpoint": "tcp://127.0.0.1:{pool}"}, {"pool_endpoint": "ipc://rel/{pool}"},
           {"pool_replay_endpoint": "ipc:///run/h/{pool}.r"},
           {"pool_endpoint": "ipc:///run/h/{pool}", "pool_replay_endpoint": "ipc:///run/h/{pool}"},
           {"pool_endpoint": "ipc:///" + "d" * 120 + "/{pool}"},
           {"pool_endpoint": "tcp://127.0.0.1:5600"},  # one port for every pool
           {"pool_endpoint": "tcp://0.0.0.0:*"},  # every host: only with allow_remote
           {"pool_endpoint": "ipc:///run/h/{pool}", "pool_replay_endpoint": "tcp://10.1.2.3:*"}]
    for kwargs in bad:
        with pytest.raises(HiCacheError) as exc:
            KvEventsConfig(**kwargs)  # type: ignore[arg-type]
        assert exc.value.reason == "SPEC_INVALID", kwargs


def test_pool_streams_on_tcp_take_a_port_each_and_getpool_says_which(
        pool: HostPool) -> None:
    """``tcp://HOST:*``: each pool's stream and replay socket on a port the system picks
    (IPv4 and IPv6 loopback), told once bound (nothing before: a port not yet known is not
    guessed); a subscriber gets the join snapshot there, a replay is answered there."""
    assert KvEventsConfig(pool_endpoint="tcp://0.0.0.0:*", allow_remote=True).enabled
    assert KvEventsConfig(pool_endpoint="tcp://127.0.0.1:*").pool_endpoints("p") == (
        "tcp://127.0.0.1:*", "")
    cache = PoolCache(pool, EventLog(chains=ChainTable(1 << 20, PS)))
    stack = TierStack(pool, cache)
    stack.start()
    key = os.urandom(32)
    _store(cache, [key])
    for host in ("127.0.0.1", "[::1]"):
        pub = KvEventPublisher(KvEventsConfig(pool_endpoint=f"tcp://{host}:*",
                                              pool_replay_endpoint=f"tcp://{host}:*"))
        pub.start()
        ctx = zmq.Context()
        try:
            pub.attached("p", stack)
            deadline = time.monotonic() + 5
            while not pub.pool_endpoints("p")[0] and time.monotonic() < deadline:
                time.sleep(0.01)
            endpoint, replay = pub.pool_endpoints("p")
            assert endpoint.startswith(f"tcp://{host}:") and replay.startswith(f"tcp://{host}:")
            assert endpoint != replay and not endpoint.endswith(":*")
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.IPV6, 1)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            stored: list[int] = []
            deadline = time.monotonic() + 5
            while not stored and time.monotonic() < deadline:
                if sub.poll(100):
                    batch = msgspec.msgpack.decode(sub.recv_multipart()[2])
                    stored += [h for e in batch[1] if e.get("type") == "BlockStored"
                               for h in e["block_hashes"]]
            assert stored == [block_hash(key)]  # the snapshot its joining earned
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.IPV6, 1)
            dealer.connect(replay)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            assert dealer.poll(5000)
            assert len(dealer.recv_multipart()) == 3  # ["", seq, payload], SGLang's frames
        finally:
            ctx.destroy(linger=0)
            pub.close()
    stack.close()


def test_a_file_planted_where_a_pools_stream_goes_leaves_that_pool_without_one(
        pool: HostPool, tmp_path: Path) -> None:
    """A pool whose socket path holds a file the daemon did not make gets no stream of its
    own (``GetPool`` names none, the file stays); the pool and the node's stream serve on."""
    (tmp_path / "ev").mkdir(mode=0o700)
    planted = tmp_path / "ev" / "p"
    planted.write_text("not ours to remove")
    cache = PoolCache(pool, EventLog(chains=ChainTable(1 << 20, PS)))
    stack = TierStack(pool, cache)
    stack.start()
    pub = KvEventPublisher(KvEventsConfig(endpoint=f"ipc://{tmp_path}/kv.sock",
                                          replay_endpoint=f"ipc://{tmp_path}/r.sock",
                                          pool_endpoint=f"ipc://{tmp_path}/ev/{{pool}}"))
    pub.start()
    f = Follower(pub.endpoint, pub.replay_endpoint)
    try:
        time.sleep(0.2)
        pub.attached("p", stack)
        deadline = time.monotonic() + 5
        while pub.pool_endpoints("p") != ("", "") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pub.pool_endpoints("p") == ("", "") and pub.stats().pool_streams == 0
        assert planted.read_text() == "not ours to remove"
        key = os.urandom(32)
        _store(cache, [key])
        f.until(lambda: f.held("p", "CPU_PINNED") == {block_hash(key)})
    finally:
        f.close()
        pub.close()
        stack.close()


def test_the_kv_events_table_and_flags_make_the_config() -> None:
    from hicached.__main__ import main as hicached_main
    from hicached.server.config import config_from_mapping

    c = config_from_mapping({"kv_events": {"endpoint": "ipc:///run/h/kv.sock", "topic": "h.",
                                           "chain_bytes": "1MiB", "buffer_steps": 5}})
    assert c.kv_events.enabled and c.kv_events.chain_bytes == 1 << 20
    assert c.kv_events.buffer_steps == 5 and c.kv_events.topic == "h."
    assert not config_from_mapping({}).kv_events.enabled  # off by default
    with pytest.raises(HiCacheError):
        config_from_mapping({"kv_events": {"endpoint": "tcp://*:5557"}})
    # a refused endpoint stops the daemon before it starts, with a clear line
    assert hicached_main(["serve", "--kv-events-endpoint", "tcp://0.0.0.0:5557"]) == 2


def test_a_clear_of_many_keys_is_many_bounded_messages() -> None:
    """A ClearPool of 100,000 keys and a Store of 10,000 become events of at most 4,096 blocks
    and messages of at most 16,384 blocks that still decode as one chain."""
    from hicached.publish.kv_event_format import (
        MAX_BLOCKS,
        MESSAGE_BLOCKS,
        BlockRemoved,
        BlockStored,
        messages,
    )

    log = EventLog(chains=ChainTable(1 << 30, PS))
    keys = [i.to_bytes(8, "big") + b"k" * 24 for i in range(100_000)]
    log.append(EventKind.STORED, keys[:10_000])
    log.append(EventKind.REMOVED, keys)
    events = engine_events(log.after(0), PS)
    named = [e for e in events if isinstance(e, BlockStored | BlockRemoved)]
    assert len(named) == len(events) and all(len(e.block_hashes) <= MAX_BLOCKS for e in named)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) == 10_000
    for prev, nxt in itertools.pairwise(stored):  # the chain goes on across events
        assert nxt.parent_block_hash == prev.block_hashes[-1]
    batches = messages(events)
    assert all(sum(len(e.block_hashes) for e in b if isinstance(e, BlockStored | BlockRemoved))
               <= MESSAGE_BLOCKS for b in batches)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    removed = [h for b in batches for e in decoder.decode(Encoder().batch(b)).events
               if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]
    assert removed == [block_hash(k) for k in keys]
