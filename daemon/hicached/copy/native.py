"""The one loader of the native module ``hicached.copy._copykernel`` (built from csrc/*.c).

Primitives:

- ``KERNEL``: the module, or ``None`` when it is not built or ``HICACHED_DISABLE_NATIVE=1``
  (logged once). It exports ``copy_pages`` (the CPU kernel) and ``cuda_submit`` (batched
  ``cuMemcpyAsync`` / ``cuMemcpy2DAsync`` submission through driver function pointers).
- ``native_available()``: whether it loaded.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

log = logging.getLogger(__name__)


def _load() -> ModuleType | None:
    if os.environ.get("HICACHED_DISABLE_NATIVE") == "1":
        return None
    try:
        from hicached.copy import _copykernel  # type: ignore[attr-defined]
    except ImportError:
        log.warning("native copy kernel not built; using the slow pure-Python copy path")
        return None
    return _copykernel  # type: ignore[no-any-return]


KERNEL = _load()


def native_available() -> bool:
    return KERNEL is not None
