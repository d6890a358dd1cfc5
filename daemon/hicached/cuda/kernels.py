"""The daemon's CUDA kernels: their source in the package (``pages.cu``), compiled at run time
with NVRTC for each device's architecture, cached by source hash and architecture under the
state directory, loaded through the driver.

A host without NVRTC, a device whose driver cannot use the kernel (no unified addressing, or
mapped host memory at other addresses than the host's), or a source that does not compile:
the kernel is off for that device, the reason logged once, and copies take the DMA path.

Primitives:

- ``SOURCE``: ``pages.cu`` as the package has it; ``KERNEL``: the entry point's name;
  ``OPTIONS``: what NVRTC compiles it with.
- ``cache_key(source, arch, compiler, options)``: the hex digest a binary is kept under.
- ``KernelBinaries(cache_dir, nvrtc)``: ``cubin(arch)``: from memory, else from the cache
  directory (a file the daemon owns, named by its key, checked by its digest inside), else
  compiled and written there (atomically, 0600); ``cache_dir`` "" keeps binaries in memory.
- ``load_page_kernel(driver, ordinal, binaries)``: (``PageKernel``, "") on a device that can
  run it, else (None, why).
"""

from __future__ import annotations

import hashlib
import importlib.resources
import logging
import os
import threading

from hicache.cuda_driver import (
    DEV_ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
    DEV_ATTR_UNIFIED_ADDRESSING,
    CudaCallFailed,
    CudaDriver,
)
from hicache.locks import lock
from hicached.core.trusted_paths import UntrustedPath, open_own, own_dir
from hicached.cuda.launch import PageKernel
from hicached.cuda.nvrtc import CompileFailed, Nvrtc

log = logging.getLogger(__name__)

SOURCE = importlib.resources.files("hicached.cuda").joinpath("pages.cu").read_bytes()
KERNEL = "hicache_copy_pages"
OPTIONS = ("-default-device", "-std=c++17")
DIGEST_BYTES = 32
"""A cached binary's file ends with the SHA-256 of what precedes it."""


def cache_key(source: bytes, arch: str, compiler: str, options: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for part in (source, arch.encode(), compiler.encode(), "\0".join(options).encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:32]


class KernelBinaries:
    """Compiled kernels by architecture, kept in memory and (``cache_dir``) on disk."""

    def __init__(self, cache_dir: str, nvrtc: Nvrtc, source: bytes = SOURCE) -> None:
        self.cache_dir = cache_dir
        self._nvrtc = nvrtc
        self._source = source
        self._lock = lock("cuda.kernels")
        self._got: dict[str, bytes] = {}
        self.compiled = 0
        """Compiles this process ran (a binary found in the cache directory is none)."""

    def key(self, arch: str) -> str:
        compiler = "nvrtc-{}.{}".format(*self._nvrtc.version)
        return cache_key(self._source, arch, compiler, OPTIONS)

    def cubin(self, arch: str) -> bytes:
        """The kernels' binary for ``arch``; ``CompileFailed`` when NVRTC refuses them."""
        with self._lock:
            got = self._got.get(arch)
            if got is None:
                got = self._read(arch) or self._compile(arch)
                self._got[arch] = got
            return got

    def _path(self, arch: str) -> str:
        return os.path.join(self.cache_dir, f"{self.key(arch)}.{arch}.cubin")

    def _read(self, arch: str) -> bytes | None:
        if not self.cache_dir:
            return None
        try:
            fd = open_own(self._path(arch), os.O_RDONLY)
        except FileNotFoundError:
            return None
        except UntrustedPath as exc:  # not ours: compile instead, and say so
            log.warning("ignoring a cached kernel binary: %s", exc)
            return None
        with os.fdopen(fd, "rb") as f:
            raw = f.read()
        body, digest = raw[:-DIGEST_BYTES], raw[-DIGEST_BYTES:]
        if len(raw) <= DIGEST_BYTES or hashlib.sha256(body).digest() != digest:
            log.warning("the cached kernel binary %s is damaged: compiling again",
                        self._path(arch))
            return None
        return body

    def _compile(self, arch: str) -> bytes:
        cubin = self._nvrtc.compile(self._source, "pages.cu", arch, OPTIONS)
        self.compiled += 1
        if self.cache_dir:
            try:
                own_dir(self.cache_dir)
                path = self._path(arch)
                tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
                fd = open_own(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
                with os.fdopen(fd, "wb") as f:
                    f.write(cubin + hashlib.sha256(cubin).digest())
                os.replace(tmp, path)
            except OSError as exc:  # a cache that cannot be written costs a compile a start
                log.warning("cannot cache the kernel binary in %s: %s", self.cache_dir, exc)
        return cubin


def load_page_kernel(driver: CudaDriver, ordinal: int, binaries: KernelBinaries
                     ) -> tuple[PageKernel | None, str]:
    """The page kernel on ``ordinal`` (its module loaded in the device's primary context), or
    why not."""
    try:
        with driver.context(ordinal):
            if not driver.attribute(DEV_ATTR_UNIFIED_ADDRESSING, ordinal):
                return None, "the device has no unified addressing"
            if not driver.attribute(DEV_ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, ordinal):
                return None, "mapped host memory has other addresses on the device"
            arch = driver.arch(ordinal)
            cubin = binaries.cubin(arch)
            module = driver.module_load(cubin)
            function = driver.module_function(module, KERNEL)
            return PageKernel(driver, ordinal, function), ""
    except CompileFailed as exc:
        return None, f"pages.cu does not compile: {exc}"
    except CudaCallFailed as exc:
        return None, f"the driver cannot load it: {exc}"
