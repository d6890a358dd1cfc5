"""vLLM 0.34's CPU platform on an x86 host without Triton's CPU backend, for the tests only.

vLLM 0.34 refuses to build a ``VllmConfig`` for the CPU on x86 unless Triton with its CPU
backend is importable (``vllm/platforms/cpu.py``, ``CpuPlatform.check_and_update_config``:
"vLLM on x86 CPUs requires Triton (triton-cpu)"). It needs Triton there for its CPU model
runner's kernels. The tests run no model runner and no kernel: they drive vLLM's own
``Scheduler``, its ``OffloadingConnector`` (both roles) and hicached's spec, whose code paths
import no Triton (``vllm.triton_utils`` hands them placeholders). So the check is answered as
if Triton were there, and only while that check runs: ``vllm.triton_utils.HAS_TRITON`` reads
True for the duration of the call and goes back to what vLLM found, so nothing else vLLM
decides from it changes. vLLM 0.33's check does not ask, and is left as it is.

Primitives: ``allow_without_triton()`` (idempotent; a no-op where vLLM does not ask).
"""

from __future__ import annotations

import inspect
from typing import Any


def allow_without_triton() -> None:
    import vllm.triton_utils as triton_utils
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config
    if getattr(check, "_hicached_shim", False):
        return
    if "HAS_TRITON" not in inspect.getsource(check):
        return  # this vLLM's CPU platform does not ask for Triton
    original = check.__func__  # type: ignore[attr-defined]

    def checked(cls: Any, vllm_config: Any) -> None:
        found = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True
        try:
            original(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = found

    checked._hicached_shim = True  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = classmethod(checked)  # type: ignore[assignment]
