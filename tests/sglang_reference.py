"""SGLang's own page-hash code, run beside ours: its Python wrapper (native_hash.py) and its C++
binding (hash_binding.cpp), taken from the installed sglang 0.5.23 package and compiled here with
g++, OpenSSL and the pybind11 headers torch ships, without importing the sglang package (its
__init__ needs the whole serving stack)."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sysconfig
from pathlib import Path
from types import ModuleType

import torch

from tests.helpers import require_binary, require_module

_CACHE = Path(os.environ.get("HICACHE_TEST_CACHE", "/tmp/hicache-test-cache"))


def _load_file(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sglang_native_hash() -> ModuleType:
    """SGLang's native_hash module, its native binding compiled from SGLang's source."""
    root = Path(require_module("sglang", "sglang==0.5.23 --no-deps"))
    cpp_utils = root / "srt" / "mem_cache" / "cpp_utils"
    source = cpp_utils / "hash_binding.cpp"
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    built = _CACHE / f"hicache_hash_cpp_{digest}{suffix}"
    if not built.exists():
        gxx = require_binary("g++", "g++ libssl-dev")
        _CACHE.mkdir(parents=True, exist_ok=True)
        tmp = built.with_suffix(f".{os.getpid()}.tmp")
        torch_include = Path(torch.__file__).parent / "include"
        out = subprocess.run(
            [gxx, "-O2", "-shared", "-fPIC", "-std=c++17", "-DNDEBUG", "-w",
             "-DTORCH_EXTENSION_NAME=hicache_hash_cpp",
             f"-I{sysconfig.get_paths()['include']}", f"-I{torch_include}", str(source),
             "-lcrypto", "-o", str(tmp)], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"compiling SGLang's hash_binding.cpp failed:\n{out.stderr}"
        os.replace(tmp, built)
    loader = importlib.machinery.ExtensionFileLoader("hicache_hash_cpp", str(built))
    spec = importlib.util.spec_from_file_location("hicache_hash_cpp", built, loader=loader)
    assert spec is not None
    binding = importlib.util.module_from_spec(spec)
    loader.exec_module(binding)
    native_hash = _load_file("sglang_native_hash", cpp_utils / "native_hash.py")
    setattr(native_hash, "_load_native_hash_module", lambda: binding)  # noqa: B010
    return native_hash


def sglang_get_hash_str(native_hash: ModuleType, token_ids: list[int],
                        prior_hash: str | None = None, page_size: int | None = None
                        ) -> str | list[str]:
    """sglang.srt.mem_cache.utils.get_hash_str, whose body is these two lines."""
    prior_digest = bytes.fromhex(prior_hash) if prior_hash else None
    result: str | list[str] = native_hash.get_native_hash(token_ids, prior_digest, page_size)
    return result
