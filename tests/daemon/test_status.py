from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2

from hicache import errors as e
from hicache.error_mapping import (
    DOMAIN,
    GRPC_CODES,
    from_rpc_error,
    from_status_bytes,
    to_rpc_status,
)


def test_every_domain_error_class_is_mapped_explicitly() -> None:
    missing = [c.__name__ for c in e.all_error_classes() if c not in GRPC_CODES]
    assert not missing, f"add these to hicache.error_mapping.GRPC_CODES: {missing}"


@pytest.mark.parametrize("cls", e.all_error_classes(), ids=lambda c: c.__name__)
def test_every_domain_error_survives_the_status_round_trip(cls: type[e.HiCacheError]) -> None:
    """What the daemon raises is what the worker catches, whichever class: each one has a
    code, and its status rebuilds the same class with its reason and metadata."""
    exc = cls("it failed", metadata={"retry_after_ms": "250", "pool_id": "p"})
    st = to_rpc_status(exc)
    back = from_status_bytes(st.SerializeToString())
    assert type(back) is cls
    assert back.reason == cls.reason and back.metadata == exc.metadata
    assert back.message == "it failed" and back.from_daemon


@pytest.mark.parametrize("cls,code", [
    (e.IndicesNotPageAligned, grpc.StatusCode.INVALID_ARGUMENT),
    (e.PoolSpecConflict, grpc.StatusCode.ALREADY_EXISTS),
    (e.PoolExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (e.PoolNotFound, grpc.StatusCode.NOT_FOUND),
    (e.SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (e.ShmPathRejected, grpc.StatusCode.PERMISSION_DENIED),
    (e.TransportUnavailable, grpc.StatusCode.FAILED_PRECONDITION),
    (e.Draining, grpc.StatusCode.UNAVAILABLE),
    (e.SessionEnding, grpc.StatusCode.UNAVAILABLE),
    (e.CanaryMismatch, grpc.StatusCode.DATA_LOSS),
])
def test_table_entries(cls: type[e.HiCacheError], code: grpc.StatusCode) -> None:
    assert GRPC_CODES[cls] == code


def test_rich_status_carries_error_info_and_field_violations() -> None:
    exc = e.IndicesNotPageAligned(
        "bad run", metadata={"count": 7, "page_size": 4},
        violations=[e.Violation("host_indices", "INDICES_NOT_PAGE_ALIGNED", "bad run"),
                    e.Violation("device_indices", "INDEX_OUT_OF_RANGE", "too big")])
    st = to_rpc_status(exc)
    assert st.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    info = error_details_pb2.ErrorInfo()
    bad = error_details_pb2.BadRequest()
    assert st.details[0].Unpack(info) and st.details[1].Unpack(bad)
    assert info.domain == DOMAIN and info.reason == "INDICES_NOT_PAGE_ALIGNED"
    assert dict(info.metadata) == {"count": "7", "page_size": "4"}
    assert [(v.field, v.reason) for v in bad.field_violations] == [
        ("host_indices", "INDICES_NOT_PAGE_ALIGNED"), ("device_indices", "INDEX_OUT_OF_RANGE")]


def test_spec_errors_name_their_field() -> None:
    st = to_rpc_status(e.PageSizeInvalid("page_size must be >= 1", metadata={"page_size": 0}))
    bad = error_details_pb2.BadRequest()
    assert st.details[1].Unpack(bad)
    assert bad.field_violations[0].field == "spec.page_size"


class _ServerCancelled(grpc.RpcError):
    """A call the server cancelled while stopping: no rich status, code CANCELLED."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return "CANCELLED"

    def trailing_metadata(self) -> tuple[()]:
        return ()


def test_a_call_the_server_cancelled_is_unavailable_not_internal() -> None:
    exc = from_rpc_error(_ServerCancelled())
    assert isinstance(exc, e.Unavailable) and exc.reason == "UNAVAILABLE"
    assert "shutting down" in exc.message
