from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache.errors import (
    AllocSizeNotPageAligned,
    DoubleFree,
    HiCacheError,
    IndicesNotPageAligned,
    PageBusy,
    PageNotAllocated,
    PoolExhausted,
)
from hicached.core.allocator import PageAllocator


def written(a: PageAllocator, pages: np.ndarray, layers: range) -> np.ndarray:
    mask = a.raw_state(pages, layers)[1]
    assert mask is not None
    return mask


def test_alloc_returns_whole_aligned_pages() -> None:
    a = PageAllocator(8, 4)
    idx = a.alloc(12)
    assert idx.size == 12
    runs = idx.reshape(-1, 4)
    assert (runs[:, 0] % 4 == 0).all()
    assert (runs == runs[:, :1] + np.arange(4)).all()
    assert a.used_pages == 3 and a.free_pages == 5
    a.memcheck()


def test_alloc_zero_and_unaligned() -> None:
    a = PageAllocator(8, 4)
    assert a.alloc(0).size == 0
    with pytest.raises(AllocSizeNotPageAligned) as exc:
        a.alloc(5)
    assert exc.value.metadata["aligned_size"] == "8"
    with pytest.raises(AllocSizeNotPageAligned):
        a.alloc(-4)


def test_exhaustion_is_structured_and_counted() -> None:
    a = PageAllocator(2, 4)
    a.alloc(8)
    with pytest.raises(PoolExhausted) as exc:
        a.alloc(4)
    assert exc.value.metadata["free_pages"] == "0"
    assert exc.value.metadata["requested_pages"] == "1"
    assert a.alloc_failures == 1
    a.memcheck()


def test_double_free_and_never_allocated() -> None:
    a = PageAllocator(8, 4)
    idx = a.alloc(8)
    a.free(idx)
    with pytest.raises(DoubleFree):
        a.free(idx[:4])
    with pytest.raises(PageNotAllocated):
        a.free(np.arange(28, 32))
    a.memcheck()


def test_partial_page_free_changes_nothing() -> None:
    a = PageAllocator(8, 4)
    idx = a.alloc(8)
    with pytest.raises(IndicesNotPageAligned):
        a.free(idx[:6])
    with pytest.raises(HiCacheError) as exc:
        a.free(np.concatenate([idx[:4], idx[:4]]))
    assert exc.value.reason == "DUPLICATE_PAGE"
    assert a.used_pages == 2
    a.memcheck()


def test_batch_with_one_bad_page_frees_nothing() -> None:
    a = PageAllocator(8, 4)
    idx = a.alloc(8)
    with pytest.raises(PageNotAllocated):
        a.free(np.concatenate([idx, np.arange(28, 32)]))
    assert a.used_pages == 2
    a.memcheck()


def test_held_page_is_released_only_after_its_copy() -> None:
    a = PageAllocator(4, 2)
    idx = a.alloc(2)
    page = idx[::2] // 2
    a.acquire(page, write=False)
    a.free(idx)
    assert a.free_pages == 3  # still held by the reader
    a.memcheck()
    with pytest.raises(PageNotAllocated):
        a.acquire(page, write=False)  # a freed page cannot gain new readers
    a.release(page, write=False)
    assert a.free_pages == 4
    a.memcheck()


def test_one_writer_or_many_readers_else_page_busy() -> None:
    a = PageAllocator(4, 2, layer_num=3)
    pages = a.alloc(4)[::2] // 2
    a.acquire(pages, write=False)
    a.acquire(pages[:1], write=False)  # readers share
    with pytest.raises(PageBusy) as exc:
        a.acquire(pages, write=True)
    assert exc.value.metadata["held_for"] == "read" and exc.value.metadata["count"] == "2"
    a.release(pages, write=False)
    with pytest.raises(PageBusy):
        a.acquire(pages[:1], write=True)  # still one reader on the first page
    a.acquire(pages[1:], write=True)
    with pytest.raises(PageBusy) as exc:
        a.acquire(pages, write=False)  # never read while written
    assert exc.value.metadata["held_for"] == "written"
    with pytest.raises(PageBusy):
        a.acquire(pages[1:], write=True)  # never two writers
    a.release(pages[:1], write=False)
    a.release(pages[1:], write=True, layers=range(0, 2))
    a.memcheck()
    assert written(a, pages, range(0, 2)).tolist() == [False, True]
    assert written(a, pages, range(0, 3)).tolist() == [False, False]
    a.acquire(pages, write=True)  # all free again
    a.release(pages, write=True)  # an aborted write marks nothing
    assert written(a, pages, range(2, 3)).tolist() == [False, False]


def test_written_bits_start_clear_on_every_allocation() -> None:
    a = PageAllocator(1, 2, layer_num=2)
    page = a.alloc(2)[::2] // 2
    a.acquire(page, write=True)
    a.release(page, write=True, layers=range(0, 2))
    assert written(a, page, range(0, 2)).all()
    a.free(page * 2 + np.arange(2))
    again = a.alloc(2)[::2] // 2
    assert again.tolist() == page.tolist() and not written(a, again, range(0, 1)).any()


def test_owned_pages_are_freed_with_their_owner_even_while_held() -> None:
    a = PageAllocator(6, 1)
    mine, theirs, nobody = a.alloc(2, owner=7), a.alloc(2, owner=8), a.alloc(1)
    a.acquire(mine[:1], write=False)
    assert a.free_owned(7) == 2 and a.free_pages == 2  # one released now, one after its copy
    a.release(mine[:1], write=False)
    assert a.free_pages == 3 and a.free_owned(7) == 0 and a.free_owned(0) == 0
    assert a.is_allocated(np.concatenate([theirs, nobody])).all()
    a.memcheck()


def test_keyed_pages_are_not_raw_pages() -> None:
    a = PageAllocator(4, 2)
    keyed = a.alloc_pages(2)
    assert a.counts()["keyed"] == 2 and a.counts()["busy"] == 2  # busy with their write
    assert not a.is_allocated(keyed).any()
    with pytest.raises(PageNotAllocated) as exc:
        a.free(keyed[:1] * 2 + np.arange(2))
    assert "keyed" in exc.value.message
    a.release(keyed, write=True)
    a.release_pages(keyed)
    assert a.free_pages == 4
    a.memcheck()


def test_pages_freed_last_are_handed_out_first() -> None:
    """A fresh pool hands out 0, 1, 2, ...; freed pages come back first, in freed order."""
    a = PageAllocator(5, 1)
    first = a.alloc(3)
    assert first.tolist() == [0, 1, 2]
    a.free(first[1:])
    assert a.alloc(4).tolist() == [1, 2, 3, 4]
    a.free(first[:1])
    assert a.alloc(1).tolist() == [0]
    a.memcheck()


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc / free / acquire / release sequences; memcheck after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.ps = 4
        self.a = PageAllocator(16, self.ps)
        self.owned: list[np.ndarray] = []
        self.pinned: list[np.ndarray] = []
        self.freed_once: set[int] = set()

    @rule(n=st.integers(0, 6))
    def alloc(self, n: int) -> None:
        free_before = self.a.free_pages
        if n > free_before:
            with pytest.raises(PoolExhausted):
                self.a.alloc(n * self.ps)
            assert self.a.free_pages == free_before
            return
        idx = self.a.alloc(n * self.ps)
        pages = idx[:: self.ps] // self.ps
        held = {int(p) for o in self.owned for p in o[:: self.ps] // self.ps}
        assert not held & set(pages.tolist()), "a page was handed out twice"
        assert all(p < self.a.limit for p in pages.tolist()), "a page above the limit"
        if n:
            self.owned.append(idx)

    @precondition(lambda self: self.owned)
    @rule(i=st.integers(0, 100))
    def free(self, i: int) -> None:
        idx = self.owned.pop(i % len(self.owned))
        self.a.free(idx)
        self.freed_once.update((idx[:: self.ps] // self.ps).tolist())

    @precondition(lambda self: self.freed_once)
    @rule()
    def double_free_is_rejected(self) -> None:
        held = {int(p) for o in self.owned for p in o[:: self.ps] // self.ps}
        stale = sorted(self.freed_once - held)
        if not stale:
            return
        before = self.a.free_pages
        with pytest.raises(DoubleFree):
            self.a.free(np.arange(stale[0] * self.ps, (stale[0] + 1) * self.ps))
        assert self.a.free_pages == before

    @precondition(lambda self: self.owned)
    @rule(i=st.integers(0, 100))
    def pin(self, i: int) -> None:
        idx = self.owned[i % len(self.owned)]
        pages = idx[:: self.ps] // self.ps
        self.a.acquire(pages, write=False)
        self.pinned.append(pages)

    @precondition(lambda self: self.pinned)
    @rule()
    def unpin(self) -> None:
        self.a.release(self.pinned.pop(0), write=False)

    @rule(limit=st.integers(0, 16))
    def set_limit(self, limit: int) -> None:
        used = self.a.used_pages
        assert self.a.set_limit(limit) == limit
        assert self.a.used_pages == used, "a limit frees or takes nothing"
        assert self.a.free_pages == sum(1 for p in range(limit) if p not in self._live())

    def _live(self) -> set[int]:
        return {int(p) for o in self.owned for p in o[:: self.ps] // self.ps} | {
            int(p) for pages in self.pinned for p in pages}

    @invariant()
    def memcheck(self) -> None:
        self.a.memcheck()
        assert self.a.used_pages == len(self._live()), \
            "used pages are those handed out, or freed while a copy still reads them"
        assert self.a.top() == max(self._live(), default=-1) + 1
        assert self.a.in_use_from(3).tolist() == sorted(p for p in self._live() if p >= 3)


TestAllocatorMachine = AllocatorMachine.TestCase


def test_a_lowered_limit_parks_pages_and_a_raised_one_brings_them_back() -> None:
    a = PageAllocator(8, 1)
    first = a.alloc(6)  # pages 0..5
    a.free(first[[1, 4]])
    assert a.set_limit(3) == 3
    assert a.free_pages == 1 and a.counts()["parked"] == 3  # page 1 free; 4, 6, 7 parked
    assert a.alloc(1).tolist() == [1]
    with pytest.raises(PoolExhausted):
        a.alloc(1)
    a.free(first[[5]])  # freed above the limit: parked, not handed out
    assert a.free_pages == 0 and a.counts()["parked"] == 4
    a.memcheck()
    assert a.top() == 4  # page 3 is the highest in use
    assert a.set_limit(100) == 8  # clamped
    assert sorted(a.alloc(4).tolist()) == [4, 5, 6, 7]
    a.memcheck()

