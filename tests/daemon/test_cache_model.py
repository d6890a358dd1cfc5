"""Model-based test of the cache through a real daemon (in-process gRPC server, shm buffers).

Random Store / LoadKeys / Lookup / RemoveKeys / ClearPool / holds / raw Alloc, Backup, Load,
Free / owner-session ends on a six-page pool, against a small reference: a dict of ready keys,
the LRU order of the evictable ones, holds, raw pages. Every load is checked byte for byte into
device pages zeroed first; Lookup must equal the model; nothing held is evicted; no raw page is
ever evicted or changed; the allocator's invariants hold after every step.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache.errors import HiCacheError
from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers, WorkerSession
from hicached.server.app import HiCacheServer, create_server
from hicached.server.config import ServerConfig

PS, PAGES, DEV_PAGES = 2, 6, 12
GEOMETRY = KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 2, 4)
UNIVERSE = [b"key-%d" % i for i in range(10)]
STORED, PRESENT, NO_SPACE = 1, 2, 3
_names = itertools.count()


class Env:
    server: HiCacheServer
    client: HiCacheClient
    bufs: ShmDeviceBuffers


ENV = Env()


@pytest.fixture(scope="module", autouse=True)
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp: Path = tmp_path_factory.mktemp("cache-model")
    (tmp / "shm").mkdir()
    ENV.server, bound = create_server(ServerConfig(
        listen=(f"unix:{tmp}/s.sock",), shm_dir=str(tmp / "shm"), metrics_listen="",
        state_dir="",
        memory_budget_bytes=64 << 20, reserve_bytes=0, lease_seconds=600,
        eviction="lru"))  # the model's order (the reuse policy's: test_reuse_lru.py)
    ENV.client = HiCacheClient(bound[0])
    spec = PoolSpec("shape", GEOMETRY, PS, size_tokens=PAGES * PS)
    ENV.bufs = ShmDeviceBuffers.create(spec, DEV_PAGES * PS, str(tmp / "shm"))
    yield ENV
    ENV.bufs.close()
    ENV.client.close()
    ENV.server.drain_and_stop(1.0)


def rows(page: int) -> slice:
    return slice(page * PS, (page + 1) * PS)


def pattern(seed: int, tensor: int, shape: torch.Size) -> torch.Tensor:
    rng = np.random.default_rng(seed * 7 + tensor)
    return torch.from_numpy(rng.integers(0, 256, size=tuple(shape), dtype=np.uint8))


def key_seed(key: bytes) -> int:
    return zlib.crc32(key)


def fill(page: int, seed: int) -> None:
    for i, t in enumerate(ENV.bufs.all_tensors()):
        r = t.view(torch.uint8)[rows(page)]
        r.copy_(pattern(seed, i, r.shape))


def holds(page: int, seed: int) -> bool:
    return all(torch.equal(t.view(torch.uint8)[rows(page)],
                           pattern(seed, i, t.view(torch.uint8)[rows(page)].shape))
               for i, t in enumerate(ENV.bufs.all_tensors()))


def zero(page: int) -> None:
    for t in ENV.bufs.all_tensors():
        t.view(torch.uint8)[rows(page)].zero_()


def is_zero(page: int) -> bool:
    return all(not t.view(torch.uint8)[rows(page)].any() for t in ENV.bufs.all_tensors())


def dev_indices(pages: list[int]) -> torch.Tensor:
    return (torch.tensor(pages)[:, None] * PS + torch.arange(PS)).reshape(-1)


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = f"model-{next(_names)}"
        c = ENV.client
        c.create_pool(PoolSpec(self.pool, GEOMETRY, PS, size_tokens=PAGES * PS))
        self.cache = ENV.server.daemon.pools.cache(self.pool)
        self.worker: WorkerSession = c.open_session(self.pool, "worker", ENV.bufs.descriptors,
                                                    heartbeat=False)
        self.owner: WorkerSession = c.open_session(self.pool, "owner", ENV.bufs.descriptors,
                                                   heartbeat=False)
        # the model
        self.ready: dict[bytes, int] = {}        # key -> incarnation
        self.lru: list[bytes] = []               # evictable keys, least recently used first
        self.loads: dict[tuple[bytes, int], int] = {}
        self.held: list[tuple[np.ndarray, tuple[bytes, int]]] = []
        self.raw: list[tuple[torch.Tensor, bool, int]] = []  # (host indices, owned, seed)
        self.evicted = 0
        self.incarnations = itertools.count(1)

    # -- model helpers ---------------------------------------------------------------------

    def zombies(self) -> int:
        """Pages of keys that are gone but still held by a copy."""
        return sum(1 for (k, inc), n in self.loads.items()
                   if n and self.ready.get(k) != inc)

    def free(self) -> int:
        raw = sum(h.numel() // PS for h, _, _ in self.raw)
        return PAGES - len(self.ready) - raw - self.zombies()

    def evict(self, n: int) -> None:
        for k in self.lru[:n]:
            del self.ready[k]
        self.evicted += len(self.lru[:n])
        del self.lru[:n]

    def drop(self, key: bytes) -> None:
        if key in self.ready:
            del self.ready[key]
            if key in self.lru:
                self.lru.remove(key)

    # -- the cache -------------------------------------------------------------------------

    @rule(data=st.data(), keys=st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=4,
                                        unique=True))
    def store(self, data: st.DataObject, keys: list[bytes]) -> None:
        pages = data.draw(st.permutations(range(DEV_PAGES)))[:len(keys)]
        for k, p in zip(keys, pages, strict=True):
            fill(p, key_seed(k))
        expect, new = [], []
        for k in keys:
            if k in self.ready:
                expect.append(PRESENT)
                if k in self.lru:
                    self.lru.remove(k)
                    self.lru.append(k)
            else:
                expect.append(0)
                new.append(k)
        short = len(new) - self.free()
        if short > 0:
            self.evict(short)
        grant = min(len(new), self.free())
        for k in new[:grant]:
            self.ready[k] = next(self.incarnations)
            self.lru.append(k)
        status = [STORED if s == 0 and k in new[:grant] else NO_SPACE if s == 0 else s
                  for s, k in zip(expect, keys, strict=True)]
        r = self.worker.store(keys, dev_indices(pages))
        assert list(r.status) == status
        assert (r.stored, r.already_present, r.no_space) == (
            status.count(STORED), status.count(PRESENT), status.count(NO_SPACE))

    @rule(key=st.sampled_from(UNIVERSE))
    def duplicate_store_changes_nothing(self, key: bytes) -> None:
        before = ENV.client.get_pool(self.pool)
        with pytest.raises(HiCacheError) as exc:
            self.worker.store([key, b"other", key], dev_indices([0, 1, 2]))
        assert exc.value.reason == "DUPLICATE_KEY"
        assert ENV.client.get_pool(self.pool) == before

    @rule(data=st.data(), keys=st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=3))
    def load(self, data: st.DataObject, keys: list[bytes]) -> None:
        pages = data.draw(st.permutations(range(DEV_PAGES)))[:len(keys)]
        for p in pages:
            zero(p)
        missing = [i for i, k in enumerate(keys) if k not in self.ready]
        if missing:
            with pytest.raises(HiCacheError) as exc:
                self.worker.load_keys(keys, dev_indices(pages))
            assert exc.value.reason == "KEY_NOT_FOUND"
            assert exc.value.metadata["first_missing_position"] == str(missing[0])
            assert all(is_zero(p) for p in pages), "a refused load moved bytes"
            return
        r = self.worker.load_keys(keys, dev_indices(pages))
        assert r.pages == len(keys)
        for k, p in zip(keys, pages, strict=True):
            assert holds(p, key_seed(k)), f"page of {k!r} is not what was stored"
        # held for the copy, then evictable again as the most recently used, in the order of
        # each key's last place in the batch (a key a hold keeps stays unevictable)
        last = {k: i for i, k in enumerate(keys)}
        for k in sorted(last, key=last.__getitem__):
            if self.loads.get((k, self.ready[k]), 0) == 0:
                self.lru.remove(k)
                self.lru.append(k)

    @rule(keys=st.lists(st.sampled_from(UNIVERSE), max_size=5))
    def lookup(self, keys: list[bytes]) -> None:
        r = ENV.client.lookup(self.pool, keys)
        tiers = bytes(1 if k in self.ready else 0 for k in keys)
        assert r.tiers == tiers
        assert r.hit_prefix == (len(keys) if 0 not in tiers else tiers.index(0))

    @rule(keys=st.lists(st.sampled_from(UNIVERSE), max_size=4))
    def remove(self, keys: list[bytes]) -> None:
        present = {k for k in keys if k in self.ready}
        assert ENV.client.remove_keys(self.pool, keys) == len(present)
        for k in present:
            self.drop(k)

    @rule()
    def clear(self) -> None:
        assert ENV.client.clear_pool(self.pool) == len(self.ready)
        for k in list(self.ready):
            self.drop(k)

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def hold(self, data: st.DataObject) -> None:
        """A copy in flight on a key (taken in-process, between RPCs)."""
        key = data.draw(st.sampled_from(sorted(self.ready)))
        tag = (key, self.ready[key])
        self.held.append((self.cache.begin_load([key]), tag))
        self.loads[tag] = self.loads.get(tag, 0) + 1
        if key in self.lru:
            self.lru.remove(key)

    @precondition(lambda self: self.held)
    @rule()
    def release(self) -> None:
        pages, tag = self.held.pop(0)
        self.cache.finish_load(pages)
        self.loads[tag] -= 1
        if not self.loads[tag]:
            del self.loads[tag]
            if self.ready.get(tag[0]) == tag[1]:
                self.lru.append(tag[0])

    # -- raw pages -------------------------------------------------------------------------

    @rule(n=st.integers(1, 3), owned=st.booleans(), seed=st.integers(0, 1 << 20))
    def alloc_raw(self, n: int, owned: bool, seed: int) -> None:
        session = self.owner.session_id if owned else ""
        if n > self.free() + len(self.lru):
            with pytest.raises(HiCacheError) as exc:
                ENV.client.alloc(self.pool, n * PS, session_id=session)
            assert exc.value.reason == "POOL_EXHAUSTED"
            return
        self.evict(max(n - self.free(), 0))
        host = ENV.client.alloc(self.pool, n * PS, session_id=session)
        pages = list(range(n))
        with pytest.raises(HiCacheError) as exc:  # never written: nothing to load
            self.worker.load(host, dev_indices(pages))
        assert exc.value.reason == "PAGE_NOT_WRITTEN"
        for p in pages:
            fill(p, seed + p)
        self.worker.backup(host, dev_indices(pages))
        self.raw.append((host, owned, seed))

    @precondition(lambda self: self.raw)
    @rule(i=st.integers(0, 10))
    def raw_pages_keep_their_bytes(self, i: int) -> None:
        host, _, seed = self.raw[i % len(self.raw)]
        pages = list(range(host.numel() // PS))
        for p in pages:
            zero(p)
        self.worker.load(host, dev_indices(pages))
        assert all(holds(p, seed + p) for p in pages), "a raw page changed"

    @precondition(lambda self: self.raw)
    @rule(i=st.integers(0, 10))
    def free_raw(self, i: int) -> None:
        host, _, _ = self.raw.pop(i % len(self.raw))
        assert ENV.client.free(self.pool, host) == host.numel() // PS

    @rule()
    def owner_session_ends(self) -> None:
        self.owner.close()
        self.raw = [r for r in self.raw if not r[1]]
        self.owner = ENV.client.open_session(self.pool, "owner", ENV.bufs.descriptors,
                                             heartbeat=False)

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def pool_matches_the_model(self) -> None:
        info = ENV.client.get_pool(self.pool)
        raw = sum(h.numel() // PS for h, _, _ in self.raw)
        assert (info.keys, info.raw_pages, info.free_pages) == (len(self.ready), raw,
                                                                self.free())
        assert info.keyed_pages == len(self.ready)  # a gone key held by a copy is not keyed
        assert self.cache.stats.evicted == self.evicted
        ENV.server.daemon.pools.get(self.pool).allocator.memcheck()

    def teardown(self) -> None:
        for pages, _ in self.held:
            self.cache.finish_load(pages)
        self.worker.close()
        self.owner.close()
        ENV.client.delete_pool(self.pool)


CacheMachine.TestCase.settings = settings(CacheMachine.TestCase.settings,
                                          stateful_step_count=30)
TestCacheMachine = CacheMachine.TestCase
