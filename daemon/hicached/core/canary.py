"""kv-canary in the host tier: per-(page, layer) fingerprints recorded on backup, verified on load.

A fingerprint hashes the first ``read_bytes`` of every unit row (token, or page for DSA) of every
component of a page at one layer, each 64-bit word salted with its position, so a changed byte,
a swapped token or a swapped K/V row all change it. A mismatch on load is ``CANARY_MISMATCH``
naming the pages, raised before any byte is copied to the device.

Primitives:

- ``CanaryTable(page_num, layer_num, read_bytes)``: ``record``, ``verify``, ``forget``.
- ``fingerprints(words, row_word_offsets, read_words)``: the vectorized hash.

Everything is numpy over the whole batch; nothing loops over tokens.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hicache.errors import CanaryMismatch
from hicache.locks import lock
from hicached.core.state_file import TableSpec

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """Vectorized splitmix64 finalizer (wrapping uint64 arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def fingerprints(words: np.ndarray, row_word_offsets: np.ndarray, read_words: int,
                 salt: int) -> np.ndarray:
    """Hash rows: ``row_word_offsets`` has shape (..., rows); returns shape (...) uint64.

    ``words`` is the pool region viewed as uint64; each row contributes its first
    ``read_words`` words, salted by (row position, word position, ``salt``).
    """
    rows = row_word_offsets.shape[-1]
    gathered = words[row_word_offsets[..., None] + np.arange(read_words, dtype=np.int64)]
    pos = np.arange(rows * read_words, dtype=np.uint64).reshape(rows, read_words)
    with np.errstate(over="ignore"):
        salted = gathered ^ ((pos + np.uint64(1) + np.uint64(salt) * np.uint64(1 << 32)) * _GOLDEN)
        mixed = splitmix64(salted)
        return np.asarray(mixed.sum(axis=(-2, -1), dtype=np.uint64), dtype=np.uint64)


class CanaryTable:
    """Recorded fingerprints per (page, layer); unrecorded entries are not verified."""

    def __init__(self, page_num: int, layer_num: int, read_bytes: int,
                 tables: Mapping[str, np.ndarray] | None = None) -> None:
        """``tables``: views of a state file (``table_specs``) holding the fingerprints, so
        that re-attached pages are verified on their first load; zeroed arrays when None."""
        self.read_bytes = read_bytes
        t = tables or {}
        self._fp = t.get("canary_fp", np.zeros((page_num, layer_num), dtype=np.uint64))
        self._valid = t.get("canary_valid", np.zeros((page_num, layer_num), dtype=bool))
        self._lock = lock("canary")
        self.verified_pages = 0
        self.mismatched_pages = 0

    @staticmethod
    def table_specs(page_num: int, layer_num: int) -> list[TableSpec]:
        return [TableSpec("canary_fp", "<u8", (page_num, layer_num)),
                TableSpec("canary_valid", "?", (page_num, layer_num))]

    @staticmethod
    def bytes_per_page(layer_num: int) -> int:
        """Host bytes per page: a fingerprint and a valid flag per layer."""
        return 9 * layer_num

    @property
    def nbytes(self) -> int:
        return int(self._fp.nbytes + self._valid.nbytes)

    def record(self, pages: np.ndarray, layers: range, fps: np.ndarray) -> None:
        """Store ``fps`` of shape (len(pages), len(layers))."""
        sl = slice(layers.start, layers.stop)
        with self._lock:
            self._fp[pages, sl] = fps
            self._valid[pages, sl] = True

    def verify(self, pages: np.ndarray, layers: range, fps: np.ndarray) -> None:
        """Raise ``CanaryMismatch`` naming every page whose recorded fingerprint differs."""
        sl = slice(layers.start, layers.stop)
        with self._lock:
            valid = self._valid[pages, sl]
            bad = (self._fp[pages, sl] != fps) & valid
            bad_rows = np.flatnonzero(bad.any(axis=1))
            checked = int(valid.any(axis=1).sum())
            self.verified_pages += checked - int(bad_rows.size)
            self.mismatched_pages += int(bad_rows.size)
        if bad_rows.size:
            first = int(bad_rows[0])
            layer = layers.start + int(np.flatnonzero(bad[first])[0])
            shown = [int(p) for p in pages[bad_rows[:16]]]
            raise CanaryMismatch(
                f"{bad_rows.size} host page(s) changed since they were backed up: {shown}"
                + (" ..." if bad_rows.size > 16 else ""),
                metadata={"pages": ",".join(map(str, shown)), "count": int(bad_rows.size),
                          "first_page": int(pages[first]), "first_layer": layer},
            )

    def forget(self, pages: np.ndarray) -> None:
        with self._lock:
            self._valid[pages] = False
