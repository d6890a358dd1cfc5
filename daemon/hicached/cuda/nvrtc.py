"""NVRTC through ctypes: CUDA C source to a device binary at run time, no toolkit installed.

NVRTC needs no GPU (the CPU suite compiles the daemon's kernels with it). The library comes
from NVIDIA's wheels (``pip install 'hicached[cuda]'``: ``nvidia-cuda-nvrtc``; CUDA 12 drivers
take ``nvidia-cuda-nvrtc-cu12``), or the system's CUDA toolkit. Importing this module loads
no library.

Primitives:

- ``find_library()``: where NVRTC is: ``$HICACHED_NVRTC``, else the ``nvidia`` wheels' layouts
  (``nvidia/cu13/lib``, ``nvidia/cuda_nvrtc/lib``), else the system's ``libnvrtc.so``;
  ``None`` where there is none.
- ``Nvrtc(path)``: the library loaded (its builtins library first, from the same directory);
  ``version``; ``compile(source, name, arch, options)``: a cubin for ``sm_XY`` (bytes), or
  ``CompileFailed`` with NVRTC's log.
- ``load_nvrtc()``: the process's ``Nvrtc`` (loaded once), or ``None`` with
  ``nvrtc_problem()`` saying why.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os

from hicache.locks import lock

ENV_LIBRARY = "HICACHED_NVRTC"
LOG_LIMIT = 4000
"""Characters of NVRTC's log kept in a ``CompileFailed``."""


class CompileFailed(RuntimeError):
    """NVRTC refused a source (its log) or failed (its result code)."""

    def __init__(self, what: str, log: str = "") -> None:
        super().__init__(f"{what}{': ' + log[:LOG_LIMIT] if log else ''}")
        self.log = log[:LOG_LIMIT]


def _wheel_dirs() -> list[str]:
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    out = []
    for root in spec.submodule_search_locations:
        for sub in ("cu13/lib", "cuda_nvrtc/lib"):
            if os.path.isdir(os.path.join(root, sub)):
                out.append(os.path.join(root, sub))
    return out


def _main_library(directory: str) -> str | None:
    found = sorted(p for p in glob.glob(os.path.join(directory, "libnvrtc.so*"))
                   if ".alt." not in p)
    return found[-1] if found else None


def find_library() -> str | None:
    """NVRTC's shared library (see the module's docstring), or ``None``."""
    configured = os.environ.get(ENV_LIBRARY)
    if configured:
        return configured
    for directory in _wheel_dirs():
        lib = _main_library(directory)
        if lib:
            return lib
    return ctypes.util.find_library("nvrtc")


class Nvrtc:
    """One loaded NVRTC. Compiles are serialized (one lock): they are rare (a kernel per
    device architecture, cached on disk)."""

    def __init__(self, path: str) -> None:
        directory = os.path.dirname(path)
        if directory:  # NVRTC dlopens its builtins by name: make the wheel's one known
            for builtins in sorted(glob.glob(os.path.join(directory,
                                                          "libnvrtc-builtins.so*"))):
                if ".alt." not in builtins:
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                    break
        self._lib = ctypes.CDLL(path)
        self.path = path
        self._lock = lock("cuda.nvrtc")
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self._lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)),
                    "nvrtcVersion")
        self.version = (major.value, minor.value)

    def _error(self, rc: int) -> str:
        fn = self._lib.nvrtcGetErrorString
        fn.restype = ctypes.c_char_p
        name = fn(ctypes.c_int(rc))
        return name.decode() if name else f"NVRTC error {rc}"

    def _check(self, rc: int, call: str) -> None:
        if rc != 0:
            raise CompileFailed(f"{call} failed: {self._error(rc)}")

    def compile(self, source: bytes, name: str, arch: str, options: tuple[str, ...] = ()
                ) -> bytes:
        """``source`` compiled for ``arch`` (``sm_90``): the cubin."""
        lib = self._lib
        with self._lock:
            prog = ctypes.c_void_p()
            self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source, name.encode(), 0,
                                               None, None), "nvrtcCreateProgram")
            try:
                opts = [f"-arch={arch}", *options]
                argv = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
                rc = lib.nvrtcCompileProgram(prog, len(opts), argv)
                size = ctypes.c_size_t()
                lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                text = ctypes.create_string_buffer(max(size.value, 1))
                lib.nvrtcGetProgramLog(prog, text)
                log = text.value.decode(errors="replace").strip()
                if rc != 0:
                    raise CompileFailed(f"{name} does not compile for {arch}", log)
                self._check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)),
                            "nvrtcGetCUBINSize")
                cubin = ctypes.create_string_buffer(size.value)
                self._check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
                return cubin.raw
            finally:
                lib.nvrtcDestroyProgram(ctypes.byref(prog))


_loaded: list[Nvrtc | None] = []
_problem: list[str] = []
_load_lock = lock("cuda.nvrtc.load")


def load_nvrtc() -> Nvrtc | None:
    """The process's NVRTC, loaded once; ``None`` where there is none (``nvrtc_problem``)."""
    with _load_lock:
        if not _loaded:
            path = find_library()
            got: Nvrtc | None = None
            why = ""
            if path is None:
                why = ("no NVRTC library (pip install 'hicached[cuda]', or set "
                       f"{ENV_LIBRARY})")
            else:
                try:
                    got = Nvrtc(path)
                except (OSError, AttributeError, CompileFailed) as exc:
                    why = f"cannot load NVRTC from {path}: {exc}"
            _loaded.append(got)
            _problem.append(why)
        return _loaded[0]


def nvrtc_problem() -> str:
    """Why ``load_nvrtc()`` returned ``None`` (empty when it did not)."""
    load_nvrtc()
    return _problem[0]
