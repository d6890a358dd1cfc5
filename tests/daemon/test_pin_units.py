"""Page-locking a pool by units that follow its share (``core.pin_units``).

The units tile the region in whole OS pages, and each unit's first page is exactly the lowest
page any of its bytes belongs to (checked byte by byte against a map of the region, for random
runs and for every pool layout): so locking the units below a frontier locks every byte of
every page below it, and unlocking those at or above it touches no byte of a page below it. A
state machine grows and shrinks a real pool's locked part through a pinner with the driver's
rules (no overlap, unregister by base, a locked-memory limit) while pages below the frontier
hold known bytes: what is locked is exactly what those pages need, nothing locked is given
back, and what was unlocked reads as zeros (given back to the system).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache.errors import PinFailed
from hicache.specs import DType, Layout, PoolKind
from hicached.core.memory import OS_PAGE, HostMemory
from hicached.core.pin_units import PinUnits, tile
from hicached.core.pool import HostPool, MemoryOptions
from tests.cache_pages import pattern, read, write
from tests.helpers import SMALL, StrictPinner, geometry_for, spec

UNIT = OS_PAGE
OPTIONS = MemoryOptions(hugepages=False, prefault_threads=1, reserve_bytes=0,
                        pin_unit_bytes=UNIT)


def owners(runs: list[tuple[int, int]], page_num: int, mapped: int) -> np.ndarray:
    """The page each byte of the region belongs to (``page_num``: none)."""
    out = np.full(mapped, page_num, dtype=np.int64)
    for off, length in runs:
        pitch = length // page_num
        out[off:off + length] = np.repeat(np.arange(page_num), pitch)
    return out


def check_tiling(runs: list[tuple[int, int]], page_num: int, nbytes: int, unit: int,
                 max_units: int) -> None:
    starts, ends, first = tile(runs, page_num, nbytes, unit, max_units)
    mapped = -(-nbytes // OS_PAGE) * OS_PAGE
    order = np.argsort(starts)
    s, e = starts[order], ends[order]
    assert s[0] == 0 and e[-1] == mapped and np.array_equal(s[1:], e[:-1]), "a tiling"
    assert not (s % OS_PAGE).any() and not (e % OS_PAGE).any() and (e > s).all()
    assert starts.size <= max(max_units, len(runs)) + 1  # each run is cut at its start
    assert np.all(np.diff(first) >= 0), "locked in first-page order"
    own = owners(runs, page_num, mapped)
    for a, b, f in zip(starts.tolist(), ends.tolist(), first.tolist(), strict=True):
        assert f == int(own[a:b].min()), (a, b, f)


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[tuple[int, int]], int, int]:
    page_num = draw(st.integers(1, 40))
    runs, at = [], draw(st.integers(0, 3)) * 64
    for _ in range(draw(st.integers(1, 6))):
        pitch = draw(st.integers(1, 9000))
        runs.append((at, pitch * page_num))
        at += -(-pitch * page_num // 64) * 64 + draw(st.integers(0, 2)) * 64
    return runs, page_num, at


@given(layouts(), st.sampled_from([OS_PAGE, 3 * OS_PAGE, 1 << 20]), st.integers(1, 64))
@settings(max_examples=200, deadline=None)
def test_each_unit_starts_at_the_lowest_page_it_holds_a_byte_of(
        layout: tuple[list[tuple[int, int]], int, int], unit: int, max_units: int) -> None:
    runs, page_num, nbytes = layout
    check_tiling(runs, page_num, nbytes, unit, max_units)


@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.value)
@pytest.mark.parametrize("kind,dtype", [(PoolKind.MHA, DType.BFLOAT16),
                                        (PoolKind.MLA, DType.FLOAT16),
                                        (PoolKind.DSA_INDEXER, DType.UINT8)],
                         ids=lambda x: x.value)
@pytest.mark.parametrize("page_size", [1, 16])
def test_every_pool_layout_tiles_exactly(layout: Layout, kind: PoolKind, dtype: DType,
                                         page_size: int) -> None:
    s = spec(geometry_for(kind, dtype), page_size=page_size, layout=layout,
             size_tokens=48 * page_size)
    pool = HostPool(s, SMALL)
    try:
        check_tiling(pool.page_run_ranges(0, pool.page_num), pool.page_num, pool.nbytes,
                     OS_PAGE, 4096)
    finally:
        pool.close()


@pytest.fixture
def pinner() -> StrictPinner:
    return StrictPinner()


def elastic_pool(pinner: StrictPinner, resident: int, layout: Layout = Layout.LAYER_FIRST
                 ) -> HostPool:
    s = spec(geometry_for(PoolKind.MHA, DType.BFLOAT16), page_size=16, layout=layout,
             size_tokens=16 * 64)
    return HostPool(s, OPTIONS, pinner=pinner, resident_pages=resident)


def locked_units(units: PinUnits) -> set[tuple[int, int]]:
    return {(int(a), int(b - a)) for a, b in
            zip(units._starts[:units.locked], units._ends[:units.locked], strict=True)}


def units_below(units: PinUnits, pages: int) -> set[tuple[int, int]]:
    sel = units._first < pages
    return {(int(a), int(b - a)) for a, b in zip(units._starts[sel], units._ends[sel],
                                                 strict=True)}


def test_a_new_pool_locks_only_its_resident_pages(pinner: StrictPinner) -> None:
    pool = elastic_pool(pinner, 8)
    try:
        units = pool.pin_units
        assert units is not None and units.units > 8
        base = pool.memory.address  # type: ignore[union-attr]
        assert {(a - base, n) for a, n in pinner.ranges.items()} == units_below(units, 8)
        assert pool.pinned_bytes == pinner.nbytes < pool.nbytes
        assert units.frontier >= 8
        for page in range(8):
            for off, n in pool.page_segments(page):
                assert pinner.covers(base + off, n), page
    finally:
        pool.close()
    assert not pinner.ranges, "closing unlocks everything"


def test_a_pool_that_cannot_lock_its_floor_is_refused_with_nothing_locked() -> None:
    pinner = StrictPinner(limit=4 * OS_PAGE)
    with pytest.raises(PinFailed) as info:
        elastic_pool(pinner, 32)
    assert info.value.metadata["pages"] == "32"
    assert not pinner.ranges


def test_the_lock_limit_refuses_growth_keeps_the_frontier_and_backs_off() -> None:
    now = [0.0]
    pinner = StrictPinner(limit=0)
    memory = HostMemory(64 * OS_PAGE, hugepages=False, prefault=False)
    units = PinUnits(memory, pinner, [(0, 64 * OS_PAGE)], 64, UNIT, clock=lambda: now[0])
    try:
        assert not units.pin_below(10) and units.locked == 0 and units.frontier == 0
        pinner.limit = 4 * OS_PAGE
        assert not units.pin_below(10), "refused again without trying while backing off"
        now[0] += 1.5
        assert not units.pin_below(10) and not pinner.ranges, "all or nothing"
        assert units.frontier == 0
        now[0] += 1.5
        assert units.pin_below(4) and units.frontier == 4 and pinner.nbytes == 4 * OS_PAGE
        pinner.limit = None
        assert units.pin_below(10) and units.frontier == 10
        assert units.unpin_from(4) == 6 * OS_PAGE and pinner.nbytes == 4 * OS_PAGE
        assert units.unpin_from(0) == 4 * OS_PAGE and not pinner.ranges
    finally:
        memory.close()


class LockedShare(RuleBasedStateMachine):
    """A pool's locked part following a share that grows and shrinks; pages below the share
    hold known bytes (written after each growth, as a Store would)."""

    def __init__(self) -> None:
        super().__init__()
        self.pinner = StrictPinner()
        self.pool = elastic_pool(self.pinner, 4)
        self.units = self.pool.pin_units
        assert self.units is not None
        self.share = 4
        self.written: dict[int, bytes] = {}
        self._write(0, 4)

    def teardown(self) -> None:
        self.pool.close()
        assert not self.pinner.ranges

    def _write(self, first: int, end: int) -> None:
        for page in range(first, end):
            key = b"page-%d-%d" % (page, len(self.written))
            write(self.pool, page, pattern(key, self.pool.spec.page_bytes))
            self.written[page] = key

    @rule(n=st.integers(1, 24))
    def grow(self, n: int) -> None:
        end = min(self.share + n, self.pool.page_num)
        assert self.pool.reserve_pages(self.share, end)
        self._write(self.share, end)
        self.share = end

    @rule(n=st.integers(1, 24))
    def shrink(self, n: int) -> None:
        self.share = max(self.share - n, 0)
        for page in [p for p in self.written if p >= self.share]:
            del self.written[page]
        self.pool.release_pages(self.share, self.pool.page_num)

    @precondition(lambda self: self.share < self.pool.page_num)
    @rule(n=st.integers(1, 24))
    def growth_refused(self, n: int) -> None:
        before = dict(self.pinner.ranges)
        self.pinner.limit = self.pinner.nbytes  # nothing more may be locked
        self.units._refused_until = 0.0  # type: ignore[union-attr]
        end = min(self.share + n, self.pool.page_num)
        try:  # refused where a unit must be locked; pages already covered are no growth
            assert self.pool.reserve_pages(self.share, end) == (self.units.frontier >= end)  # type: ignore[union-attr]
        finally:
            self.pinner.limit = None
            self.units._refused_until = 0.0  # type: ignore[union-attr]
        assert self.pinner.ranges == before

    @invariant()
    def locked_is_what_the_share_needs(self) -> None:
        units, base = self.units, self.pool.memory.address  # type: ignore[union-attr]
        assert units is not None
        assert {(a - base, n) for a, n in self.pinner.ranges.items()} \
            == locked_units(units) == units_below(units, self.share)
        for page in range(self.share):
            for off, n in self.pool.page_segments(page):
                assert self.pinner.covers(base + off, n), page

    @invariant()
    def pages_keep_their_bytes_and_unlocked_memory_went_back(self) -> None:
        for page, key in self.written.items():
            assert np.array_equal(read(self.pool, page),
                                  pattern(key, self.pool.spec.page_bytes)), page
        units = self.units
        assert units is not None
        raw = self.pool.raw_bytes()
        for a, b in zip(units._starts[units.locked:], units._ends[units.locked:], strict=True):
            assert not raw[a:min(b, raw.size)].any(), "an unlocked unit still holds bytes"


LockedShare.TestCase.settings = settings(max_examples=40, stateful_step_count=30,
                                         deadline=None)
TestLockedShare = LockedShare.TestCase


def test_release_never_gives_back_locked_memory(pinner: StrictPinner) -> None:
    pool = elastic_pool(pinner, 64)  # everything locked
    try:
        for page in range(pool.page_num):
            write(pool, page, pattern(b"k%d" % page, pool.spec.page_bytes))
        assert pool.memory is not None
        assert pool.memory.release([(0, pool.nbytes)]) == 0
        for page in range(pool.page_num):
            assert np.array_equal(read(pool, page), pattern(b"k%d" % page, pool.spec.page_bytes))
    finally:
        pool.close()
