"""Stand-in for ``torchvision`` in a CPU SGLang server started by the tests: inert modules.

SGLang 0.5.23's model configs import ``torchvision.transforms`` at module level (e.g.
``sglang.srt.configs.deepseek_ocr``) although a text model never uses it, and torchvision's
PyPI wheels are built against a CUDA torch, so the CPU torch here has none. ``sitecustomize.py``
beside this file makes ``import torchvision`` (and any ``torchvision.*``) yield these modules
where the real package is missing, while availability probes (``importlib.util.find_spec``,
as transformers' ``is_torchvision_available`` uses) still find nothing, so transformers never
takes a torchvision path. Every attribute is a placeholder class; calling one raises.
"""

from __future__ import annotations

import types
from typing import Any


class _Placeholder(type):
    """A placeholder class: any attribute is another placeholder
    (``InterpolationMode.BICUBIC``); making an instance raises."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = placeholder(f"{cls.__qualname__}.{name}")
        setattr(cls, name, value)
        return value


def placeholder(name: str) -> type:
    def refuse(cls: type, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{name} is a stand-in: torchvision is not installed here")

    cls = _Placeholder(name.rsplit(".", 1)[-1], (), {"__new__": refuse})
    cls.__qualname__ = name
    return cls


class InertModule(types.ModuleType):
    """A ``torchvision`` module whose every attribute is a placeholder class."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value
