"""Where a host region's page-locked registrations meet, and which one an address lies in.

The CUDA driver refuses a copy whose host side spans two registrations, or locked and unlocked
memory (``CUDA_ERROR_INVALID_VALUE``). A pool is locked in several where it is large (1 GiB
chunks) or elastic (``pin_units``), so copies to and from a GPU are cut where one may end and
the next begin: its *seams*. Finding the registration of each of thousands of copies must cost
little next to enqueueing them: a bucket table (at most ``MAX_BUCKETS`` entries over the
region) answers for every address whose bucket holds no seam, and a binary search over the
seams only for the few that do.

Primitives: ``Registrations(seams, base, nbytes)``: ``seams`` (addresses, ascending),
``index(addresses)`` (how many seams lie at or below each: equal indices, one registration);
``Registrations.none()`` for a region locked as one or not at all.
"""

from __future__ import annotations

import numpy as np

MAX_BUCKETS = 1 << 17
"""The bucket table's most entries (512 KiB of int32): with at most a few thousand seams, at
most a few percent of buckets hold one."""
MIN_BUCKET_SHIFT = 12
"""Buckets are an OS page or more."""


class Registrations:
    """The seams of one host region's registrations (see the module's docstring). Immutable
    once made: the seams are where registrations *may* meet, fixed when the pool is made."""

    def __init__(self, seams: np.ndarray, base: int, nbytes: int) -> None:
        self.seams = np.ascontiguousarray(seams, dtype=np.int64)
        if self.seams.size and (np.diff(self.seams) <= 0).any():
            raise ValueError("seams must be strictly ascending")
        self._base = base
        shift = MIN_BUCKET_SHIFT
        while (nbytes >> shift) >= MAX_BUCKETS:
            shift += 1
        self._shift = shift
        buckets = max(-(-nbytes // (1 << shift)), 1)
        starts = base + (np.arange(buckets, dtype=np.int64) << shift)
        ends = starts + (1 << shift) - 1
        lo = np.searchsorted(self.seams, starts, "right")
        hi = np.searchsorted(self.seams, ends, "right")
        self._table = np.where(lo == hi, lo, -1).astype(np.int32)
        """Each bucket's registration index, or -1 where a seam falls inside the bucket."""

    @staticmethod
    def none() -> Registrations:
        """A region with no seam (locked as one registration, or not locked)."""
        return Registrations(np.zeros(0, dtype=np.int64), 0, 0)

    def __bool__(self) -> bool:
        return bool(self.seams.size)

    def index(self, addresses: np.ndarray) -> np.ndarray:
        """How many seams lie at or below each address of the region (int64): two addresses
        are in one registration when their indices are equal."""
        if not self.seams.size:
            return np.zeros(addresses.shape, dtype=np.int64)
        b = (addresses - self._base) >> self._shift
        outside = np.flatnonzero((b < 0) | (b >= self._table.size))
        if outside.size:  # never for a pool's own addresses; still answered right
            b[outside] = 0
        idx = self._table[b].astype(np.int64)
        miss = np.flatnonzero(idx < 0)
        if outside.size:
            miss = np.union1d(miss, outside)
        if miss.size:
            idx[miss] = np.searchsorted(self.seams, addresses[miss], "right")
        return idx  # type: ignore[no-any-return]
