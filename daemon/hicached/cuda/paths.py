"""Which way a batch's bytes go between a GPU and the host pool, chosen per batch by what each
way measured.

The ways (``Path``):

- ``dma``: the copy engines, one driver call per run of pages, layer and component
  (``segments``): always there, the fallback.
- ``batch``: the same copies in one ``cuMemcpyBatchAsync`` call per launch group, where the
  driver has it (CUDA 12.8).
- ``kernel``: the page kernel (``pages.cu``), one launch per launch group, SM copies over the
  mapped pool, where NVRTC compiled it and the device can run it.

``CopyPaths`` keeps, per direction and size class (a fragment's bytes: a page of one layer
and component, by powers of two), each allowed way's recent rate (an exponentially weighted
mean of bytes per second, measured on the device between two events around the batch). A
batch takes the fastest; a way not yet measured ``WARMUP`` times in a class is tried first,
and every ``EXPLORE``-th batch of a class tries the fastest other one, so a rate that
changed (another tenant's load, a driver update) is seen again.

Primitives: ``Path``; ``size_class(fragment_bytes)``; ``CopyPaths(allowed)``:
``choose(loading, fragment_bytes, usable)``, ``count(path, loading, nbytes)`` (every batch
enqueued), ``record(path, loading, fragment_bytes, nbytes, seconds)`` (a measured one),
``rates()`` and ``counts()`` (for metrics and ``hicache-bench``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from hicache.locks import lock

WARMUP = 3
"""Measurements of each allowed way per class before the fastest is taken."""
EXPLORE = 32
"""Every this many batches of a class, the fastest other way runs instead."""
WEIGHT = 0.2
"""Of a new measurement in a way's mean rate."""


class Path(enum.StrEnum):
    DMA = "dma"
    BATCH = "batch"
    KERNEL = "kernel"


def size_class(fragment_bytes: int) -> int:
    """A fragment's size class: floor(log2(bytes))."""
    return max(int(fragment_bytes), 1).bit_length() - 1


class CopyPaths:
    """Measured rates and the choice they lead to (thread-safe: one lock)."""

    def __init__(self, allowed: Iterable[Path]) -> None:
        self.allowed = tuple(dict.fromkeys(allowed)) or (Path.DMA,)
        self._lock = lock("cuda.paths")
        self._rate: dict[tuple[bool, int, Path], float] = {}
        self._seen: dict[tuple[bool, int, Path], int] = {}
        self._batches: dict[tuple[bool, int], int] = {}
        self._counts: dict[tuple[bool, Path], list[int]] = {}

    def choose(self, loading: bool, fragment_bytes: int, usable: Iterable[Path]) -> Path:
        """The way for a batch of fragments of ``fragment_bytes`` among ``usable`` (those
        the session's device has); ``Path.DMA`` when no allowed one is usable."""
        have = set(usable)
        ways = [p for p in self.allowed if p in have]
        if not ways:
            return Path.DMA
        if len(ways) == 1:
            return ways[0]
        cls = size_class(fragment_bytes)
        with self._lock:
            n = self._batches.get((loading, cls), 0) + 1
            self._batches[(loading, cls)] = n
            for p in ways:
                if self._seen.get((loading, cls, p), 0) < WARMUP:
                    return p
            ranked = sorted(ways, key=lambda p: -self._rate[(loading, cls, p)])
            return ranked[1] if n % EXPLORE == 0 else ranked[0]

    def record(self, path: Path, loading: bool, fragment_bytes: int, nbytes: int,
               seconds: float) -> None:
        """A batch of ``nbytes`` took ``seconds`` on the device by ``path``."""
        if seconds <= 0 or nbytes <= 0:
            return
        key = (loading, size_class(fragment_bytes), path)
        rate = nbytes / seconds
        with self._lock:
            old = self._rate.get(key)
            self._rate[key] = rate if old is None else old + WEIGHT * (rate - old)
            self._seen[key] = self._seen.get(key, 0) + 1

    def count(self, path: Path, loading: bool, nbytes: int) -> None:
        """A batch of ``nbytes`` was enqueued by ``path``."""
        with self._lock:
            got = self._counts.setdefault((loading, path), [0, 0])
            got[0] += 1
            got[1] += nbytes

    def counts(self) -> dict[tuple[bool, Path], tuple[int, int]]:
        """(loading, way) -> (batches, bytes) enqueued so far."""
        with self._lock:
            return {k: (v[0], v[1]) for k, v in self._counts.items()}

    def rates(self) -> dict[tuple[bool, int, Path], float]:
        """(loading, size class, way) -> its mean rate in bytes per second."""
        with self._lock:
            return dict(self._rate)
