from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hicache.errors import HiCacheError, IndicesMalformed, IndicesNotPageAligned
from hicached.core.validation import (
    check_page_runs,
    check_range,
    to_index_array,
    validate_transfer,
)


def pages_to_indices(pages: list[int], page_size: int) -> np.ndarray:
    p = np.asarray(pages, dtype=np.int64)
    return (p[:, None] * page_size + np.arange(page_size)).reshape(-1)


def all_allocated(pages: np.ndarray) -> np.ndarray:
    return np.ones(pages.shape, dtype=bool)


def raw_state_of(allocated):  # type: ignore[no-untyped-def]
    """An allocator's ``raw_state`` where ``allocated`` says which pages are raw pages."""
    return lambda pages, layers: (allocated(pages), None if layers is None else
                                  np.ones(pages.shape, dtype=bool),
                                  np.ones(pages.shape, dtype=np.uint32))


def validate(h: object, d: object, *, ps: int = 4, host: int = 64, dev: int = 64,
             layers: tuple[int, int] = (0, 0), writes_host: bool = True,
             allocated=all_allocated):  # type: ignore[no-untyped-def]
    return validate_transfer(host_indices=h, device_indices=d, page_size=ps, host_tokens=host,
                             device_tokens=dev, layer_num=4, layer_begin=layers[0],
                             layer_end=layers[1], writes_host=writes_host,
                             raw_state=raw_state_of(allocated))


def reasons(exc: HiCacheError) -> list[str]:
    return [v.reason for v in exc.violations]


def test_valid_batch_gives_pages() -> None:
    b = validate(pages_to_indices([3, 1], 4), pages_to_indices([0, 7], 4))
    assert b.host_pages.tolist() == [3, 1] and b.device_pages.tolist() == [0, 7]
    assert b.layers == range(4)


def test_length_not_multiple_of_page_size() -> None:
    with pytest.raises(IndicesNotPageAligned) as exc:
        validate(np.arange(6), np.arange(6))
    md = exc.value.metadata
    assert md["count"] == "6" and md["page_size"] == "4" and md["first_bad_position"] == "4"
    assert exc.value.reason == "INDICES_NOT_PAGE_ALIGNED"


def test_non_consecutive_run_is_caught_even_with_aligned_length() -> None:
    h = pages_to_indices([0, 2], 4)
    h[6] = 40  # page 1's third token jumps elsewhere
    with pytest.raises(IndicesNotPageAligned) as exc:
        validate(h, pages_to_indices([0, 1], 4))
    assert exc.value.metadata["first_bad_position"] == "6"
    assert exc.value.metadata["first_bad_value"] == "40"


def test_run_not_starting_at_page_boundary() -> None:
    with pytest.raises(IndicesNotPageAligned) as exc:
        validate(np.arange(2, 6), np.arange(4))
    assert exc.value.metadata["first_bad_position"] == "0"


def test_every_violation_is_reported() -> None:
    h = np.array([1, 2, 3, 4, 100, 101, 102, 103, 7])
    d = np.arange(8)
    with pytest.raises(HiCacheError) as exc:
        validate(h, d, layers=(3, 9))
    got = reasons(exc.value)
    assert got[0] == "INDEX_COUNT_MISMATCH"
    assert {"INDICES_NOT_PAGE_ALIGNED", "INDEX_OUT_OF_RANGE", "LAYER_OUT_OF_RANGE"} <= set(got)


def test_duplicate_destination_page() -> None:
    with pytest.raises(HiCacheError) as exc:
        validate(pages_to_indices([2, 2], 4), pages_to_indices([0, 1], 4))
    assert exc.value.reason == "DUPLICATE_PAGE"
    # a load may read one host page into two device pages; two writes to one device page not
    validate(pages_to_indices([2, 2], 4), pages_to_indices([0, 1], 4), writes_host=False)
    with pytest.raises(HiCacheError) as exc:
        validate(pages_to_indices([2, 3], 4), pages_to_indices([1, 1], 4), writes_host=False)
    assert exc.value.reason == "DUPLICATE_PAGE"


def test_unallocated_host_page() -> None:
    with pytest.raises(HiCacheError) as exc:
        validate(pages_to_indices([1, 5], 4), pages_to_indices([0, 1], 4),
                 allocated=lambda p: p != 5)
    assert exc.value.reason == "PAGE_NOT_ALLOCATED"
    assert exc.value.metadata["page"] == "5" and exc.value.metadata["first_bad_position"] == "4"


@pytest.mark.parametrize("begin,end", [(-1, 2), (2, 2), (3, 1), (0, 5), (4, 5)])
def test_layer_range(begin: int, end: int) -> None:
    with pytest.raises(HiCacheError) as exc:
        validate(np.arange(4), np.arange(4), layers=(begin, end))
    assert exc.value.reason == "LAYER_OUT_OF_RANGE"


def test_layer_subrange_ok() -> None:
    assert validate(np.arange(4), np.arange(4), layers=(1, 3)).layers == range(1, 3)


@pytest.mark.parametrize("obj", [
    np.zeros((2, 4), np.int64), np.zeros(4, np.float32), torch.zeros(4), b"\x00" * 7,
    ["a", "b"],
])
def test_malformed_indices(obj: object) -> None:
    with pytest.raises(IndicesMalformed):
        to_index_array(obj, "host_indices")


def test_index_decoding_is_exact() -> None:
    vals = np.array([0, 5, 2**40, -3], dtype="<i8")
    for obj in (vals, torch.from_numpy(vals), vals.tobytes(), vals.tolist(),
                vals.astype(np.int32) if False else vals):
        assert to_index_array(obj, "x").tolist() == vals.tolist()
    assert to_index_array(torch.tensor([1, 2], dtype=torch.int32), "x").tolist() == [1, 2]
    assert to_index_array([], "x").size == 0


@given(st.integers(1, 16), st.lists(st.integers(0, 63), min_size=0, max_size=20, unique=True))
def test_whole_page_runs_always_pass(page_size: int, pages: list[int]) -> None:
    idx = pages_to_indices(pages, page_size)
    assert check_page_runs(idx, page_size, "h") == []
    assert check_range(idx, 64 * page_size, "h") == []


@given(st.integers(2, 16), st.lists(st.integers(0, 63), min_size=1, max_size=20, unique=True),
       st.data())
def test_any_perturbed_run_is_caught(page_size: int, pages: list[int], data: st.DataObject
                                     ) -> None:
    idx = pages_to_indices(pages, page_size)
    pos = data.draw(st.integers(0, idx.size - 1))
    delta = data.draw(st.integers(-5, 5).filter(lambda x: x != 0))
    idx[pos] += delta
    found = check_page_runs(idx, page_size, "h")
    assert len(found) == 1
    # the reported position is inside the perturbed page (a moved start shifts the blame
    # within the run, never to another page)
    assert int(str(found[0].metadata["first_bad_position"])) // page_size == pos // page_size


@pytest.mark.parametrize("written_layers", [None, (0, 2)])
def test_host_pages_are_judged_alike_by_token_indices_and_by_page_ids(
        written_layers: tuple[int, int] | None) -> None:
    """A load naming pages the allocator does not have raw, or has not written at its
    layers, is refused with the same reason, page and count whether the batch names token
    indices or page ids; the position is the first bad one's token index or page position."""
    from types import SimpleNamespace

    from hicached.copy.page_batch import validate_page_transfer

    ps, host = 4, np.array([3, 5, 9, 11], dtype=np.int64)
    allocated = {3, 5, 9, 11} if written_layers else {3, 5}  # 9 and 11 are not raw pages
    written = {3, 5}  # at layers 0-1 only

    def raw_state(pages, layers):  # type: ignore[no-untyped-def]
        return (np.isin(pages, list(allocated)),
                None if layers is None else np.isin(pages, list(written))
                & (layers.stop <= 2), np.ones(pages.shape, dtype=np.uint32))

    layers = (0, 3)
    with pytest.raises(HiCacheError) as by_tokens:
        validate_transfer(host_indices=pages_to_indices(host.tolist(), ps),
                          device_indices=pages_to_indices([0, 1, 2, 3], ps), page_size=ps,
                          host_tokens=64, device_tokens=64, layer_num=4,
                          layer_begin=layers[0], layer_end=layers[1], writes_host=False,
                          raw_state=raw_state)
    allocator = SimpleNamespace(page_num=16, raw_state=raw_state)
    with pytest.raises(HiCacheError) as by_pages:
        validate_page_transfer(host_pages=host, device_pages=np.arange(4, dtype=np.int64),
                               allocator=allocator, device_page_num=16, layer_num=4,  # type: ignore[arg-type]
                               layer_begin=layers[0], layer_end=layers[1], writes_host=False)
    want = "PAGE_NOT_WRITTEN" if written_layers else "PAGE_NOT_ALLOCATED"
    first = 0 if written_layers else 2  # every page unwritten at layer 2, or 9 not raw
    for exc, field, position in ((by_tokens.value, "host_indices", first * ps),
                                 (by_pages.value, "host_pages", first)):
        (v,) = exc.violations
        assert (v.reason, v.field) == (want, field)
        assert v.metadata["page"] == int(host[first])
        assert v.metadata["first_bad_position"] == position
        assert v.metadata["count"] == (4 if written_layers else 2)
