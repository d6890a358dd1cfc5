"""A pool's disk tier: keyed pages below host memory, checksummed, LRU within a capacity.

Pages are written from and read into the pool's own memory (``disk_io``). A key is visible
only once its page and then its record are written (the page first made durable with
``fsync = "batch"``); a read whose checksum fails drops the key and counts it, and is never
served. The index survives restarts: ``open()`` rebuilds it from the records whose crc holds
(least recently stored first), or starts cold (files replaced, the reason logged) when the
header names another format, pool or geometry.

Primitives:

- ``DiskTier(directory, name, doc, page_bytes, capacity_pages, o_direct, fsync)``: ``open()``
  -> "created" | "reattached" | "cold: <why>"; ``contains(key)``; ``write(key, buffers)`` ->
  stored (or already there); ``read_into(key, buffers)`` -> exact bytes landed;
  ``read_many`` / ``write_many`` (several pages, ``io_threads`` at once);
  ``hold(keys)`` -> the keys held here (a held key is never evicted for room, until
  ``release(keys)``: a Lookup's hit on disk, kept until its promotion lands); ``forget(keys)``
  (the index, at once, no I/O) then
  ``erase(slots)`` (their records, outside every lock); ``close()``; ``remove_files()``;
  ``stats``; ``keys``; ``snapshot()`` (every key). The page I/O is ``disk_io.PageFile``'s;
  ``open`` reserves the files' blocks (``preallocate``), so a full filesystem refuses the tier
  at once (``DiskTierUnavailable``) instead of failing every spill. ``events``: the pool's
  log, told (under the index's lock) of each key committed, dropped for room or a bad read
  (EVICTED) and removed.

Thread-safe: one lock guards the index; I/O runs outside it. A slot being read is never
reused until the read ends.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from hicache import seams
from hicache.locks import lock
from hicache.log_limit import LimitedLog
from hicache.paths import remove_if_there
from hicached.cache.events import DISK, EventKind, EventLog
from hicached.core.trusted_paths import UntrustedPath, open_own, own_dir, untrusted_file
from hicached.tiers import disk_format as fmt
from hicached.tiers.disk_io import DiskTierUnavailable, PageFile, reserve

log = logging.getLogger(__name__)
_limited = LimitedLog(log)


@dataclass
class DiskStats:
    writes: int = 0
    reads: int = 0
    checksum_failures: int = 0
    write_errors: int = 0
    evicted: int = 0
    not_committed: int = 0
    """Pages written whose key was removed meanwhile: their record never written."""


class DiskTier:
    tier = DISK

    def __init__(self, directory: str, name: str, doc: dict[str, Any], page_bytes: int,
                 capacity_pages: int, *, o_direct: bool = False, fsync: str = "batch",
                 observe: Callable[[str, float], None] = lambda op, seconds: None,
                 io_threads: int = 2, preallocate: bool = True) -> None:
        """``io_threads``: pages of one ``read_many`` / ``write_many`` moved at once (reads,
        writes and checksums release the GIL); ``preallocate``: reserve the files' blocks at
        ``open`` (``DiskTierUnavailable`` there when the filesystem lacks the space)."""
        self.directory, self.name = directory, name
        self.page_bytes = page_bytes
        self.slot_bytes = fmt.slot_bytes(page_bytes)
        self.capacity = capacity_pages
        self.o_direct, self.fsync, self.preallocate = o_direct, fsync, preallocate
        self.doc = {**doc, "page_bytes": page_bytes, "slots": capacity_pages}
        self.stats = DiskStats()
        self._observe = observe
        self._lock = lock("tier.disk")
        self._index: OrderedDict[bytes, int] = OrderedDict()
        """Key -> slot, least recently used first."""
        self._digest: dict[int, int] = {}
        self._free: list[int] = []
        self._reading: dict[int, int] = {}
        self._held: dict[bytes, int] = {}
        """Keys a Lookup's hit holds until its promotion lands (counted): not evicted."""
        self._deferred: set[int] = set()
        self._writing: set[bytes] = set()
        self._seq = 0
        self._data_fd = self._index_fd = -1
        self._pages: PageFile | None = None
        self.last_error = ""
        """The latest write error (``Spiller`` backs off on it)."""
        self._erasing: set[int] = set()
        """Slots of removed keys whose records are being erased (not reusable yet)."""
        self.events = EventLog()
        self._io = ThreadPoolExecutor(max(io_threads, 1), thread_name_prefix=f"disk-{name}")
        self.pages_path = os.path.join(directory, f"{name}.pages")
        self.index_path = os.path.join(directory, f"{name}.index")

    # -- files -----------------------------------------------------------------------------

    def open(self) -> str:
        """Its files re-attached or created (in a directory only the daemon's user may use,
        never through a symlink, never another user's files: ``DiskTierUnavailable``)."""
        try:
            own_dir(self.directory)
            outcome = self._scan()
            if outcome != "reattached":
                if outcome != "created":
                    log.warning("disk tier of pool %s starts cold: %s", self.name, outcome)
                self.remove_files()
                fd = open_own(self.index_path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
                os.ftruncate(fd, fmt.HEADER_BYTES + self.capacity * fmt.RECORD_BYTES)
                os.pwrite(fd, fmt.header_bytes(self.doc), 0)
                os.close(fd)
                os.close(open_own(self.pages_path, os.O_RDWR | os.O_CREAT | os.O_EXCL))
                os.truncate(self.pages_path, self.capacity * self.slot_bytes)
                self._index.clear()
                self._free = list(range(self.capacity - 1, -1, -1))
            direct = getattr(os, "O_DIRECT", 0) if self.o_direct else 0
            self._data_fd = open_own(self.pages_path, os.O_RDWR | direct)
            self._index_fd = open_own(self.index_path, os.O_RDWR)
        except UntrustedPath as exc:
            self._close_fds()
            raise DiskTierUnavailable(errno.EACCES, f"disk tier of pool {self.name}: {exc}"
                                      ) from exc
        self._pages = PageFile(self._data_fd, self.page_bytes, self.slot_bytes, self.o_direct)
        if self.preallocate:
            self._reserve(created=outcome != "reattached")
        return outcome

    def _reserve(self, created: bool) -> None:
        """Every block of both files allocated now (``disk_io.reserve``): files it just
        created are removed when there is no room; saved ones are kept for a start with more."""
        try:
            reserve(self._index_fd, fmt.HEADER_BYTES + self.capacity * fmt.RECORD_BYTES,
                    self.directory, self.name)
            reserve(self._data_fd, self.capacity * self.slot_bytes, self.directory, self.name)
        except DiskTierUnavailable:
            if created:
                self.remove_files()
            else:
                self._close_fds()
            raise

    def _scan(self) -> str:
        for path in (self.index_path, self.pages_path):
            try:
                why = untrusted_file(os.lstat(path))
            except FileNotFoundError:
                continue
            if why:
                return f"cold: {os.path.basename(path)} is {why}"
        try:
            with open(self.index_path, "rb") as f:
                doc, why = fmt.parse_header(f.read(fmt.HEADER_BYTES))
                if doc is None:
                    return f"cold: {why}"
                if doc != self.doc:
                    return "cold: saved for another pool spec, page size or capacity"
                raw = f.read(self.capacity * fmt.RECORD_BYTES)
            if os.path.getsize(self.pages_path) != self.capacity * self.slot_bytes:
                return "cold: the page file has another size"
        except FileNotFoundError:
            return "created"
        found: list[tuple[int, bytes, int, int]] = []
        used = set()
        for slot in range(min(self.capacity, len(raw) // fmt.RECORD_BYTES)):
            rec = fmt.parse_record(raw[slot * fmt.RECORD_BYTES:(slot + 1) * fmt.RECORD_BYTES])
            if rec is not None:
                found.append((rec[1], rec[0], slot, rec[2]))
        for seq, key, slot, digest in sorted(found):
            if key in self._index:  # an older copy of a key stored again: the newer wins
                used.discard(self._index[key])
            self._index[key], self._digest[slot] = slot, digest
            self._index.move_to_end(key)
            used.add(slot)
            self._seq = max(self._seq, seq)
        self._free = [s for s in range(self.capacity - 1, -1, -1) if s not in used]
        return "reattached"

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self._close_fds()

    def _close_fds(self) -> None:
        for fd in (self._data_fd, self._index_fd):
            if fd >= 0:
                os.close(fd)
        self._data_fd = self._index_fd = -1

    def remove_files(self) -> None:
        self._close_fds()
        for path in (self.pages_path, self.index_path):
            remove_if_there(path)

    # -- queries ---------------------------------------------------------------------------

    @property
    def errors(self) -> int:  # writes that failed with an I/O error, in all
        return self.stats.write_errors

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    @property
    def keys(self) -> int:
        with self._lock:
            return len(self._index)

    def snapshot(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    # -- write -----------------------------------------------------------------------------

    def write(self, key: bytes, buffers: Sequence[memoryview],
              still_wanted: Callable[[bytes], bool] | None = None) -> bool:
        """Write one page (``buffers``, held stable by the caller) under ``key``; True when it
        is on disk now (or was already). False: no slot could be had, the write failed, or
        ``still_wanted(key)`` (asked under the index's lock, just before the record is
        written) said no: a key removed while its page was written is never committed."""
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
            if key in self._writing:
                return True
            slot = self._take_slot()
            if slot is None:
                return False
            self._writing.add(key)
        t0 = time.perf_counter()
        try:
            assert self._pages is not None, "open() first"
            digest = self._pages.write(slot, buffers)
            if self.fsync == "batch":
                os.fdatasync(self._data_fd)
            seams.reached("spill.written")
            with self._lock:  # the check and the record in one step: a removal sees either
                self._writing.discard(key)
                if still_wanted is not None and not still_wanted(key):
                    self._free.append(slot)
                    self.stats.not_committed += 1
                    return False
                self._seq += 1
                os.pwrite(self._index_fd, fmt.record_bytes(key, self._seq, digest),
                          fmt.HEADER_BYTES + slot * fmt.RECORD_BYTES)  # after the page
                self._index[key], self._digest[slot] = slot, digest
                self.events.append(EventKind.STORED, [key], DISK, chain=False)
                self.stats.writes += 1
        except OSError as exc:
            with self._lock:
                self._writing.discard(key)
                self._free.append(slot)
                self.stats.write_errors += 1
                self.last_error = f"writing a page: {exc}"
            _limited.warning("disk tier of pool %s: writing a page failed: %s", self.name, exc,
                             key=f"write {self.name} {exc.errno}")
            return False
        self._observe("write", time.perf_counter() - t0)
        return True

    def _take_slot(self) -> int | None:
        """A free slot, or the least recently used page's (lock held)."""
        if self._free:
            return self._free.pop()
        for key, slot in self._index.items():
            if not self._reading.get(slot) and key not in self._held:
                self._forget(key)
                self.stats.evicted += 1
                return self._free.pop() if self._free else None
        return None

    # -- holds -----------------------------------------------------------------------------

    def hold(self, keys: Sequence[bytes]) -> list[bytes]:
        """Keep ``keys`` (those here) from eviction until ``release``: a Lookup found them
        here and its LoadKeys will read them. A removal still removes a held key."""
        with self._lock:
            here = [k for k in keys if k in self._index]
            for k in here:
                self._held[k] = self._held.get(k, 0) + 1
        return here

    def release(self, keys: Sequence[bytes]) -> None:
        """End one ``hold`` of each of ``keys`` (what ``hold`` returned)."""
        with self._lock:
            for k in keys:
                n = self._held.get(k, 0) - 1
                if n > 0:
                    self._held[k] = n
                else:
                    self._held.pop(k, None)

    @property
    def held(self) -> int:
        """Keys held now."""
        return len(self._held)

    # -- read ------------------------------------------------------------------------------

    def read_into(self, key: bytes, buffers: Sequence[memoryview]) -> bool:
        """Read ``key``'s page into ``buffers`` and check it; False when the key is not here,
        or its page failed its checksum or could not be read (the key is dropped then)."""
        with self._lock:
            slot = self._index.get(key)
            if slot is None:
                return False
            self._reading[slot] = self._reading.get(slot, 0) + 1
            digest = self._digest[slot]
            self._index.move_to_end(key)
        t0 = time.perf_counter()
        ok, why, kind = False, "", ""
        try:
            assert self._pages is not None, "open() first"
            ok = self._pages.read(slot, buffers) == digest
            why = kind = "" if ok else "checksum mismatch"
        except OSError as exc:
            why, kind = str(exc), type(exc).__name__  # the text names offsets: not a key
        with self._lock:
            n = self._reading[slot] - 1
            self._reading[slot] = n
            if not n:
                del self._reading[slot]
                if slot in self._deferred:
                    self._deferred.discard(slot)
                    self._free.append(slot)
            if ok:
                self.stats.reads += 1
            elif self._index.get(key) == slot:
                self.stats.checksum_failures += why == "checksum mismatch"
                self._forget(key)
        if not ok:
            _limited.warning("disk tier of pool %s: page of a key dropped (%s)", self.name, why,
                             key=f"read {self.name} {kind}")
        self._observe("read", time.perf_counter() - t0)
        return ok

    # -- batches ---------------------------------------------------------------------------

    def read_many(self, items: Sequence[tuple[bytes, Sequence[memoryview]]]) -> list[bool]:
        """``read_into`` for several pages, ``io_threads`` at a time."""
        if len(items) < 2:
            return [self.read_into(k, b) for k, b in items]
        return list(self._io.map(lambda it: self.read_into(*it), items))

    def write_many(self, items: Sequence[tuple[bytes, Sequence[memoryview]]],
                   still_wanted: Callable[[bytes], bool] | None = None,
                   pages: Sequence[int] = ()) -> list[bool]:
        """``write`` for several pages, ``io_threads`` at a time (``pages``: unused here)."""
        if len(items) < 2:
            return [self.write(k, b, still_wanted) for k, b in items]
        return list(self._io.map(lambda it: self.write(it[0], it[1], still_wanted), items))

    # -- removal ---------------------------------------------------------------------------

    def forget(self, keys: Sequence[bytes] | None) -> list[int]:
        """Drop ``keys`` (None: all) from the index at once, no I/O (a caller may hold its
        own lock): they are gone for every later call. Their slots wait for ``erase``."""
        with self._lock:
            gone = list(self._index) if keys is None else [k for k in keys if k in self._index]
            slots = [self._index.pop(k) for k in gone]
            for slot in slots:
                self._digest.pop(slot, None)
            self._erasing.update(slots)
            self.events.append(EventKind.REMOVED, gone, DISK)
        return slots

    def erase(self, slots: Sequence[int]) -> None:
        """Erase the records of forgotten slots (a restart does not find them), then free the
        slots (later, for one being read). Outside every lock; a run of neighbouring records
        goes in one write."""
        order = sorted(slots)
        start = 0
        for end in range(1, len(order) + 1):  # each run of consecutive slots
            if end < len(order) and order[end] == order[end - 1] + 1 and end - start < 8192:
                continue
            try:
                os.pwrite(self._index_fd, bytes(fmt.RECORD_BYTES * (end - start)),
                          fmt.HEADER_BYTES + order[start] * fmt.RECORD_BYTES)
            except OSError as exc:  # the page's checksum still guards a stale record
                _limited.warning("disk tier of pool %s: clearing records failed: %s",
                                 self.name, exc, key=f"erase {self.name}")
            start = end
        with self._lock:
            for slot in order:
                self._erasing.discard(slot)
                self._free_slot(slot)

    def _forget(self, key: bytes) -> None:
        """Drop one key now, its record erased at once (lock held: a key evicted for room, or
        whose page failed its read)."""
        slot = self._index.pop(key)
        self._digest.pop(slot, None)
        self.events.append(EventKind.EVICTED, [key], DISK)
        try:
            os.pwrite(self._index_fd, bytes(fmt.RECORD_BYTES),
                      fmt.HEADER_BYTES + slot * fmt.RECORD_BYTES)
        except OSError as exc:  # the page's checksum still guards a stale record
            _limited.warning("disk tier of pool %s: clearing a record failed: %s", self.name,
                             exc, key=f"erase {self.name}")
        self._free_slot(slot)

    def _free_slot(self, slot: int) -> None:
        """A slot no key names any more is free again, or once its reads end (lock held)."""
        if self._reading.get(slot):
            self._deferred.add(slot)
        else:
            self._free.append(slot)
