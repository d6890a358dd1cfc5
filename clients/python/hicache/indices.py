"""Index batches: what a worker sends and the daemon decodes, as little-endian int64.

Primitives:

- ``IndexArray``: a 1-D int64 numpy array.
- ``PageIds(ids)``: a batch that names whole pages by number (the fast path's form), as
  opposed to token indices: a type, so that no flag changes what an index argument means.
- ``to_index_array(obj, field)``: an ``IndexArray`` from a tensor / array / sequence /
  little-endian int64 bytes (zero-copy where possible), or ``INDICES_MALFORMED`` naming
  ``field``.
- ``indices_to_bytes(obj)``: the wire form of a batch (one ``frombuffer`` to decode; a repeated
  field costs ~100x more to build).

torch is never imported here: a tensor can only be passed when the caller has torch loaded.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple, NoReturn

import numpy as np
import numpy.typing as npt

from hicache.errors import IndicesMalformed, Violation

IndexArray = npt.NDArray[np.int64]


class PageIds(NamedTuple):
    """Page numbers (int64), one per page: ``ids``."""

    ids: IndexArray

_INT_TENSOR_DTYPES: frozenset[Any] = frozenset()


def _tensor_to_numpy(obj: object, field: str) -> np.ndarray | None:
    """A CPU numpy view of a torch tensor, or None when ``obj`` is not one (integer tensors
    never require grad, so no detach is needed)."""
    global _INT_TENSOR_DTYPES
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor):
        return None
    if not _INT_TENSOR_DTYPES:
        _INT_TENSOR_DTYPES = frozenset((torch.int64, torch.int32, torch.int16, torch.uint8,
                                        torch.int8))
    t: Any = obj.cpu() if obj.device.type != "cpu" else obj
    if t.dtype not in _INT_TENSOR_DTYPES:
        _malformed(field, f"dtype {t.dtype} is not an integer type")
    return t.numpy()  # type: ignore[no-any-return]


def to_index_array(obj: object, field: str) -> IndexArray:
    """Decode an index batch into a 1-D int64 array (zero-copy where possible)."""
    if isinstance(obj, bytes | bytearray | memoryview):
        raw = memoryview(obj).cast("B")
        if raw.nbytes % 8:
            raise IndicesMalformed(
                f"{field}: {raw.nbytes} bytes is not a whole number of little-endian int64",
                metadata={"field": field, "nbytes": raw.nbytes},
                violations=[Violation(field, IndicesMalformed.reason,
                                      "length not a multiple of 8")],
            )
        return np.frombuffer(raw, dtype="<i8").astype(np.int64, copy=False)
    arr = _tensor_to_numpy(obj, field)
    if arr is None:
        try:
            arr = np.asarray(obj)
        except Exception:
            _malformed(field, f"cannot read indices from {type(obj).__name__}")
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            _malformed(field, f"dtype {arr.dtype} is not an integer type")
    if arr.ndim != 1:
        _malformed(field, f"indices must be 1-D, got shape {tuple(arr.shape)}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        _malformed(field, "index exceeds int64")
    return np.ascontiguousarray(arr, dtype=np.int64)


def indices_to_bytes(indices: object) -> bytes:
    """Encode an index batch (tensor, array, sequence or bytes) as little-endian int64 bytes."""
    if isinstance(indices, bytes | bytearray):
        return bytes(indices)
    arr = _tensor_to_numpy(indices, "indices")
    return np.ascontiguousarray(indices if arr is None else arr, dtype="<i8").tobytes()


def _malformed(field: str, why: str) -> NoReturn:
    raise IndicesMalformed(
        f"{field}: {why}",
        metadata={"field": field},
        violations=[Violation(field, IndicesMalformed.reason, why)],
    )
