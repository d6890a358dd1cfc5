"""Stand-ins for a CPU SGLang server started by the tests (tests/sglang_server_harness.py).

Python runs ``sitecustomize`` at start-up in every process whose ``PYTHONPATH`` holds this
directory: the server's main process and the scheduler and detokenizer processes SGLang
spawns. It installs one meta-path finder for two names only, and only where the real package
is not installed (a real one is always used as it is):

- ``sgl_kernel`` -> ``sgl_kernel_cpu.py``: the two kernels SGLang's CPU path runs, in plain
  torch, and the speculative-decoding names it imports but never calls here (the wheel is
  CUDA-built).
- ``torchvision`` and its submodules -> inert modules (``torchvision_inert.py``): SGLang's
  model configs import it, a text model never uses it, and its wheels need a CUDA torch. Only
  imports get them: availability probes (``importlib.util.find_spec``) still find nothing,
  so transformers does not take torchvision's paths; and transformers' own probe
  (``is_torchvision_available``, cached) runs before the first stand-in module exists, as
  ``importlib.util.find_spec`` answers from ``sys.modules`` once a module is there.

Any other ``sitecustomize`` further on ``sys.path`` runs afterwards, as it would without this
one.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Sequence

HERE = os.path.dirname(os.path.abspath(__file__))


def _installed(name: str) -> bool:
    """Whether a real ``name`` is on ``sys.path`` (found without importing it)."""
    path = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
    return importlib.machinery.PathFinder.find_spec(name, path) is not None


def _imported_not_probed() -> bool:
    """Whether the finder was asked by the import system (``import x``, ``import_module``),
    not by ``importlib.util.find_spec``: the frames above ``find_spec`` are
    ``importlib._bootstrap._find_spec`` and then ``_find_and_load_unlocked`` for an import."""
    try:
        frame = sys._getframe(3)  # _imported_not_probed <- find_spec <- _find_spec <- caller
    except ValueError:
        return False
    return frame.f_code.co_name == "_find_and_load_unlocked"


def _own_module(name: str) -> types.ModuleType:
    """This directory's ``name.py``, loaded once from its file (whatever ``sys.path`` is)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _probe_before_import() -> None:
    """Let transformers record that torchvision is absent (its probe is cached) before the
    stand-in is in ``sys.modules``, where ``find_spec`` would find it."""
    try:
        from transformers.utils import import_utils
    except ImportError:
        return
    import_utils.is_torchvision_available()


class _TorchvisionLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if spec.name == "torchvision":
            _probe_before_import()
        module: types.ModuleType = _own_module("torchvision_inert").InertModule(spec.name)
        module.__path__ = []  # a package: its submodules come here too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class StandInFinder(importlib.abc.MetaPathFinder):
    def __init__(self, sgl_kernel: bool, torchvision: bool) -> None:
        self.sgl_kernel, self.torchvision = sgl_kernel, torchvision

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if self.sgl_kernel and fullname == "sgl_kernel":
            return importlib.util.spec_from_file_location(
                fullname, os.path.join(HERE, "sgl_kernel_cpu.py"))
        if (self.torchvision and fullname.split(".")[0] == "torchvision"
                and _imported_not_probed()):
            return importlib.machinery.ModuleSpec(fullname, _TorchvisionLoader(),
                                                  is_package=True)
        return None


def _install() -> None:
    finder = StandInFinder(sgl_kernel=not _installed("sgl_kernel"),
                           torchvision=not _installed("torchvision"))
    if finder.sgl_kernel or finder.torchvision:
        sys.meta_path.insert(0, finder)


def _run_next_sitecustomize() -> None:
    """The ``sitecustomize`` that this one shadows: the next one on ``sys.path`` after this
    directory (only after it: one before it is what imported this)."""
    where = [os.path.abspath(p or ".") for p in sys.path]
    path = sys.path[where.index(HERE) + 1:] if HERE in where else []
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_install()
_run_next_sitecustomize()
