"""Domain errors of hicached: what failed, with a stable reason code and metadata.

No gRPC here: one table elsewhere maps these classes to status codes. Every error carries a
``reason`` (a stable code, part of the API: docs/api.md lists them), ``metadata`` (the
offending values) and ``violations`` (each problem found, naming its field; the first raises).

Hierarchy::

    HiCacheError
    ├── InvalidRequest                 the caller sent something malformed (INVALID_ARGUMENT)
    │   ├── PageSizeInvalid                PAGE_SIZE_INVALID
    │   ├── PoolSizeNotPageAligned         POOL_SIZE_NOT_PAGE_ALIGNED
    │   ├── AllocSizeNotPageAligned        ALLOC_SIZE_NOT_PAGE_ALIGNED
    │   ├── IndicesNotPageAligned          INDICES_NOT_PAGE_ALIGNED
    │   ├── IndicesMalformed               INDICES_MALFORMED
    │   ├── IndexCountMismatch             INDEX_COUNT_MISMATCH
    │   ├── IndexOutOfRange                INDEX_OUT_OF_RANGE
    │   ├── DuplicatePage                  DUPLICATE_PAGE
    │   ├── LayerOutOfRange                LAYER_OUT_OF_RANGE
    │   ├── GeometryMismatch               GEOMETRY_MISMATCH
    │   ├── SpecInvalid                    SPEC_INVALID
    │   ├── CanarySourceInvalid            CANARY_SOURCE_INVALID
    │   ├── IpcHandleInvalid               IPC_HANDLE_INVALID
    │   ├── BufferNotShareable             BUFFER_NOT_SHAREABLE
    │   ├── KeyInvalid                     KEY_INVALID
    │   ├── DuplicateKey                   DUPLICATE_KEY
    │   ├── TooManyKeys                    TOO_MANY_KEYS
    │   └── TokenIdsInvalid                TOKEN_IDS_INVALID
    ├── StateConflict                  the request is well-formed but the state forbids it
    │   ├── PageNotAllocated               PAGE_NOT_ALLOCATED
    │   ├── DoubleFree                     DOUBLE_FREE
    │   ├── PoolSpecConflict               POOL_SPEC_CONFLICT
    │   ├── PoolClosed                     POOL_CLOSED
    │   ├── PoolInUse                      POOL_IN_USE
    │   ├── TransportUnavailable           TRANSPORT_UNAVAILABLE
    │   ├── PageNotWritten                 PAGE_NOT_WRITTEN
    │   └── BufferFault                    BUFFER_FAULT
    ├── Aborted                        a concurrent request holds what this one needs; retry
    │   └── PageBusy                       PAGE_BUSY
    ├── ResourceExhausted              a limit was hit
    │   ├── PoolExhausted                  POOL_EXHAUSTED
    │   ├── HostMemoryInsufficient         HOST_MEMORY_INSUFFICIENT
    │   ├── PinFailed                      PIN_FAILED
    │   ├── TooManyWatchers                TOO_MANY_WATCHERS
    │   └── Overloaded                     OVERLOADED
    ├── NotFound
    │   ├── PoolNotFound                   POOL_NOT_FOUND
    │   ├── SessionNotFound                SESSION_NOT_FOUND
    │   ├── DeviceNotFound                 DEVICE_NOT_FOUND
    │   └── KeyNotFound                    KEY_NOT_FOUND
    ├── PermissionDenied               the caller may not use that resource
    │   ├── ShmPathRejected                SHM_PATH_REJECTED
    │   ├── FdRejected                     FD_REJECTED
    │   ├── PeerNotAllowed                 PEER_NOT_ALLOWED
    │   └── DaemonUntrusted                DAEMON_UNTRUSTED (client side)
    ├── Unauthenticated                UNAUTHENTICATED: a TCP caller without the daemon's token
    ├── DeadlinePassed                 DEADLINE_PASSED: too late to copy (DEADLINE_EXCEEDED)
    ├── Unavailable                    try again later / elsewhere
    │   ├── PoolNotReady                   POOL_NOT_READY
    │   ├── SessionEnding                  SESSION_ENDING
    │   └── Draining                       DRAINING
    ├── DataIntegrityError             bytes are not what was stored
    │   └── CanaryMismatch                 CANARY_MISMATCH
    └── DeviceFailure                  the GPU or its driver failed a call (INTERNAL)
        └── CudaFailure                    CUDA_ERROR
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from dataclasses import field as _field
from typing import Any


@dataclass(frozen=True)
class Violation:
    """One problem found in a request; ``field`` names the request field at fault
    (``host_indices``, ``spec.page_size``): a ``google.rpc.BadRequest.FieldViolation``."""

    field: str
    reason: str
    description: str
    metadata: Mapping[str, object] = _field(default_factory=dict)


RETRY_AFTER_MAX_S = 10.0
"""The longest wait a ``retry_after_ms`` asks for that a client honours."""


class HiCacheError(Exception):
    """Base of every domain error. Subclasses fix ``reason``."""

    reason: str = "INTERNAL"
    grpc_code: Any = None
    """Client side: the ``grpc.StatusCode`` the call ended with (None when raised locally)."""
    from_daemon: bool = False
    """Client side: the daemon answered with this reason (an ErrorInfo of our domain), as
    opposed to a transport failure such as an unreachable socket."""

    def __init__(self, message: str, *, metadata: Mapping[str, object] | None = None,
                 violations: Iterable[Violation] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.metadata: dict[str, str] = {str(k): str(v) for k, v in (metadata or {}).items()}
        self.violations: tuple[Violation, ...] = tuple(violations)

    def retry_after(self, default_s: float = 0.01) -> float:
        """Seconds the daemon asked to wait before a retry (``retry_after_ms``), or
        ``default_s`` where it said nothing usable; within [1 ms, ``RETRY_AFTER_MAX_S``]."""
        try:
            ms = float(self.metadata.get("retry_after_ms", ""))
        except ValueError:
            return default_s
        if ms != ms:  # NaN
            return default_s
        return min(max(ms / 1000, 0.001), RETRY_AFTER_MAX_S)

    def __str__(self) -> str:
        meta = ", ".join(f"{k}={v}" for k, v in sorted(self.metadata.items()))
        return f"{self.reason}: {self.message}" + (f" ({meta})" if meta else "")


class InvalidRequest(HiCacheError):
    """The caller sent something malformed; retrying the same request cannot succeed."""

    reason = "INVALID_REQUEST"


class PageSizeInvalid(InvalidRequest):
    reason = "PAGE_SIZE_INVALID"


class PoolSizeNotPageAligned(InvalidRequest):
    reason = "POOL_SIZE_NOT_PAGE_ALIGNED"


class AllocSizeNotPageAligned(InvalidRequest):
    reason = "ALLOC_SIZE_NOT_PAGE_ALIGNED"


class IndicesNotPageAligned(InvalidRequest):
    reason = "INDICES_NOT_PAGE_ALIGNED"


class IndicesMalformed(InvalidRequest):
    reason = "INDICES_MALFORMED"


class IndexCountMismatch(InvalidRequest):
    reason = "INDEX_COUNT_MISMATCH"


class IndexOutOfRange(InvalidRequest):
    reason = "INDEX_OUT_OF_RANGE"


class DuplicatePage(InvalidRequest):
    reason = "DUPLICATE_PAGE"


class LayerOutOfRange(InvalidRequest):
    reason = "LAYER_OUT_OF_RANGE"


class GeometryMismatch(InvalidRequest):
    reason = "GEOMETRY_MISMATCH"


class SpecInvalid(InvalidRequest):
    reason = "SPEC_INVALID"


class CanarySourceInvalid(InvalidRequest):
    reason = "CANARY_SOURCE_INVALID"


class IpcHandleInvalid(InvalidRequest):
    """A CUDA IPC handle could not be opened, a VMM chunk passed by fd could not be imported,
    mapped or given access (not an exported allocation, another GPU's, sizes that do not fit),
    or a buffer leaves the allocation or region it names."""

    reason = "IPC_HANDLE_INVALID"


class BufferNotShareable(InvalidRequest):
    """Device memory neither CUDA IPC nor VMM chunk fds can share (VMM memory not created
    exportable, managed, host); raised before anything is sent."""

    reason = "BUFFER_NOT_SHAREABLE"


class KeyInvalid(InvalidRequest):
    """A cache key that is empty or longer than 64 bytes."""

    reason = "KEY_INVALID"


class DuplicateKey(InvalidRequest):
    """The same key twice in one Store or LoadKeys batch."""

    reason = "DUPLICATE_KEY"


class TooManyKeys(InvalidRequest):
    """More keys in one call than the daemon's ``max_keys_per_call`` (metadata count, max)."""

    reason = "TOO_MANY_KEYS"


class TokenIdsInvalid(InvalidRequest):
    """A Store's ``token_ids`` that are not ``page_size`` per key, or hold a negative id."""

    reason = "TOKEN_IDS_INVALID"


class StateConflict(HiCacheError):
    """The request is well-formed but the current state forbids it."""

    reason = "STATE_CONFLICT"


class PageNotAllocated(StateConflict):
    reason = "PAGE_NOT_ALLOCATED"


class DoubleFree(StateConflict):
    reason = "DOUBLE_FREE"


class PoolSpecConflict(StateConflict):
    reason = "POOL_SPEC_CONFLICT"


class PoolClosed(StateConflict):
    reason = "POOL_CLOSED"


class PoolInUse(StateConflict):
    reason = "POOL_IN_USE"


class TransportUnavailable(StateConflict):
    reason = "TRANSPORT_UNAVAILABLE"


class PageNotWritten(StateConflict):
    """A load of host pages (or layers) nothing wrote since allocation: a previous owner's."""

    reason = "PAGE_NOT_WRITTEN"


class BufferFault(StateConflict):
    """A worker's buffer vanished under a copy (file truncated): that session is ended."""

    reason = "BUFFER_FAULT"


class Aborted(HiCacheError):
    """A concurrent request holds what this one needs; retrying later can succeed."""

    reason = "ABORTED"


class PageBusy(Aborted):
    """A page is being written by another request (or read, for a write)."""

    reason = "PAGE_BUSY"


class ResourceExhausted(HiCacheError):
    reason = "RESOURCE_EXHAUSTED"


class PoolExhausted(ResourceExhausted):
    reason = "POOL_EXHAUSTED"


class HostMemoryInsufficient(ResourceExhausted):
    reason = "HOST_MEMORY_INSUFFICIENT"


class PinFailed(ResourceExhausted):
    """Page-locking a pool for DMA failed (locked-memory limit, or the driver refused)."""

    reason = "PIN_FAILED"


class TooManyWatchers(ResourceExhausted):
    """Every slot for WatchEvents streams is taken."""

    reason = "TOO_MANY_WATCHERS"


class Overloaded(ResourceExhausted):
    """The data path is at its bound of transfers; retry after ``retry_after_ms`` (RetryInfo)."""

    reason = "OVERLOADED"


class NotFound(HiCacheError):
    reason = "NOT_FOUND"


class PoolNotFound(NotFound):
    reason = "POOL_NOT_FOUND"


class SessionNotFound(NotFound):
    reason = "SESSION_NOT_FOUND"


class DeviceNotFound(NotFound):
    """No GPU of the daemon has the UUID a worker's buffers live on."""

    reason = "DEVICE_NOT_FOUND"


class KeyNotFound(NotFound):
    """A LoadKeys key is in no tier (never stored, evicted, removed, or being written)."""

    reason = "KEY_NOT_FOUND"


class PermissionDenied(HiCacheError):
    reason = "PERMISSION_DENIED"


class ShmPathRejected(PermissionDenied):
    reason = "SHM_PATH_REJECTED"


class FdRejected(PermissionDenied):
    """A memfd buffer the daemon will not map (missing, unsealed, not memory, too small), or a
    VMM chunk's fd it will not take (not passed, named twice, in two regions)."""

    reason = "FD_REJECTED"


class PeerNotAllowed(PermissionDenied):
    """The pool's access rules do not list the caller (or it brought no credential)."""

    reason = "PEER_NOT_ALLOWED"


class DaemonUntrusted(PermissionDenied):
    """Client side: what listens on the daemon's socket runs as a user the client does not
    trust (not its own, root or ``HICACHE_DAEMON_UID``): nothing was sent to it."""

    reason = "DAEMON_UNTRUSTED"


class Unauthenticated(HiCacheError):
    """A TCP caller without the bearer token the daemon asks for (or with another)."""

    reason = "UNAUTHENTICATED"


class DeadlinePassed(HiCacheError):
    """A load got its turn after its caller's ``deadline_unix_ns``: refused, nothing copied."""

    reason = "DEADLINE_PASSED"


class Unavailable(HiCacheError):
    reason = "UNAVAILABLE"


class PoolNotReady(Unavailable):
    """The pool is still being created, or its creation failed (``state`` says which)."""

    reason = "POOL_NOT_READY"


class SessionEnding(Unavailable):
    """The session has ended (closed, reaped, its buffers faulted) and a copy of it is still
    running: ``SESSION_NOT_FOUND`` comes only once none is, so a worker that hears it knows
    no byte of that session can land any more; ask again (``retry_after_ms``)."""

    reason = "SESSION_ENDING"


class Draining(Unavailable):
    reason = "DRAINING"


class DataIntegrityError(HiCacheError):
    reason = "DATA_INTEGRITY"


class CanaryMismatch(DataIntegrityError):
    reason = "CANARY_MISMATCH"


class DeviceFailure(HiCacheError):
    """The GPU or its driver failed a call the request was valid for."""

    reason = "DEVICE_FAILURE"


class CudaFailure(DeviceFailure):
    reason = "CUDA_ERROR"


def all_error_classes(root: type[HiCacheError] = HiCacheError) -> list[type[HiCacheError]]:
    """Every concrete and abstract domain error class, for exhaustiveness checks."""
    return [root, *(c for sub in root.__subclasses__() for c in all_error_classes(sub))]


_BY_REASON: dict[str, type[HiCacheError]] = {}


def error_class_for(reason: str) -> type[HiCacheError]:
    """The most specific class for a reason code (``HiCacheError`` when unknown)."""
    if not _BY_REASON:
        for cls in all_error_classes():
            _BY_REASON.setdefault(cls.reason, cls)
    return _BY_REASON.get(reason, HiCacheError)


def raise_violations(violations: list[Violation]) -> None:
    """Raise the error of the first violation, carrying all of them. No-op when empty."""
    if not violations:
        return
    first = violations[0]
    cls = error_class_for(first.reason)
    more = f" (+{len(violations) - 1} more violation(s))" if len(violations) > 1 else ""
    raise cls(first.description + more, metadata=first.metadata, violations=violations)
