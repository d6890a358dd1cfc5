"""Build and inspect the fake CUDA driver (``fakecuda.c``) that CPU-only CI runs the CUDA path on.

``library()`` compiles it once per source version into a cache directory and returns its path
(pass it as ``HICACHED_CUDA_DRIVER`` or to ``load_driver``); ``FakeCuda(path)`` reads its
counters and logs and makes the allocations CUDA IPC cannot share.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("fakecuda.c")
UUID_A = "fa4ec0da000000000000000000000001"
UUID_B = "fa4ec0da0000000000000000000000b2"


def library() -> str:
    src = SOURCE.read_bytes()
    tag = hashlib.sha256(src).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"hicache-fakecuda-{tag}" / "libfakecuda.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-o", str(tmp), str(SOURCE),
                        "-lpthread"], check=True)
        os.replace(tmp, out)
    return str(out)


def format_uuid(hex32: str) -> str:
    h = hex32
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class FakeCuda:
    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(path)
        self.lib.fakecuda_stat.restype = ctypes.c_long
        self.lib.fakecuda_stat.argtypes = [ctypes.c_char_p]
        self.lib.fakecuda_event_seq.restype = ctypes.c_long
        self.lib.fakecuda_event_seq.argtypes = [ctypes.c_void_p]
        self.lib.fakecuda_copy_at.restype = ctypes.c_long
        self.lib.fakecuda_copy_at.argtypes = [ctypes.c_long] + [ctypes.POINTER(ctypes.c_uint64)] * 3

    def set_defer(self, on: bool) -> None:
        """Queue stream work until something synchronizes with it (default: run at enqueue)."""
        self.lib.fakecuda_set_defer(ctypes.c_int(int(on)))

    def set_pin_limit(self, nbytes: int) -> None:
        """Refuse host registrations beyond ``nbytes`` in total (-1: no limit)."""
        self.lib.fakecuda_set_pin_limit(ctypes.c_long(nbytes))

    def set_strict_pinned(self, on: bool) -> None:
        """Refuse (and count, as ``unpinned_copies`` always does) a copy whose host side is
        not registered memory, when it is enqueued and when it runs (a deferred error)."""
        self.lib.fakecuda_set_strict_pinned(ctypes.c_int(int(on)))

    def stat(self, name: str) -> int:
        value = int(self.lib.fakecuda_stat(name.encode()))
        assert value >= 0, f"unknown fake CUDA counter {name}"
        return value

    def event_seq(self, event: int) -> int:
        return int(self.lib.fakecuda_event_seq(ctypes.c_void_p(event)))

    def copies(self, first: int = 0) -> list[tuple[int, int, int, int]]:
        """(sequence number, dst, src, bytes) of every copied row since copy ``first``."""
        out: list[tuple[int, int, int, int]] = []
        d, s, n = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
        i = first
        while True:
            seq = int(self.lib.fakecuda_copy_at(i, ctypes.byref(d), ctypes.byref(s),
                                                ctypes.byref(n)))
            if seq < 0:
                return out
            out.append((seq, d.value, s.value, n.value))
            i += 1

    def alloc_vmm(self, nbytes: int) -> int:
        """Memory as cuMemCreate / expandable segments would give (needs a current context)."""
        return self._alloc(self.lib.fakecuda_alloc_vmm, nbytes)

    def alloc_managed(self, nbytes: int) -> int:
        return self._alloc(self.lib.fakecuda_alloc_managed, nbytes)

    @staticmethod
    def _alloc(fn: ctypes._NamedFuncPointer, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        rc = fn(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        assert rc == 0, rc
        return ptr.value
