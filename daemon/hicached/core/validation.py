"""Vectorized validation of index batches, collecting every violation before any byte moves.

Primitives:

- ``to_index_array(obj, field)`` (from ``hicache.indices``): a 1-D int64 array, or
  ``INDICES_MALFORMED``.
- ``page_numbers(idx, page_size)``: the page of each whole page run (its first index //
  page_size); a trailing partial page is left out.
- ``check_page_runs``: length a multiple of page_size and every page a run of page_size
  consecutive indices starting at a multiple of page_size (``INDICES_NOT_PAGE_ALIGNED``).
  SGLang checks only the length; a non-contiguous run would silently move the wrong bytes.
- ``check_range``, ``check_duplicate_pages``, ``check_layers``: ``INDEX_OUT_OF_RANGE``,
  ``DUPLICATE_PAGE``, ``LAYER_OUT_OF_RANGE``.
- ``check_host_pages``: a raw batch's host pages against the allocator,
  ``PAGE_NOT_ALLOCATED`` and ``PAGE_NOT_WRITTEN`` (by token indices or by page ids).
- ``validate_transfer``: all of the above for a raw backup or load, plus
  ``INDEX_COUNT_MISMATCH``; returns a
  ``TransferBatch`` of page numbers or raises the first violation's error carrying all of them.
- ``validate_keyed``: the device side of a Store or LoadKeys (one page per key);
  ``check_keyed_layers``: its layer range (a Store's covers every layer).

Every check is a handful of numpy operations on the whole batch; nothing loops over tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hicache.errors import (
    DuplicatePage,
    IndexCountMismatch,
    IndexOutOfRange,
    IndicesNotPageAligned,
    LayerOutOfRange,
    PageNotAllocated,
    PageNotWritten,
    Violation,
    raise_violations,
)
from hicache.indices import IndexArray, to_index_array

__all__ = ["IndexArray", "TransferBatch", "check_duplicate_pages", "check_keyed_layers",
           "check_layers",
           "check_page_runs", "check_range", "page_numbers", "to_index_array",
           "validate_keyed", "validate_transfer"]

_ARANGES: dict[int, IndexArray] = {}


def _arange(n: int) -> IndexArray:
    got = _ARANGES.get(n)
    if got is None:
        got = _ARANGES[n] = np.arange(n, dtype=np.int64)
        got.flags.writeable = False
    return got


def page_numbers(idx: IndexArray, page_size: int) -> IndexArray:
    """The page number of each whole page run of ``idx`` (trailing partial page left out)."""
    return idx[: idx.size - idx.size % page_size: page_size] // page_size


def check_page_runs(idx: IndexArray, page_size: int, field: str) -> list[Violation]:
    """Whole pages only: length % page_size == 0 and each page a consecutive aligned run."""
    out: list[Violation] = []
    n = int(idx.size)
    whole = n - n % page_size
    if n % page_size:
        out.append(Violation(
            field, IndicesNotPageAligned.reason,
            f"{field} has {n} indices, not a multiple of page_size {page_size}",
            {"count": n, "page_size": page_size, "first_bad_position": whole,
             "remainder": n % page_size},
        ))
    if whole:
        runs = idx[:whole].reshape(-1, page_size)
        starts = runs[:, 0]
        offsets = _arange(page_size)
        # fast path: one pass that holds for every valid batch
        if not (starts % page_size).any() and (
                page_size == 1 or np.array_equal(runs, starts[:, None] + offsets)):
            return out
        bad = (runs != starts[:, None] + offsets).any(axis=1)
        bad |= starts % page_size != 0
        bad_rows = np.flatnonzero(bad)
        if bad_rows.size:
            row = int(bad_rows[0])
            run = runs[row]
            expect = run[0] - run[0] % page_size + np.arange(page_size, dtype=np.int64)
            offset = int(np.flatnonzero(run != expect)[0])
            pos = row * page_size + offset
            out.append(Violation(
                field, IndicesNotPageAligned.reason,
                f"{field}: {bad_rows.size} page run(s) are not {page_size} consecutive indices "
                f"starting at a multiple of page_size; first bad index {int(idx[pos])} at "
                f"position {pos}",
                {"count": n, "page_size": page_size, "first_bad_position": pos,
                 "first_bad_value": int(idx[pos]), "bad_pages": int(bad_rows.size)},
            ))
    return out


def check_range(idx: IndexArray, upper: int, field: str) -> list[Violation]:
    """Every index in [0, upper)."""
    if idx.size == 0 or (int(idx.min()) >= 0 and int(idx.max()) < upper):
        return []
    bad = np.flatnonzero((idx < 0) | (idx >= upper))
    if not bad.size:
        return []
    pos = int(bad[0])
    return [Violation(
        field, IndexOutOfRange.reason,
        f"{field}: {bad.size} index(es) outside [0, {upper}); first {int(idx[pos])} at "
        f"position {pos}",
        {"count": int(bad.size), "first_bad_position": pos, "first_bad_value": int(idx[pos]),
         "upper_bound": upper},
    )]


def check_duplicate_pages(pages: IndexArray, page_size: int, field: str) -> list[Violation]:
    """No page twice in one batch (two writes to one page would race)."""
    if pages.size < 2:
        return []
    sorted_pages = np.sort(pages)
    if not (sorted_pages[1:] == sorted_pages[:-1]).any():
        return []
    order = np.argsort(pages, kind="stable")
    sorted_pages = pages[order]
    dup = np.flatnonzero(sorted_pages[1:] == sorted_pages[:-1])
    page = int(sorted_pages[dup[0]])
    pos = int(order[dup[0] + 1]) * page_size
    return [Violation(
        field, DuplicatePage.reason,
        f"{field}: page {page} appears more than once (again at position {pos})",
        {"page": page, "first_bad_position": pos, "duplicates": int(dup.size)},
    )]


def check_layers(layer_begin: int, layer_end: int, layer_num: int) -> tuple[list[Violation],
                                                                            range]:
    """``[layer_begin, layer_end)``; the empty range (0, 0) means all layers."""
    if layer_begin == 0 and layer_end == 0:
        return [], range(layer_num)
    if 0 <= layer_begin < layer_end <= layer_num:
        return [], range(layer_begin, layer_end)
    return [Violation(
        "layer_begin", LayerOutOfRange.reason,
        f"layer range [{layer_begin}, {layer_end}) is not within [0, {layer_num})",
        {"layer_begin": layer_begin, "layer_end": layer_end, "layer_num": layer_num},
    )], range(0)


RawState = Callable[[IndexArray, range | None],
                    tuple[np.ndarray, np.ndarray | None, np.ndarray]]
"""The allocator's ``raw_state``: (allocated raw, written at the layers or None, generations)."""


@dataclass(frozen=True)
class TransferBatch:
    """A validated batch, as page numbers on each side."""

    host_pages: IndexArray
    device_pages: IndexArray
    layers: range
    host_unique: bool = True
    """No host page twice (always so for a backup; a load may read one page twice)."""
    bounds: tuple[tuple[int, int], tuple[int, int]] | None = None
    """``page_bounds()`` when the validation already found them."""
    generations: np.ndarray | None = None
    """Of raw host pages, as validated: the copy uses them only if they are unchanged."""

    @property
    def num_pages(self) -> int:
        return int(self.host_pages.size)

    def page_bounds(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """((host min, host max), (device min, device max)) page numbers; (0, 0) if empty."""
        if self.bounds is not None:
            return self.bounds
        if not self.host_pages.size:
            return (0, 0), (0, 0)
        return ((int(self.host_pages.min()), int(self.host_pages.max())),
                (int(self.device_pages.min()), int(self.device_pages.max())))


def _first_bad(mask: np.ndarray) -> np.ndarray:
    """Positions where ``mask`` is False (empty, cheaply, when all are True)."""
    return np.zeros(0, np.int64) if mask.all() else np.flatnonzero(~mask)


def check_host_pages(pages: IndexArray, layers: range, writes_host: bool, raw_state: RawState,
                     field: str, scale: int) -> tuple[list[Violation], np.ndarray]:
    """A raw batch's host pages, in range, against the allocator (``raw_state``, one step):
    every one allocated raw (``PAGE_NOT_ALLOCATED``), and for a load written at ``layers``
    (``PAGE_NOT_WRITTEN``). (violations, the pages' generations); a violation's position is
    the page's times ``scale`` (its token index where ``field`` holds token indices)."""
    allocated, written, generations = raw_state(
        pages, None if writes_host or not len(layers) else layers)
    reason, what = PageNotAllocated.reason, "are not allocated raw pages"
    bad = _first_bad(allocated)
    if not bad.size and written is not None:
        bad = _first_bad(written)
        reason, what = PageNotWritten.reason, (f"were never written at layers [{layers.start}"
                                               f", {layers.stop}) since they were allocated")
    if not bad.size:
        return [], generations
    pos = int(bad[0])
    return [Violation(
        field, reason,
        f"{bad.size} host page(s) {what}; first page {int(pages[pos])} at position "
        f"{pos * scale}",
        {"count": int(bad.size), "first_bad_position": pos * scale, "page": int(pages[pos])},
    )], generations


def _device_side(d: IndexArray, page_size: int, device_tokens: int, loading: bool
                 ) -> tuple[list[Violation], list[Violation], list[Violation], IndexArray]:
    """(page-run, range, duplicate violations, device pages): whole in-range pages, and a
    load's destinations unique."""
    dp = page_numbers(d, page_size)
    dups = check_duplicate_pages(dp, page_size, "device_indices") if loading else []
    return (check_page_runs(d, page_size, "device_indices"),
            check_range(d, device_tokens, "device_indices"), dups, dp)


def validate_transfer(
    *,
    host_indices: object,
    device_indices: object,
    page_size: int,
    host_tokens: int,
    device_tokens: int,
    layer_num: int,
    layer_begin: int,
    layer_end: int,
    writes_host: bool,
    raw_state: RawState,
) -> TransferBatch:
    """Check a whole backup (``writes_host``) or load batch of raw pages; raise with every
    violation. A load's host pages must have every requested layer written. ``raw_state`` is
    the allocator's (one step: allocated, written, generations), whose generations the batch
    carries."""
    h = to_index_array(host_indices, "host_indices")
    d = to_index_array(device_indices, "device_indices")
    violations: list[Violation] = []
    if h.size != d.size:
        violations.append(Violation(
            "device_indices", IndexCountMismatch.reason,
            f"{h.size} host indices but {d.size} device indices",
            {"host_count": int(h.size), "device_count": int(d.size)},
        ))
    layer_violations, layers = check_layers(layer_begin, layer_end, layer_num)
    h_runs = check_page_runs(h, page_size, "host_indices")
    h_range = check_range(h, host_tokens, "host_indices")
    d_runs, d_range, d_dups, dp = _device_side(d, page_size, device_tokens, not writes_host)
    violations += h_runs + d_runs + h_range + d_range + layer_violations + d_dups
    hp = page_numbers(h, page_size)
    if writes_host:
        violations += check_duplicate_pages(hp, page_size, "host_indices")
    host_unique = writes_host or not check_duplicate_pages(hp, page_size, "host_indices")
    generations = None
    if not h_range and hp.size:
        host, generations = check_host_pages(hp, layers, writes_host, raw_state,
                                             "host_indices", page_size)
        violations += host
    raise_violations(violations)
    return TransferBatch(hp, dp, layers, host_unique, generations=generations)


def validate_keyed(
    *,
    keys: int,
    device_indices: object,
    page_size: int,
    device_tokens: int,
    layer_num: int,
    layer_begin: int,
    layer_end: int,
    writes_host: bool,
) -> tuple[IndexArray, range]:
    """Check the device side of a Store (``writes_host``) or LoadKeys of ``keys`` keys: one
    whole page per key, in range, a load's destinations unique; a store covers every layer
    (a keyed page is whole). Returns (device pages, layers)."""
    d = to_index_array(device_indices, "device_indices")
    d_runs, d_range, d_dups, dp = _device_side(d, page_size, device_tokens, not writes_host)
    violations = d_runs + d_range + d_dups
    if d.size != keys * page_size:
        violations.append(Violation(
            "device_indices", IndexCountMismatch.reason,
            f"{keys} key(s) need {keys * page_size} device indices ({page_size} per key), "
            f"got {d.size}",
            {"key_count": keys, "device_count": int(d.size), "page_size": page_size},
        ))
    layer_violations, layers = check_keyed_layers(layer_begin, layer_end, layer_num,
                                                  writes_host)
    raise_violations(violations + layer_violations)
    return dp, layers


def check_keyed_layers(layer_begin: int, layer_end: int, layer_num: int, store: bool
                       ) -> tuple[list[Violation], range]:
    """``check_layers``, and a Store over every layer (a keyed page is whole)."""
    violations, layers = check_layers(layer_begin, layer_end, layer_num)
    if store and not violations and len(layers) != layer_num:
        violations = [Violation(
            "layer_begin", LayerOutOfRange.reason,
            f"a Store writes whole pages: the layer range must be all layers [0, {layer_num}) "
            f"(or 0, 0), got [{layer_begin}, {layer_end})",
            {"layer_begin": layer_begin, "layer_end": layer_end, "layer_num": layer_num},
        )]
    return violations, layers
