"""Pool state files: what a restarted daemon finds, checked at every instant a crash can hit.

A "crash" here is a second ``HostPool`` + ``PoolCache`` opened over the same files while the
first is left exactly as it was (a killed process leaves its shared mappings' bytes behind, and
nothing else): no close, no flush. A model-based test drives stores (complete or left in
flight), removals, raw pages with and without owners and frees, and crashes at random points,
against a small reference model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hicache.errors import KeyNotFound
from hicache.specs import (
    CanarySpec,
    DType,
    KeyFormat,
    KVGeometry,
    Layout,
    MemberSpec,
    PoolKind,
    PoolSpec,
)
from hicached.cache import key_slots
from hicached.core.state_file import Outcome, StateFiles, spec_from_dict, spec_to_dict
from tests.state_pools import PS, SPEC, open_pool, page_bytes, pattern, store, write_page


@pytest.fixture
def state() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hicache-st-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("spec", [
    SPEC,
    PoolSpec("mla", KVGeometry(PoolKind.MLA, DType.FLOAT16, 3, kv_lora_rank=16,
                               qk_rope_head_dim=8), 8, Layout.PAGE_FIRST, size_bytes=1 << 16,
             side_pools=(MemberSpec("idx", KVGeometry(PoolKind.DSA_INDEXER, DType.UINT8, 3,
                                                      index_head_dim=32,
                                                      quant_block_size=32)),),
             canary=CanarySpec(16)),
    PoolSpec("rows", KVGeometry(PoolKind.OPAQUE, DType.UINT8, 4, row_bytes=96), 16,
             Layout.PAGE_FIRST_DIRECT, size_tokens=256, key_format=KeyFormat.VLLM),
])
def test_specs_round_trip_through_the_header(spec: PoolSpec) -> None:
    assert spec_from_dict(spec_to_dict(spec)) == spec


def test_a_header_names_a_later_field_only_where_it_is_set() -> None:
    """A daemon from before ``row_bytes`` reads the header of every pool that does not use
    it: the field is written only when set."""
    d = spec_to_dict(SPEC)
    assert "row_bytes" not in d["geometry"] and "row_bytes" not in json.dumps(d)
    assert spec_from_dict(d) == SPEC
    rows = PoolSpec("rows", KVGeometry(PoolKind.OPAQUE, DType.UINT8, 2, row_bytes=8), 4,
                    size_tokens=16)
    assert spec_to_dict(rows)["geometry"]["row_bytes"] == 8
    assert "key_format" not in d  # likewise key_format, written only when not DIGEST
    vllm = dataclasses.replace(rows, key_format=KeyFormat.VLLM)
    assert spec_to_dict(vllm)["key_format"] == "vllm"
    assert spec_from_dict(spec_to_dict(vllm)) == vllm


def test_a_crash_keeps_complete_keys_and_drops_everything_unfinished(state: str) -> None:
    pool, cache = open_pool(state)
    assert pool.outcome is Outcome.CREATED
    done = {store(pool, cache, b"done-%d" % i, i): i for i in range(3)}
    inflight = store(pool, cache, b"inflight", 9, finish=False)
    store(pool, cache, b"removed", 8)
    cache.remove([b"removed"])
    unowned = pool.allocator.alloc(2 * PS, owner=0)
    owned = pool.allocator.alloc(PS, owner=42)
    held = cache.begin_load([b"done-0"])  # a load in flight at the crash
    # crash: nothing of the first daemon runs any more; a second one opens the same files
    pool2, cache2 = open_pool(state)
    assert pool2.outcome is Outcome.REATTACHED and pool2.state is not None
    assert pool2.state.generation == 2
    assert cache2.lookup([b"done-0", b"done-1", b"done-2"])[0] == 3
    assert cache2.lookup([b"inflight"])[1] == b"\0" and cache2.lookup([b"removed"])[1] == b"\0"
    for page, i in done.items():
        got = cache2.begin_load([b"done-%d" % i])
        assert int(got[0]) == page and page_bytes(pool2, page) == pattern(pool2, i)
        cache2.finish_load(got)
    counts = pool2.allocator.counts()
    assert counts == {"raw": 2, "keyed": 3, "busy": 0, "releasing": 0,
                      "free": pool2.page_num - 5, "parked": 0, "used": 5}
    assert pool2.allocator.is_allocated(np.unique(unowned // PS)).all()
    assert not pool2.allocator.is_allocated(owned[:1] // PS).any()  # its session died
    assert not pool2.allocator.is_keyed(np.array([inflight])).any()  # its page is free again
    pool2.allocator.memcheck()
    assert held.size == 1


CRASHING_CHILD = """
import os, signal, sys
from tests.state_pools import open_pool, store
pool, cache = open_pool(sys.argv[1])
for i in range(3):
    store(pool, cache, b"done-%d" % i, 10 + i)
store(pool, cache, b"inflight", 99, finish=False)
print("stored", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no close, no flush: what a killed daemon leaves
"""


def test_a_pool_killed_in_another_process_reattaches_with_its_bytes(state: str) -> None:
    """The first daemon is another process, SIGKILLed: this one reads what it left, and
    compares with the pattern written (not with a mapping of the same file)."""
    import signal
    import subprocess
    import sys

    from tests.daemon_proc import REPO

    r = subprocess.run([sys.executable, "-c", CRASHING_CHILD, state], cwd=REPO, text=True,
                       capture_output=True, timeout=120)
    assert r.returncode == -signal.SIGKILL and "stored" in r.stdout, r.stderr
    pool, cache = open_pool(state)
    assert pool.outcome is Outcome.REATTACHED
    assert cache.lookup([b"inflight"])[1] == b"\0"
    for i in range(3):
        got = cache.begin_load([b"done-%d" % i])
        assert page_bytes(pool, int(got[0])) == pattern(pool, 10 + i), f"done-{i} changed"
        cache.finish_load(got)
    pool.allocator.memcheck()


def test_a_damaged_slot_is_dropped_not_served(state: str) -> None:
    pool, cache = open_pool(state)
    pages = [store(pool, cache, b"key-%d" % i, i) for i in range(4)]
    assert pool.state is not None
    slots = pool.state.table("key_slots")
    slots["key"][pages[1], 0] ^= 0xFF  # a stray write into the table
    slots["state"][pages[2]] = key_slots.READY  # already ready: untouched
    slots["crc"][pages[3]] ^= 1
    pool2, cache2 = open_pool(state)
    found = cache2.lookup([b"key-0", b"key-1", b"key-2", b"key-3"])[1]
    assert found == b"\1\0\1\0"
    assert cache2.recovered_keys == 2
    pool2.allocator.memcheck()


def test_a_slot_half_written_at_the_crash_is_not_ready(state: str) -> None:
    pool, cache = open_pool(state)
    t = cache.begin_store([b"half"])
    write_page(pool, int(t.pages[0]), 5)
    # the crash lands inside KeySlots.ready: key, length, sequence and crc written, not state
    slots = pool.state.table("key_slots") if pool.state else None
    assert slots is not None
    page = int(t.pages[0])
    slots["key"][page, :4] = np.frombuffer(b"half", np.uint8)
    slots["key_len"][page] = 4
    slots["crc"][page] = key_slots._crc(page, b"half", 1)
    _, cache2 = open_pool(state)
    with pytest.raises(KeyNotFound):
        cache2.begin_load([b"half"])


@pytest.mark.parametrize("change", ["version", "spec", "data", "header"])
def test_unusable_state_starts_cold(state: str, change: str) -> None:
    pool, cache = open_pool(state)
    store(pool, cache, b"k", 1)
    meta, data = Path(state) / "st.meta", Path(state) / "st.data"
    spec = SPEC
    if change == "version":
        with open(meta, "r+b") as f:
            f.seek(8)
            f.write((7).to_bytes(4, "little"))
    elif change == "spec":
        spec = PoolSpec("st", SPEC.geometry, PS, size_tokens=PS * 32)
    elif change == "data":
        os.truncate(data, 1000)
    else:
        with open(meta, "r+b") as f:
            f.seek(70)
            f.write(b"X")
    pool2, cache2 = open_pool(state, spec)
    want = {"version": Outcome.COLD_VERSION, "spec": Outcome.COLD_MISMATCH,
            "data": Outcome.COLD_CORRUPT, "header": Outcome.COLD_CORRUPT}[change]
    assert pool2.outcome is want
    assert cache2.key_count == 0 and pool2.allocator.counts()["free"] == pool2.page_num
    assert os.path.getsize(data) == pool2.nbytes


def test_delete_removes_the_files_and_close_keeps_them(state: str) -> None:
    pool, _ = open_pool(state)
    pool.close()
    assert sorted(os.listdir(state)) == ["st.data", "st.meta"]
    pool2, _ = open_pool(state)
    assert pool2.outcome is Outcome.REATTACHED
    pool2.close(remove_state=True)
    assert os.listdir(state) == []


def test_state_files_refuse_a_relative_mismatch_of_tables(state: str) -> None:
    files = StateFiles(state, SPEC, 4096, [key_slots.table_spec(16)])
    assert files.open() is Outcome.CREATED
    files.close()
    other = StateFiles(state, SPEC, 4096, [key_slots.table_spec(32)])
    assert other.open() is Outcome.COLD_MISMATCH


class CrashModel(RuleBasedStateMachine):
    """Stores, removals, raw pages and frees, with crashes anywhere in between."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="hicache-stm-", dir="/dev/shm")
        self.pool, self.cache = open_pool(self.dir)
        self.ready: dict[bytes, int] = {}  # key -> tag of its bytes
        self.raw: dict[int, int] = {}  # first page -> owner
        self.n = 0

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(finish=st.booleans())
    def store(self, finish: bool) -> None:
        if self.pool.allocator.free_pages == 0 and not self.ready:
            return
        self.n += 1
        key = b"m-%d" % self.n
        t = self.cache.begin_store([key])
        if not t.pages.size:
            return
        write_page(self.pool, int(t.pages[0]), self.n)
        evicted = set(self.ready) - set(k for k in self.ready
                                         if self.cache.lookup([k])[1] == b"\1")
        for k in evicted:
            del self.ready[k]
        if finish:
            self.cache.finish_store(t, ok=True)
            self.ready[key] = self.n

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        if self.ready:
            key = data.draw(st.sampled_from(sorted(self.ready)))
            self.cache.remove([key])
            del self.ready[key]

    @rule(owner=st.sampled_from([0, 7]))
    def alloc_raw(self, owner: int) -> None:
        if self.pool.allocator.free_pages:
            self.raw[int(self.pool.allocator.alloc(PS, owner)[0]) // PS] = owner

    @rule(data=st.data())
    def free_raw(self, data: st.DataObject) -> None:
        if self.raw:
            page = data.draw(st.sampled_from(sorted(self.raw)))
            self.pool.allocator.free(np.arange(page * PS, (page + 1) * PS))
            del self.raw[page]

    @rule()
    def crash(self) -> None:
        self.pool, self.cache = open_pool(self.dir)
        self.raw = {p: o for p, o in self.raw.items() if o == 0}

    @invariant()
    def matches_the_model(self) -> None:
        self.pool.allocator.memcheck()
        keys = sorted(self.ready)
        if keys:
            assert self.cache.lookup(keys)[0] == len(keys)
            pages = self.cache.begin_load(keys)
            for key, page in zip(keys, pages.tolist(), strict=True):
                assert page_bytes(self.pool, page) == pattern(self.pool, self.ready[key])
            self.cache.finish_load(pages)
        counts = self.pool.allocator.counts()
        assert counts["raw"] == len(self.raw)


TestCrashModel = CrashModel.TestCase


def test_canary_fingerprints_survive_and_catch_a_changed_page(state: str) -> None:
    from hicache.errors import CanaryMismatch

    spec = PoolSpec("cn", SPEC.geometry, PS, size_tokens=PS * 16, canary=CanarySpec(16))
    pool, cache = open_pool(state, spec)
    pages = np.array([store(pool, cache, b"c%d" % i, i) for i in range(3)], dtype=np.int64)
    layers = range(0, spec.max_layers)
    assert pool.canary is not None
    pool.canary.record(pages, layers, pool.fingerprints(pages, layers))
    pool2, _ = open_pool(state, spec)  # crash, re-attach
    assert pool2.canary is not None
    pool2.canary.verify(pages, layers, pool2.fingerprints(pages, layers))  # unchanged: fine
    pool2.raw_bytes()[pool2.page_segments(int(pages[1]))[0][0]] ^= 0xFF  # the memory rots
    with pytest.raises(CanaryMismatch) as err:
        pool2.canary.verify(pages, layers, pool2.fingerprints(pages, layers))
    assert err.value.metadata["first_page"] == str(int(pages[1]))
