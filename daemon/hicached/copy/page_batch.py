"""Validating batches of page ids (the fast path's form), natively where the kernel is built.

A batch the fast path sends names pages, not token indices: there is no page run to check, only
the range, the duplicates a copy cannot have and, for raw pages, their allocation. The same
reason codes as the token-index checks (``core.validation``), on fields ``host_pages`` and
``device_pages``, collecting every violation before any byte moves.

Primitives:

- ``scan(pages, upper, field, unique)``: (violations, (min, max)): ``INDEX_OUT_OF_RANGE`` and,
  when ``unique``, ``DUPLICATE_PAGE``; one native pass (``scan_pages``), numpy without it.
- ``validate_page_transfer(...)``: a raw Backup or Load by page ids: both sides, the count,
  the layers, and the host pages allocated (and, for a load, written); a ``TransferBatch``.
- ``validate_keyed_pages(...)``: the device side of a Store or LoadKeys by page ids.
"""

from __future__ import annotations

import numpy as np

from hicache.errors import (
    DuplicatePage,
    IndexCountMismatch,
    IndexOutOfRange,
    Violation,
    raise_violations,
)
from hicache.indices import IndexArray
from hicached.copy.native import KERNEL
from hicached.core.allocator import PageAllocator
from hicached.core.validation import (
    TransferBatch,
    check_host_pages,
    check_keyed_layers,
    check_layers,
)

Bounds = tuple[int, int]


def scan(pages: IndexArray, upper: int, field: str, unique: bool
         ) -> tuple[list[Violation], Bounds]:
    """Every page in [0, upper) and, with ``unique``, none twice; (violations, (min, max))."""
    if KERNEL is not None:
        bad, nbad, rep, dups, lo, hi = KERNEL.scan_pages(pages, upper, unique)
    else:
        bad, nbad, rep, dups, lo, hi = _scan_numpy(pages, upper, unique)
    out: list[Violation] = []
    if bad >= 0:
        out.append(Violation(
            field, IndexOutOfRange.reason,
            f"{field}: {nbad} page(s) outside [0, {upper}); first {int(pages[bad])} at "
            f"position {bad}",
            {"count": nbad, "first_bad_position": bad, "first_bad_value": int(pages[bad]),
             "upper_bound": upper}))
    if rep >= 0:
        out.append(Violation(
            field, DuplicatePage.reason,
            f"{field}: page {int(pages[rep])} appears more than once (again at position {rep})",
            {"page": int(pages[rep]), "first_bad_position": rep, "duplicates": dups}))
    return out, (lo, hi)


def _scan_numpy(pages: IndexArray, upper: int, unique: bool
                ) -> tuple[int, int, int, int, int, int]:
    """``scan_pages`` without the kernel."""
    if not pages.size:
        return -1, 0, -1, 0, 0, 0
    outside = np.flatnonzero((pages < 0) | (pages >= upper))
    bad, nbad = (int(outside[0]), int(outside.size)) if outside.size else (-1, 0)
    rep, dups = -1, 0
    if unique and bad < 0 and pages.size > 1:
        _, first = np.unique(pages, return_index=True)
        repeat = np.ones(pages.size, bool)
        repeat[first] = False
        at = np.flatnonzero(repeat)
        rep, dups = (int(at[0]), int(at.size)) if at.size else (-1, 0)
    return bad, nbad, rep, dups, int(pages.min()), int(pages.max())


def validate_page_transfer(*, host_pages: IndexArray, device_pages: IndexArray,
                           allocator: PageAllocator, device_page_num: int, layer_num: int,
                           layer_begin: int, layer_end: int, writes_host: bool
                           ) -> TransferBatch:
    """Check a raw Backup (``writes_host``) or Load by page ids; raise with every violation."""
    violations: list[Violation] = []
    if host_pages.size != device_pages.size:
        violations.append(Violation(
            "device_pages", IndexCountMismatch.reason,
            f"{host_pages.size} host pages but {device_pages.size} device pages",
            {"host_count": int(host_pages.size), "device_count": int(device_pages.size)}))
    layer_violations, layers = check_layers(layer_begin, layer_end, layer_num)
    h_bad, h_bounds = scan(host_pages, allocator.page_num, "host_pages", writes_host)
    d_bad, d_bounds = scan(device_pages, device_page_num, "device_pages", not writes_host)
    # in the token-index checks' order: ranges, layers, then duplicates (device, host)
    dup = DuplicatePage.reason
    violations += [v for v in h_bad + d_bad if v.reason != dup] + layer_violations
    violations += [v for v in d_bad + h_bad if v.reason == dup]
    host_unique = writes_host
    if not writes_host and not h_bad and host_pages.size > 1:
        host_unique = not scan(host_pages, allocator.page_num, "host_pages", True)[0]
    in_range = not any(v.reason == IndexOutOfRange.reason for v in h_bad)
    generations = None
    if in_range and host_pages.size:
        host, generations = check_host_pages(host_pages, layers, writes_host,
                                             allocator.raw_state, "host_pages", 1)
        violations += host
    raise_violations(violations)
    return TransferBatch(host_pages, device_pages, layers, host_unique,
                         bounds=(h_bounds, d_bounds), generations=generations)


def validate_keyed_pages(*, keys: int, device_pages: IndexArray, device_page_num: int,
                         layer_num: int, layer_begin: int, layer_end: int, writes_host: bool
                         ) -> tuple[IndexArray, range]:
    """The device side of a Store (``writes_host``) or LoadKeys of ``keys`` keys by page ids:
    one page per key, in range, a load's destinations unique, a store over every layer."""
    violations, _ = scan(device_pages, device_page_num, "device_pages", not writes_host)
    if device_pages.size != keys:
        violations.append(Violation(
            "device_pages", IndexCountMismatch.reason,
            f"{keys} key(s) need {keys} device pages, got {device_pages.size}",
            {"key_count": keys, "device_count": int(device_pages.size)}))
    layer_violations, layers = check_keyed_layers(layer_begin, layer_end, layer_num,
                                                  writes_host)
    raise_violations(violations + layer_violations)
    return device_pages, layers
