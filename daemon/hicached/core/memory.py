"""Host memory for pools: mmap regions, transparent huge pages, parallel prefault, pinning.

Primitives:

- ``Backing``: ``ANONYMOUS`` (private, eligible for transparent huge pages), ``MEMFD`` (shareable
  by fd) or ``FILE`` (a named file, e.g. under /dev/shm, so another process can map the pool,
  or a later daemon re-attach it: ``reuse``, ``keep``).
- ``HostMemory``: one mapped region; ``address``, ``array()`` (a uint8 numpy view), ``close()``.
- ``Pinner``: page-locks a region for fast DMA; injected by the caller (the daemon passes the
  CUDA driver's ``cuMemHostRegister`` where it has a GPU, ``hicached.cuda.pinner``). Pinning is
  chunked, rolled back on failure (``PIN_FAILED``, naming the cause: the locked-memory limit,
  or a ``FILE`` backing on a disk filesystem, whose pages the kernel never page-locks) and
  undone on close. Without a pinner nothing attempts to pin. ``pin_range`` / ``unpin_range``
  lock and unlock one OS-page-aligned range at a time (a pool whose locked part follows its
  share of the memory budget, ``core.pin_units``); ``release`` never gives back a byte that is
  locked (the device would keep reading and writing the old pages).

Knows nothing of pools, RPC or drivers.
"""

from __future__ import annotations

import bisect
import ctypes
import enum
import itertools
import logging
import mmap
import os
import resource
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np

from hicache.errors import PinFailed, SpecInvalid
from hicache.paths import remove_if_there
from hicached.core.system import default_threads, lock_refusal

log = logging.getLogger(__name__)

PREFAULT_CHUNK = 64 << 20
PIN_CHUNK = 1 << 30
MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault in writable pages without touching bytes
OS_PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


class Backing(enum.Enum):
    ANONYMOUS = "anonymous"
    MEMFD = "memfd"
    FILE = "file"


class Pinner(Protocol):
    """Page-locks host memory for DMA. ``register`` raises on failure."""

    def register(self, address: int, nbytes: int) -> None: ...

    def unregister(self, address: int) -> None: ...


def _thp_enabled() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


class HostMemory:
    """One mapped host region, prefaulted and optionally pinned; freed by ``close()``."""

    def __init__(
        self,
        nbytes: int,
        *,
        backing: Backing = Backing.ANONYMOUS,
        path: str | None = None,
        hugepages: bool = True,
        prefault_threads: int = 0,
        pinner: Pinner | None = None,
        name: str = "pool",
        on_progress: Callable[[int], None] | None = None,
        reuse: bool = False,
        keep: bool = False,
        prefault: bool = True,
    ) -> None:
        """``on_progress(nbytes)`` is called as each chunk of the region is faulted in.
        FILE backing: ``reuse`` maps an existing file of exactly ``nbytes`` as it is (its
        bytes are the point: nothing is faulted in ahead), ``keep`` leaves the file when the
        region closes. ``prefault=False``: nothing is faulted in here (``populate`` the part
        that is to be resident now)."""
        if nbytes <= 0:
            raise SpecInvalid("host memory size must be positive", metadata={"nbytes": nbytes})
        self.nbytes = nbytes
        self.backing = backing
        self.path = path
        self.keep = keep
        self._fd = -1
        self._pinned: dict[int, int] = {}
        """Each registration's base address and length."""
        self._pinned_bytes = 0
        self._pinner = pinner
        self.pin_seams = np.zeros(0, dtype=np.int64)
        """Where one registration of the whole region's (``pinner`` given: 1 GiB chunks) ends
        and the next begins (addresses, ascending): no copy may cross one."""
        self._closed = False
        self._on_progress = on_progress
        self.prefault_seconds = 0.0
        self.pin_seconds = 0.0
        self.hugepages = False
        self._mm = self._map(nbytes, backing, path, name, reuse)
        try:
            if hugepages and hasattr(mmap, "MADV_HUGEPAGE") and _thp_enabled():
                try:
                    self._mm.madvise(mmap.MADV_HUGEPAGE)
                    self.hugepages = backing is Backing.ANONYMOUS
                except OSError as exc:
                    log.debug("MADV_HUGEPAGE refused: %s", exc)
            self._array: np.ndarray | None = np.frombuffer(self._mm, dtype=np.uint8)
            self.address = int(self._array.ctypes.data)
            if not reuse and prefault:
                self.prefault(prefault_threads)
            if pinner is not None:
                self._pin(pinner)
        except BaseException:
            self.close()
            raise

    def _map(self, nbytes: int, backing: Backing, path: str | None, name: str,
             reuse: bool) -> mmap.mmap:
        if backing is Backing.ANONYMOUS:
            return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if backing is Backing.MEMFD:
            self._fd = os.memfd_create(f"hicached-{name}", os.MFD_CLOEXEC)
        else:
            if not path:
                raise SpecInvalid("FILE backing needs a path")
            if reuse:
                self._fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
                size = os.fstat(self._fd).st_size
                if size != nbytes:
                    raise SpecInvalid(f"{path} has {size} bytes, the pool needs {nbytes}",
                                      metadata={"path": path, "size": size, "nbytes": nbytes})
                return mmap.mmap(self._fd, nbytes, flags=mmap.MAP_SHARED)
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.ftruncate(self._fd, nbytes)
        return mmap.mmap(self._fd, nbytes, flags=mmap.MAP_SHARED)

    @property
    def fd(self) -> int:
        """The memfd or file descriptor of a shareable region (-1 for anonymous)."""
        return self._fd

    def array(self) -> np.ndarray:
        """A uint8 view of the whole region (valid until close)."""
        if self._array is None:
            raise RuntimeError("host memory is closed")
        return self._array

    def prefault(self, threads: int) -> float:
        """Touch every page, in parallel threads; returns seconds spent.

        Shared backings are reserved with fallocate first so that a full tmpfs fails here with
        an error instead of a SIGBUS on a later copy.
        """
        t0 = time.perf_counter()
        threads = default_threads(threads)
        chunks = [(off, min(PREFAULT_CHUNK, self.nbytes - off))
                  for off in range(0, self.nbytes, PREFAULT_CHUNK)]

        def touch(chunk: tuple[int, int]) -> None:
            off, length = chunk
            if self._fd >= 0:
                os.posix_fallocate(self._fd, off, length)
            if _libc.madvise(self.address + off, length, MADV_POPULATE_WRITE) != 0:
                ctypes.memset(self.address + off, 0, length)  # older kernels
            if self._on_progress is not None:
                self._on_progress(length)

        if threads == 1 or len(chunks) == 1:
            for c in chunks:
                touch(c)
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="prefault") as ex:
                list(ex.map(touch, chunks))
        self.prefault_seconds = time.perf_counter() - t0
        return self.prefault_seconds

    def reserve(self, ranges: list[tuple[int, int]]) -> bool:
        """Reserve the backing of ``ranges`` in a shareable region's file (a full tmpfs says
        so here, not with a SIGBUS on a later copy); False when it could not. Anonymous
        memory has no file to reserve: True."""
        if self._fd < 0:
            return True
        try:
            for off, length in ranges:
                if length > 0:
                    os.posix_fallocate(self._fd, off, length)
        except OSError as exc:
            log.warning("reserving %d byte range(s) of a pool's file failed: %s",
                        len(ranges), exc)
            return False
        return True

    def populate(self, ranges: list[tuple[int, int]]) -> None:
        """Fault in ``ranges`` ((offset, length) in the region; shared backings reserved
        first), as ``prefault`` does the whole region."""
        t0 = time.perf_counter()
        for off, length in ranges:
            if length <= 0:
                continue
            if self._fd >= 0:
                os.posix_fallocate(self._fd, off, length)
            start = off // OS_PAGE * OS_PAGE
            end = -(-(off + length) // OS_PAGE) * OS_PAGE
            if _libc.madvise(self.address + start, end - start, MADV_POPULATE_WRITE) != 0:
                ctypes.memset(self.address + off, 0, length)  # older kernels
        self.prefault_seconds += time.perf_counter() - t0

    def _pin(self, pinner: Pinner) -> None:
        t0 = time.perf_counter()
        try:
            for off in range(0, self.nbytes, PIN_CHUNK):
                self._register(pinner, self.address + off, min(PIN_CHUNK, self.nbytes - off))
            self.pin_seams = self.address + np.arange(PIN_CHUNK, self.nbytes, PIN_CHUNK,
                                                      dtype=np.int64)
        except Exception as exc:
            done = self._pinned_bytes
            self._unpin()
            raise self._pin_failed(self.nbytes, done, exc) from None
        except BaseException:
            self._unpin()
            raise
        self.pin_seconds = time.perf_counter() - t0
        log.info("pinned %d bytes in %.3f s", self.nbytes, self.pin_seconds)

    def _register(self, pinner: Pinner, address: int, nbytes: int) -> None:
        pinner.register(address, nbytes)
        self._pinned[address] = nbytes
        self._pinned_bytes += nbytes

    def _pin_failed(self, nbytes: int, done: int, exc: Exception) -> PinFailed:
        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
        refusal = (lock_refusal(os.path.dirname(self.path))
                   if self.backing is Backing.FILE and self.path else None)
        cause = (f"{refusal}: put the pool's directory (state_dir) on one" if refusal
                 else f"the locked-memory limit is {limit} bytes (raise LimitMEMLOCK / "
                      f"ulimit -l, or grant IPC_LOCK)")
        return PinFailed(f"page-locking {nbytes} bytes for DMA failed after {done}: "
                         f"{exc}; {cause}",
                         metadata={"nbytes": nbytes, "pinned_before_failure": done,
                                   "memlock_limit": limit, "error": str(exc),
                                   **({"filesystem": refusal} if refusal else {})})

    def _unpin(self) -> None:
        pinner = self._pinner
        while self._pinned and pinner is not None:
            addr, nbytes = self._pinned.popitem()
            self._pinned_bytes -= nbytes
            try:
                pinner.unregister(addr)
            except Exception as exc:  # keep unregistering the rest
                log.warning("unregistering host memory at %#x failed: %s", addr, exc)

    def pin_range(self, pinner: Pinner, offset: int, length: int) -> None:
        """Page-lock ``[offset, offset + length)`` of the region as one registration through
        ``pinner`` (the one every range of the region uses; offset and length OS-page
        aligned, overlapping no range locked before; its memory is faulted in first).
        ``PinFailed`` names the cause; nothing of the range stays locked then. ``close``
        unlocks what is still locked."""
        if self._closed or (self._pinner is not None and self._pinner is not pinner):
            raise RuntimeError("host memory closed, or locked through another pinner")
        self._pinner = pinner
        if offset % OS_PAGE or length % OS_PAGE or length <= 0 or offset < 0 \
                or offset + length > self.mapped_bytes:
            raise ValueError(f"a pinned range is whole OS pages of the region: {offset}+{length}")
        t0 = time.perf_counter()
        self.populate([(offset, min(length, self.nbytes - offset))])
        try:
            self._register(pinner, self.address + offset, length)
        except Exception as exc:
            raise self._pin_failed(length, 0, exc) from None
        finally:
            self.pin_seconds += time.perf_counter() - t0

    def unpin_range(self, offset: int) -> None:
        """Unlock the registration ``pin_range`` made at ``offset`` (no copy may be using it).
        Where the driver refuses, it raises and the range stays locked (and kept)."""
        address = self.address + offset
        nbytes = self._pinned[address]
        assert self._pinner is not None
        self._pinner.unregister(address)
        del self._pinned[address]
        self._pinned_bytes -= nbytes

    @property
    def mapped_bytes(self) -> int:
        """The region's size rounded up to whole OS pages (what its mapping covers)."""
        return -(-self.nbytes // OS_PAGE) * OS_PAGE

    @property
    def pinned_bytes(self) -> int:
        """Bytes page-locked now."""
        return self._pinned_bytes

    def release(self, ranges: list[tuple[int, int]]) -> int:
        """Give the memory of ``ranges`` ((offset, length) in the region) back to the system:
        the whole OS pages inside each (the edges of a range that share an OS page with bytes
        outside it stay) that no registration locks (locked memory stays: the device keeps
        the pages it was given). They read as zeros afterwards and are faulted in again when
        written. The caller makes sure nothing reads or writes those bytes meanwhile. Returns
        the bytes released."""
        if self._closed:
            return 0
        advice = mmap.MADV_DONTNEED if self.backing is Backing.ANONYMOUS else mmap.MADV_REMOVE
        locked = sorted((a - self.address, a - self.address + n)
                        for a, n in self._pinned.items())
        ends = [hi for _, hi in locked]
        done = 0
        for off, length in ranges:
            start = -(-off // OS_PAGE) * OS_PAGE
            end = (off + length) // OS_PAGE * OS_PAGE
            for lo, hi in _outside(start, end, locked, ends):
                if _libc.madvise(self.address + lo, hi - lo, advice) != 0:
                    err = ctypes.get_errno()
                    log.warning("releasing %d bytes of host memory failed: %s", hi - lo,
                                os.strerror(err))
                    continue
                done += hi - lo
        return done

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unpin, unmap and release the backing. Views still held elsewhere keep the mapping
        alive until they are dropped (logged), never dangling."""
        if self._closed:
            return
        self._closed = True
        self._unpin()
        self._array = None
        mm = getattr(self, "_mm", None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                log.warning("host memory still referenced by views; it is unmapped when they go")
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.backing is Backing.FILE and self.path and not self.keep:
            remove_if_there(self.path)


def _outside(start: int, end: int, locked: list[tuple[int, int]], ends: list[int]
             ) -> list[tuple[int, int]]:
    """The parts of ``[start, end)`` outside the sorted, disjoint ``locked`` intervals
    (``ends``: their ends, ascending too; the first one past ``start`` is found by bisection)."""
    out = []
    at = start
    for lo, hi in itertools.islice(locked, bisect.bisect_right(ends, start), None):
        if lo >= end:
            break
        if lo > at:
            out.append((at, lo))
        at = max(at, hi)
    if at < end:
        out.append((at, end))
    return out
