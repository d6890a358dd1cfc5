"""Which key each page holds, in a table a restarted daemon can trust.

One slot per page of the pool, in the pool's state file (``core.state_file``): state, key
length, a store sequence number, a crc32 and the key (at most 64 bytes). A slot says READY
only after the page's bytes are complete: ``ready`` writes key, length, sequence and crc first
and the state word last (one aligned 4-byte store), ``clear`` writes the state word first. So
a daemon killed at any instant leaves every page either READY with a complete key and complete
bytes, or not READY (dropped on restart, never served). The crc makes a slot damaged by any
other write detectable: it is dropped too.

Primitives:

- ``SLOT``: the slot's numpy dtype; ``table_spec(page_num)``.
- ``KeySlots(table)``: ``ready(pages, keys)``, ``clear(pages)``, ``scan()`` -> the READY
  slots whose crc holds, as (page, key, seq), plus how many were dropped as damaged.
  ``KeySlots(None)`` keeps nothing (pools without a state directory).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from hicache.keys import MAX_KEY_BYTES
from hicached.core.state_file import TableSpec

FREE, READY = 0, 1

SLOT = np.dtype([("state", "<u4"), ("key_len", "<u4"), ("seq", "<u8"), ("crc", "<u4"),
                 ("pad", "<u4"), ("key", "u1", (MAX_KEY_BYTES,))])


def table_spec(page_num: int) -> TableSpec:
    return TableSpec("key_slots", SLOT, (page_num,))


def _crc(page: int, key: bytes, seq: int) -> int:
    return zlib.crc32(key, zlib.crc32(page.to_bytes(8, "little") + seq.to_bytes(8, "little")))


class KeySlots:
    def __init__(self, table: np.ndarray | None) -> None:
        self._t = table
        self.seq = 0
        """The last store sequence number handed out."""

    def ready(self, pages: Sequence[int], keys: Sequence[bytes]) -> None:
        """Record that ``pages`` now hold ``keys`` completely (their bytes are in place)."""
        t = self._t
        if t is None or not len(pages):
            return
        n = len(pages)
        if n == 1:  # a 1-page Store: field by field through the row, no temporary arrays
            page, key = int(pages[0]), keys[0]
            self.seq += 1
            row = t[page]  # a structured scalar: a view of the table's row
            row["key"][:len(key)] = np.frombuffer(key, dtype=np.uint8)
            row["key"][len(key):] = 0
            row["key_len"] = len(key)
            row["seq"] = self.seq
            row["crc"] = _crc(page, key, self.seq)
            row["state"] = READY  # last: the slot is complete before it says so
            return
        idx = np.asarray(pages, dtype=np.int64)
        seqs = np.arange(self.seq + 1, self.seq + 1 + n, dtype=np.uint64)
        self.seq += n
        mat = np.zeros((n, MAX_KEY_BYTES), dtype=np.uint8)
        for i, k in enumerate(keys):
            mat[i, :len(k)] = np.frombuffer(k, dtype=np.uint8)
        t["key"][idx] = mat
        t["key_len"][idx] = [len(k) for k in keys]
        t["seq"][idx] = seqs
        t["crc"][idx] = [_crc(int(p), k, int(s))
                         for p, k, s in zip(idx.tolist(), keys, seqs.tolist(), strict=True)]
        t["state"][idx] = READY  # last: the slot is complete before it says so

    def clear(self, pages: np.ndarray) -> None:
        """The pages no longer hold their keys (removed, evicted, never completed)."""
        if self._t is not None and pages.size:
            self._t["state"][pages] = FREE  # first: a restart never finds a page being freed

    def scan(self) -> tuple[list[tuple[int, bytes, int]], int]:
        """READY slots whose crc holds, as (page, key, seq), and how many were damaged.
        Moves ``seq`` past every sequence number found."""
        t = self._t
        if t is None:
            return [], 0
        pages = np.flatnonzero(t["state"] == READY)
        out: list[tuple[int, bytes, int]] = []
        damaged = 0
        for page in pages.tolist():
            slot = t[page]
            n = int(slot["key_len"])
            key = bytes(slot["key"][:n]) if 0 < n <= MAX_KEY_BYTES else b""
            seq = int(slot["seq"])
            if not key or _crc(page, key, seq) != int(slot["crc"]):
                damaged += 1
                t["state"][page] = FREE
                continue
            out.append((page, key, seq))
        self.seq = max([self.seq, *(s for _, _, s in out)])
        return out, damaged
