"""``ReplicaReader``'s choices, against a store and engine that answer as Mooncake's bindings
do (replica descriptors, one sync read per endpoint): which keys it retries, which replicas it
tries in what order, what it avoids afterwards, and that it stops at the deadline. The real
fallback, through a real master and a dead node's segment, is
``test_mooncake_node_death.py``."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from hicached.tiers.mooncake_replicas import OBJECT_NOT_FOUND, ReplicaReader, memory_replicas

SIZE = 64
TRANSFER_FAIL = -800


def replica(endpoint: str, address: int, size: int = SIZE, status: str = "COMPLETE",
            memory: bool = True) -> SimpleNamespace:
    buf = SimpleNamespace(transport_endpoint=endpoint, buffer_address=address, size=size)
    return SimpleNamespace(is_memory_replica=lambda: memory,
                           status=SimpleNamespace(name=status),
                           get_memory_descriptor=lambda: SimpleNamespace(buffer_descriptor=buf))


@dataclass
class Cluster:
    """Objects in named endpoints' memory; endpoints in ``dead`` refuse every read."""

    replicas: dict[str, list[SimpleNamespace]]
    memory: dict[tuple[str, int], bytes]
    dead: set[str] = field(default_factory=set)
    reads: list[str] = field(default_factory=list)
    queries: int = 0

    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[SimpleNamespace]]:
        self.queries += 1
        return {k: self.replicas[k] for k in keys if k in self.replicas}

    def batch_transfer_sync_read(self, endpoint: str, mine: list[int], theirs: list[int],
                                 lengths: list[int]) -> int:
        self.reads.append(endpoint)
        if endpoint in self.dead:
            return -1
        for a, t, n in zip(mine, theirs, lengths, strict=True):
            base = max(b for (e, b) in self.memory if e == endpoint and b <= t)
            data = self.memory[(endpoint, base)][t - base:t - base + n]
            ctypes.memmove(a, data, n)
        return 0


def buffers(n: int) -> tuple[list[ctypes.Array[ctypes.c_char]], list[list[tuple[int, int]]]]:
    """``n`` keys' runs: two pieces each (as a layer-first page and its digest)."""
    bufs = [ctypes.create_string_buffer(SIZE) for _ in range(n)]
    return bufs, [[(ctypes.addressof(b), 40), (ctypes.addressof(b) + 40, SIZE - 40)]
                  for b in bufs]


def make(keys: list[str], placement: dict[str, list[str]]) -> Cluster:
    memory: dict[tuple[str, int], bytes] = {}
    replicas: dict[str, list[SimpleNamespace]] = {}
    for i, k in enumerate(keys):
        replicas[k] = []
        for e in placement[k]:
            address = 0x1000 * (i + 1)
            memory[(e, address)] = bytes([i + 1]) * SIZE
            replicas[k].append(replica(e, address))
    return Cluster(replicas, memory)


def test_a_key_the_chosen_copy_failed_is_read_from_the_next() -> None:
    keys = ["k0", "k1", "k2"]
    c = make(keys, {"k0": ["dead:1", "b:2"], "k1": ["b:2", "dead:1"], "k2": ["dead:1"]})
    c.dead.add("dead:1")
    bufs, runs = buffers(3)
    r = ReplicaReader()
    got = r.retry(c, c, keys, runs, [SIZE] * 3, [TRANSFER_FAIL, TRANSFER_FAIL, TRANSFER_FAIL],
                  deadline=float("inf"))
    assert got == [SIZE, SIZE, TRANSFER_FAIL]  # k2 has no other copy
    assert bufs[0].raw == bytes([1]) * SIZE and bufs[1].raw == bytes([2]) * SIZE
    assert r.served == 2 and r.avoided() == ["dead:1"]
    # the dead endpoint was read once (k0 and k2 together), never again for k1 or later
    assert c.reads.count("dead:1") == 1
    c.reads.clear()
    bufs, runs = buffers(3)
    got = r.retry(c, c, keys, runs, [SIZE] * 3, [TRANSFER_FAIL, SIZE, TRANSFER_FAIL],
                  deadline=float("inf"))
    assert got == [SIZE, SIZE, TRANSFER_FAIL] and "dead:1" not in c.reads


def test_only_failed_keys_are_retried_and_never_a_missing_one() -> None:
    keys = ["here", "gone", "master"]
    c = make(keys, {"here": ["b:2"], "gone": ["b:2"], "master": ["b:2"]})
    _, runs = buffers(3)
    r = ReplicaReader()
    assert r.retry(c, c, keys, runs, [SIZE] * 3, [SIZE, OBJECT_NOT_FOUND, -900],
                   deadline=float("inf")) == [SIZE, OBJECT_NOT_FOUND, -900]
    assert c.queries == 0 and not c.reads


def test_replicas_that_cannot_be_this_page_are_skipped() -> None:
    descs = [replica("a:1", 1, status="PROCESSING"), replica("b:2", 2, size=SIZE * 2),
             replica("c:3", 3, memory=False), replica("d:4", 4)]
    assert memory_replicas(descs, SIZE) == [("d:4", 4)]


def test_nothing_is_tried_past_the_deadline() -> None:
    now = [0.0]
    keys = ["k0", "k1"]
    c = make(keys, {"k0": ["dead:1", "b:2"], "k1": ["dead:1", "b:2"]})
    c.dead.add("dead:1")

    def read(endpoint: str, *args: list[int]) -> int:
        now[0] += 1.0  # each read takes a second
        return Cluster.batch_transfer_sync_read(c, endpoint, *args)

    engine = SimpleNamespace(batch_transfer_sync_read=read)
    _, runs = buffers(2)
    r = ReplicaReader(clock=lambda: now[0])
    got = r.retry(c, engine, keys, runs, [SIZE] * 2, [TRANSFER_FAIL] * 2, deadline=0.5)
    assert got == [TRANSFER_FAIL] * 2 and c.reads == ["dead:1"]
    assert r.retry(c, engine, keys, runs, [SIZE] * 2, [TRANSFER_FAIL] * 2,
                   deadline=0.5) == [TRANSFER_FAIL] * 2  # past it: not even asked


def test_an_avoided_endpoint_is_forgotten() -> None:
    now = [0.0]
    r = ReplicaReader(forget_seconds=30, clock=lambda: now[0])
    r._failed("dead:1")
    assert r.avoided() == ["dead:1"]
    now[0] = 30.0
    assert r.avoided() == [] and r.failed_reads == 1


@pytest.mark.parametrize("raises", [True, False])
def test_an_engine_that_raises_is_a_failed_endpoint(raises: bool) -> None:
    def read(*_: object) -> int:
        if raises:
            raise RuntimeError("binding error")
        return -1

    keys = ["k0"]
    c = make(keys, {"k0": ["x:1"]})
    _, runs = buffers(1)
    r = ReplicaReader()
    assert r.retry(c, SimpleNamespace(batch_transfer_sync_read=read), keys, runs, [SIZE],
                   [TRANSFER_FAIL], deadline=float("inf")) == [TRANSFER_FAIL]
    assert r.avoided() == ["x:1"]
