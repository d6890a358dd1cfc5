"""core.registrations: which page-locked registration each address lies in, by bucket table,
against a binary search over the seams."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicached.core import registrations
from hicached.core.registrations import Registrations


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 1 << 24), st.data())
def test_index_is_the_number_of_seams_at_or_below_each_address(nbytes: int,
                                                                data: st.DataObject) -> None:
    base = 1 << 40
    offs = data.draw(st.lists(st.integers(1, nbytes), max_size=40, unique=True))
    seams = base + np.asarray(sorted(offs), dtype=np.int64)
    regs = Registrations(seams, base, nbytes)
    near = [int(s) + d for s in seams[:8] for d in (-1, 0, 1)]
    addrs = np.asarray(
        data.draw(st.lists(st.integers(base - 4096, base + nbytes + 4096), max_size=200))
        + near + [base, base + nbytes - 1], dtype=np.int64)
    assert regs.index(addrs).tolist() == np.searchsorted(seams, addrs, "right").tolist()
    assert bool(regs) == bool(seams.size)


def test_a_large_region_uses_coarser_buckets_and_stays_exact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registrations, "MAX_BUCKETS", 64)
    base, nbytes = 1 << 30, 1 << 30
    rng = np.random.default_rng(1)
    seams = base + np.unique(rng.integers(1, nbytes, 300))
    regs = Registrations(seams, base, nbytes)
    assert regs._table.size <= 64 and (regs._table < 0).any()
    addrs = base + rng.integers(0, nbytes, 10_000)
    assert (regs.index(addrs) == np.searchsorted(seams, addrs, "right")).all()


def test_no_seams_means_one_registration_and_unordered_seams_are_refused() -> None:
    none = Registrations.none()
    assert not none and none.index(np.asarray([0, 1 << 50])).tolist() == [0, 0]
    with pytest.raises(ValueError, match="ascending"):
        Registrations(np.asarray([10, 10]), 0, 100)
