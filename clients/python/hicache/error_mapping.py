"""The one table from domain errors to gRPC status codes, and the rich status they travel as.

Primitives:

- ``GRPC_CODES``: every domain error class -> ``grpc.StatusCode`` (a test fails when a class is
  missing: map new classes here explicitly, never by inheritance).
- ``to_rpc_status(exc)``: ``google.rpc.Status`` with ``ErrorInfo`` (domain ``hicache.v1``,
  reason, metadata), ``BadRequest`` field violations and, when the metadata carries
  ``retry_after_ms``, a ``RetryInfo``, ready for ``rpc_status.to_status``; bounded in size
  (``MAX_VIOLATIONS``, ``MAX_METADATA``, ``MAX_TEXT``) whatever the error carries.
- ``abort_status(exc)``: the ``grpc.Status`` a servicer aborts with.
- ``from_rpc_error(err)``: the client side: a ``grpc.RpcError`` back into the domain class for
  its reason, carrying metadata, violations, the gRPC code and whether the daemon itself
  answered (``from_daemon``: an ErrorInfo of our domain was attached).
- ``from_status(code, details, status)`` / ``from_status_bytes(data)``: the same from a
  ``google.rpc.Status`` (the fast path's error frames carry one, serialized).
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from hicache import errors as e

DOMAIN = "hicache.v1"

C = grpc.StatusCode
GRPC_CODES: dict[type[e.HiCacheError], grpc.StatusCode] = {
    e.HiCacheError: C.INTERNAL,
    e.InvalidRequest: C.INVALID_ARGUMENT,
    e.PageSizeInvalid: C.INVALID_ARGUMENT,
    e.PoolSizeNotPageAligned: C.INVALID_ARGUMENT,
    e.AllocSizeNotPageAligned: C.INVALID_ARGUMENT,
    e.IndicesNotPageAligned: C.INVALID_ARGUMENT,
    e.IndicesMalformed: C.INVALID_ARGUMENT,
    e.IndexCountMismatch: C.INVALID_ARGUMENT,
    e.IndexOutOfRange: C.INVALID_ARGUMENT,
    e.DuplicatePage: C.INVALID_ARGUMENT,
    e.LayerOutOfRange: C.INVALID_ARGUMENT,
    e.GeometryMismatch: C.INVALID_ARGUMENT,
    e.SpecInvalid: C.INVALID_ARGUMENT,
    e.CanarySourceInvalid: C.INVALID_ARGUMENT,
    e.IpcHandleInvalid: C.INVALID_ARGUMENT,
    e.BufferNotShareable: C.INVALID_ARGUMENT,
    e.KeyInvalid: C.INVALID_ARGUMENT,
    e.DuplicateKey: C.INVALID_ARGUMENT,
    e.TooManyKeys: C.INVALID_ARGUMENT,
    e.TokenIdsInvalid: C.INVALID_ARGUMENT,
    e.StateConflict: C.FAILED_PRECONDITION,
    e.PageNotAllocated: C.FAILED_PRECONDITION,
    e.DoubleFree: C.FAILED_PRECONDITION,
    e.PoolSpecConflict: C.ALREADY_EXISTS,
    e.PoolClosed: C.FAILED_PRECONDITION,
    e.PoolInUse: C.FAILED_PRECONDITION,
    e.TransportUnavailable: C.FAILED_PRECONDITION,
    e.PageNotWritten: C.FAILED_PRECONDITION,
    e.BufferFault: C.FAILED_PRECONDITION,
    e.Aborted: C.ABORTED,
    e.PageBusy: C.ABORTED,
    e.ResourceExhausted: C.RESOURCE_EXHAUSTED,
    e.PoolExhausted: C.RESOURCE_EXHAUSTED,
    e.HostMemoryInsufficient: C.RESOURCE_EXHAUSTED,
    e.PinFailed: C.RESOURCE_EXHAUSTED,
    e.TooManyWatchers: C.RESOURCE_EXHAUSTED,
    e.Overloaded: C.RESOURCE_EXHAUSTED,
    e.NotFound: C.NOT_FOUND,
    e.PoolNotFound: C.NOT_FOUND,
    e.SessionNotFound: C.NOT_FOUND,
    e.DeviceNotFound: C.NOT_FOUND,
    e.KeyNotFound: C.NOT_FOUND,
    e.PermissionDenied: C.PERMISSION_DENIED,
    e.ShmPathRejected: C.PERMISSION_DENIED,
    e.FdRejected: C.PERMISSION_DENIED,
    e.PeerNotAllowed: C.PERMISSION_DENIED,
    e.DaemonUntrusted: C.PERMISSION_DENIED,
    e.Unauthenticated: C.UNAUTHENTICATED,
    e.DeadlinePassed: C.DEADLINE_EXCEEDED,
    e.Unavailable: C.UNAVAILABLE,
    e.Draining: C.UNAVAILABLE,
    e.SessionEnding: C.UNAVAILABLE,
    e.PoolNotReady: C.UNAVAILABLE,
    e.DataIntegrityError: C.DATA_LOSS,
    e.CanaryMismatch: C.DATA_LOSS,
    e.DeviceFailure: C.INTERNAL,
    e.CudaFailure: C.INTERNAL,
}

# the request field at fault for spec errors raised without explicit violations
_SPEC_FIELDS = {
    e.PageSizeInvalid.reason: "spec.page_size",
    e.PoolSizeNotPageAligned.reason: "spec.size_tokens",
    e.CanarySourceInvalid.reason: "spec.canary_read_bytes",
    e.AllocSizeNotPageAligned.reason: "num_tokens",
    e.GeometryMismatch.reason: "buffers",
    e.SpecInvalid.reason: "spec",
}


def grpc_code(exc: e.HiCacheError) -> grpc.StatusCode:
    return GRPC_CODES[type(exc)]


MAX_VIOLATIONS = 32
"""Field violations one status carries (the rest are counted in its last one)."""
MAX_TEXT = 1024
"""Characters of a message, description, metadata value or field name a status carries."""
MAX_METADATA = 32
"""Metadata entries one status carries."""


def _cut(text: str, limit: int = MAX_TEXT) -> str:
    return text if len(text) <= limit else text[:limit - 15] + "... (truncated)"


def to_rpc_status(exc: e.HiCacheError) -> status_pb2.Status:
    """The status of ``exc``, bounded whatever the request (at most ``MAX_VIOLATIONS`` field
    violations, ``MAX_METADATA`` entries and ``MAX_TEXT`` characters per text: under 64 KiB
    serialized)."""
    code = grpc_code(exc)
    meta = {_cut(k, 128): _cut(v) for k, v in sorted(exc.metadata.items())[:MAX_METADATA]}
    info = error_details_pb2.ErrorInfo(reason=exc.reason, domain=DOMAIN, metadata=meta)
    details = [any_pb2.Any()]
    details[0].Pack(info)
    violations = list(exc.violations)
    if not violations and isinstance(exc, e.InvalidRequest):
        field = exc.metadata.get("field") or _SPEC_FIELDS.get(exc.reason, "request")
        violations = [e.Violation(field, exc.reason, exc.message)]
    if len(violations) > MAX_VIOLATIONS:
        rest = len(violations) - MAX_VIOLATIONS + 1
        violations = [*violations[:MAX_VIOLATIONS - 1], e.Violation(
            "request", exc.reason, f"{rest} more violation(s) not listed")]
    if violations:
        bad = error_details_pb2.BadRequest()
        for v in violations:
            bad.field_violations.add(field=_cut(v.field, 128), description=_cut(v.description),
                                     reason=v.reason)
        details.append(any_pb2.Any())
        details[-1].Pack(bad)
    retry_ms = exc.metadata.get("retry_after_ms", "")
    if retry_ms.isdigit():
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromMilliseconds(int(retry_ms))
        details.append(any_pb2.Any())
        details[-1].Pack(retry)
    return status_pb2.Status(code=code.value[0], message=_cut(str(exc), 4 * MAX_TEXT),
                             details=details)


def abort_status(exc: e.HiCacheError) -> grpc.Status:
    """The grpc.Status to pass to ``context.abort_with_status``."""
    return rpc_status.to_status(to_rpc_status(exc))


def _own_message(details: str, reason: str, metadata: dict[str, str]) -> str:
    """The message the daemon's error was raised with: the status text carries the reason and
    metadata around it (for clients that only read text), which the rebuilt error adds again."""
    probe = e.HiCacheError("", metadata=metadata)
    probe.reason = reason
    prefix, _, suffix = str(probe).partition(": ")
    if details.startswith(prefix + ": ") and details.endswith(suffix.strip()):
        return details[len(prefix) + 2:len(details) - len(suffix.strip())].rstrip()
    return details


def from_rpc_error(err: grpc.RpcError) -> e.HiCacheError:
    """Rebuild the domain error a daemon raised; a call the server cancelled becomes
    ``Unavailable``; other unknown failures become ``HiCacheError``."""
    code = err.code() if hasattr(err, "code") else C.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    status = rpc_status.from_call(err) if hasattr(err, "trailing_metadata") else None
    return from_status(code, details or "", status)


_CODES_BY_VALUE = {c.value[0]: c for c in C}


def from_status_bytes(data: bytes) -> e.HiCacheError:
    """A serialized ``google.rpc.Status`` (the fast path's error frame, gRPC's
    ``grpc-status-details-bin``) back into its domain error."""
    status = status_pb2.Status.FromString(data)
    return from_status(_CODES_BY_VALUE.get(status.code, C.UNKNOWN), status.message, status)


def from_status(code: grpc.StatusCode, details: str, status: status_pb2.Status | None
                ) -> e.HiCacheError:
    """The domain error of a status: its ErrorInfo's reason and metadata, its BadRequest's
    violations; without an ErrorInfo of our domain, a class for the code."""
    reason, metadata, from_daemon = "", {}, False
    violations: list[e.Violation] = []
    if status is not None:
        for any_msg in status.details:
            if any_msg.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                any_msg.Unpack(info)
                if info.domain == DOMAIN:
                    reason, metadata, from_daemon = info.reason, dict(info.metadata), True
            elif any_msg.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                any_msg.Unpack(bad)
                violations = [e.Violation(v.field, v.reason, v.description)
                              for v in bad.field_violations]
    if not reason and code == C.CANCELLED:
        # the client never cancels its calls: the server did, as it does to calls that reach
        # it while it stops; to the caller that is the daemon going away mid-call
        reason = e.Unavailable.reason
        details = f"the daemon cancelled the call, most likely while shutting down ({details})"
    if not reason:
        reason = {C.UNAVAILABLE: e.Unavailable.reason, C.NOT_FOUND: e.NotFound.reason,
                  C.INVALID_ARGUMENT: e.InvalidRequest.reason,
                  C.RESOURCE_EXHAUSTED: e.ResourceExhausted.reason}.get(code, "INTERNAL")
    cls = e.error_class_for(reason)
    exc = cls(_own_message(details, reason, metadata), metadata=metadata,
              violations=violations)
    exc.grpc_code = code
    exc.from_daemon = from_daemon
    return exc
