"""``KeyIndex`` against a small reference model: each key's state and page, each page's
readers and spills, and which keys eviction may take (hypothesis ``RuleBasedStateMachine``),
under both eviction policies."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicached.cache.key_index import KeyIndex
from hicached.cache.lru import LRU
from hicached.cache.reuse_lru import ReuseLRU

KEYS = [b"k%d" % i for i in range(8)]
PAGES = 12


class IndexModel(RuleBasedStateMachine):
    """The model: ``ready``/``writing`` (key -> page), ``readers`` (page -> count),
    ``spilling`` (key -> count), the free pages; every ready key without readers is
    evictable."""

    policy = "lru"

    @initialize()
    def start(self) -> None:
        self.index = KeyIndex(LRU() if self.policy == "lru" else ReuseLRU(lambda: PAGES))
        self.ready: dict[bytes, int] = {}
        self.writing: dict[bytes, int] = {}
        self.readers: dict[int, int] = {}
        self.spilling: dict[bytes, int] = {}
        self.orphans: list[tuple[bytes, int]] = []
        """Copies whose key was removed while they wrote: their pages are freed at the end."""
        self.free = list(range(PAGES))
        self.now = 0.0

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    def evictable(self) -> set[bytes]:
        return {k for k, p in self.ready.items() if not self.readers.get(p)}

    @precondition(lambda self: self.free)
    @rule(key=st.sampled_from(KEYS))
    def write(self, key: bytes) -> None:
        if key in self.ready or key in self.writing:
            return  # a Store never writes a present key again (the cache checks first)
        page = self.free.pop(0)
        self.index.write(key, page)
        self.writing[key] = page

    @rule(data=st.data(), ok=st.booleans(), used=st.booleans())
    def finish_write(self, data: st.DataObject, ok: bool, used: bool) -> None:
        if not self.writing:
            return
        key = data.draw(st.sampled_from(sorted(self.writing)))
        page = self.writing.pop(key)
        assert self.index.written(key, page, ok) is ok
        if ok:
            self.ready[key] = page
            self.index.landed([key], self.tick(), used)
        else:
            self.free.append(page)

    @rule(data=st.data(), ok=st.booleans())
    def orphan_ends(self, data: st.DataObject, ok: bool) -> None:
        if not self.orphans:
            return
        key, page = self.orphans.pop(data.draw(st.integers(0, len(self.orphans) - 1)))
        assert self.index.written(key, page, ok) is False  # even a key written again since
        self.free.append(page)

    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        if not self.ready:
            return
        key = data.draw(st.sampled_from(sorted(self.ready)))
        page = self.ready[key]
        self.index.read_more(page, key)
        self.readers[page] = self.readers.get(page, 0) + 1
        assert self.index.readers(page) == self.readers[page]

    @rule(data=st.data())
    def read_ends(self, data: st.DataObject) -> None:
        if not self.readers:
            return
        page = data.draw(st.sampled_from(sorted(self.readers)))
        self.index.read_less([page], self.tick())
        self.readers[page] -= 1
        if not self.readers[page]:
            del self.readers[page]
            if page not in self.ready.values() and page not in self.writing.values():
                self.free.append(page)  # its key went while it was read

    @rule(n=st.integers(0, 4))
    def evict(self, n: int) -> None:
        before = self.evictable()
        used: list[float] = []
        keys, pages = self.index.evict(n, used)
        assert len(keys) == len(pages) == len(used) == min(n, len(before))
        assert set(keys) <= before
        not_spilled = before - set(self.spilling)
        if len(not_spilled) >= n:  # a spill's keys go last
            assert not set(keys) & set(self.spilling)
        for k, p in zip(keys, pages, strict=True):
            assert self.ready.pop(k) == p
            self.free.append(p)

    @rule(data=st.data())
    def forget(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(KEYS), max_size=3, unique=True))
        freed = self.index.forget(keys)
        expect = [self.ready[k] for k in keys if k in self.ready]
        assert freed == expect
        for k in keys:
            self.ready.pop(k, None)
            if k in self.writing:  # its page comes back when its copy ends
                self.orphans.append((k, self.writing.pop(k)))
        self.free += [p for p in freed if not self.readers.get(p)]

    @rule(n=st.integers(1, 3), window=st.integers(1, 8))
    def spill(self, n: int, window: int) -> None:
        keys = self.index.to_spill(n, window, lambda k: False)
        assert len(keys) <= n and set(keys) <= self.evictable()
        assert not set(keys) & set(self.spilling)
        self.index.spill_begun(keys)
        for k in keys:
            self.spilling[k] = self.spilling.get(k, 0) + 1

    @rule(data=st.data())
    def spill_ends(self, data: st.DataObject) -> None:
        if not self.spilling:
            return
        key = data.draw(st.sampled_from(sorted(self.spilling)))
        self.index.spill_ended([key])
        self.spilling[key] -= 1
        if not self.spilling[key]:
            del self.spilling[key]

    @precondition(lambda self: self.free)
    @rule(data=st.data())
    def move(self, data: st.DataObject) -> None:
        if not self.ready:
            return
        key = data.draw(st.sampled_from(sorted(self.ready)))
        page = self.ready[key]
        movable = not self.readers.get(page) and key not in self.spilling
        assert self.index.movable(page) == (key if movable else None)
        if movable:
            new = self.free.pop(0)
            self.index.moved(key, page, new)
            self.ready[key] = new
            self.free.append(page)

    @invariant()
    def agrees(self) -> None:
        if not hasattr(self, "index"):
            return
        index = self.index
        assert index.ready == self.ready and index.writing == self.writing
        assert index.evictable == len(self.evictable())
        for key, page in [*self.ready.items(), *self.writing.items()]:
            assert index.owner(page) == key
        # a copy whose key went keeps its page keyed until it ends (then it is freed)
        assert sorted(index.keyed_pages()) == sorted([*self.ready.values(),
                                                      *self.writing.values(),
                                                      *(p for _, p in self.orphans)])
        for key in KEYS:
            assert index.spilling(key) == (key in self.spilling)


class ReuseIndexModel(IndexModel):
    policy = "reuse"


@pytest.mark.parametrize("machine", [IndexModel, ReuseIndexModel], ids=["lru", "reuse"])
def test_the_index_agrees_with_its_model(machine: type[IndexModel]) -> None:
    case = machine.TestCase
    case.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
    case().runTest()


def test_a_recovered_key_keeps_its_newest_page() -> None:
    index = KeyIndex(LRU())
    assert index.recovered(b"a", 3) is None
    assert index.recovered(b"a", 5) == 3  # a move a crash cut short: the newer slot wins
    assert index.ready == {b"a": 5} and index.owner(3) is None and index.owner(5) == b"a"
