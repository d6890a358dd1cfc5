"""Build and inspect the fake CUDA driver (``fakecuda.c``) that CPU-only CI runs the CUDA path on.

``library(batch_abi=13)`` compiles it once per source version into a cache directory and
returns its path (pass it as ``HICACHED_CUDA_DRIVER`` or to ``load_driver``), with the
daemon's page kernel (``pages.cu``, as the installed hicached has it) compiled in as C++ on
``kernel_emulation.h``, and the ``cuMemcpyBatchAsync`` of CUDA 13 (``batch_abi`` 12: CUDA
12.8's; 0: none); ``FakeCuda(path)`` reads its counters and logs, sets device attributes and
makes the allocations CUDA IPC cannot share; ``VMM_STATS`` are the counters that say what
the virtual memory management API still holds.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.resources
import os
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("fakecuda.c")
UUID_A = "fa4ec0da000000000000000000000001"
UUID_B = "fa4ec0da0000000000000000000000b2"
VMM_STATS = ("vmm_handles", "vmm_imported", "vmm_allocations", "vmm_mappings",
             "vmm_reservations")


EMULATION = Path(__file__).with_name("kernel_emulation.h")


def kernel_source() -> Path:
    """The page kernel's source as the installed hicached has it."""
    return Path(str(importlib.resources.files("hicached.cuda").joinpath("pages.cu")))


def library(batch_abi: int = 13) -> str:
    kernel = kernel_source()
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), EMULATION.read_bytes(), kernel.read_bytes(),
                 str(batch_abi).encode()):
        h.update(hashlib.sha256(part).digest())
    out = Path(tempfile.gettempdir()) / f"hicache-fakecuda-{h.hexdigest()[:16]}" / "libfakecuda.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        objs = [tmp.with_suffix(".c.o"), tmp.with_suffix(".cu.o")]
        subprocess.run(["gcc", "-c", "-fPIC", "-O1", "-Wall", f"-DFAKECUDA_BATCH_ABI={batch_abi}",
                        "-o", str(objs[0]), str(SOURCE)], check=True)
        subprocess.run(["g++", "-c", "-fPIC", "-O1", "-Wall", "-fno-strict-aliasing", "-x",
                        "c++", "-std=c++17", "-include", str(EMULATION), "-o", str(objs[1]),
                        str(kernel)], check=True)
        subprocess.run(["g++", "-shared", "-o", str(tmp), *map(str, objs), "-lpthread"],
                       check=True)
        for o in objs:
            o.unlink()
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

    def set_attribute(self, attribute: int, value: int) -> None:
        """A device attribute as cuDeviceGetAttribute reports it (every device)."""
        self.lib.fakecuda_set_attribute(ctypes.c_int(attribute), ctypes.c_int(value))

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
        """Memory as PyTorch's expandable segments give: cuMemCreate'd without an exportable
        handle type, mapped, accessible (needs a current context); ``free_vmm`` frees it."""
        return self._alloc(self.lib.fakecuda_alloc_vmm, nbytes)

    def free_vmm(self, address: int) -> None:
        rc = self.lib.fakecuda_free_vmm(ctypes.c_uint64(address))
        assert rc == 0, rc

    def alloc_managed(self, nbytes: int) -> int:
        return self._alloc(self.lib.fakecuda_alloc_managed, nbytes)

    @staticmethod
    def _alloc(fn: ctypes._NamedFuncPointer, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        rc = fn(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        assert rc == 0, rc
        return ptr.value
