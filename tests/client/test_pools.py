"""A pool's fields, written once: ``hicache.pools.PoolInfo`` against ``hicache.v1.Pool``.

Every field of the message is a field of the class or a deprecated name of one; each
deprecated name repeats its field on the wire and reads through for an older daemon; the
daemon's codec and the client's read the same class back."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest

from hicache import pools
from hicache.codec import pool_from_proto, pool_to_proto
from hicache.pools import DEPRECATED_FIELDS, PoolInfo
from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicache.v1 import hicache_pb2 as pb

SPEC = PoolSpec("p", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 2, 8), 4, size_tokens=64)


def _deprecated_on_the_wire(message: Any) -> set[str]:
    return {f.name for f in message.DESCRIPTOR.fields if f.GetOptions().deprecated}


def test_the_class_and_the_message_name_the_same_fields() -> None:
    ours = {f.name for f in dataclasses.fields(PoolInfo)}
    wire = {f.name for f in pb.Pool.DESCRIPTOR.fields}
    assert wire - _deprecated_on_the_wire(pb.Pool) == ours
    assert set(DEPRECATED_FIELDS["Pool"]) == _deprecated_on_the_wire(pb.Pool)


@pytest.mark.parametrize("message", ["Pool", "GetInfoResponse"])
def test_each_deprecated_field_of_the_proto_names_the_field_it_repeats(message: str) -> None:
    cls = getattr(pb, message)
    table = DEPRECATED_FIELDS[message]
    assert set(table) == _deprecated_on_the_wire(cls)
    by_name = {f.name: f for f in cls.DESCRIPTOR.fields}
    for old, new in table.items():
        assert new in by_name and not by_name[new].GetOptions().deprecated
        assert by_name[old].type == by_name[new].type, (old, new)
    assert {m for m in DEPRECATED_FIELDS} == {
        d.name for d in pb.DESCRIPTOR.message_types_by_name.values()
        if _deprecated_on_the_wire(getattr(pb, d.name))}


def _every_field_set() -> PoolInfo:
    """A pool whose every field holds a value of its own (none equal to its default)."""
    values: dict[str, object] = {}
    for i, f in enumerate(dataclasses.fields(PoolInfo)):
        if f.name == "spec":
            values[f.name] = SPEC
        elif f.name == "state":
            values[f.name] = pools.CREATING
        elif f.type == "float":
            values[f.name] = 0.25
        elif f.type == "str":
            values[f.name] = f"v{i}"
        else:
            values[f.name] = 100 + i
    return PoolInfo(**values)  # type: ignore[arg-type]


def test_every_field_goes_over_the_wire_and_comes_back() -> None:
    info = _every_field_set()
    msg = pool_to_proto(info)
    assert msg.state == pb.POOL_STATE_CREATING
    for old, new in DEPRECATED_FIELDS["Pool"].items():
        assert getattr(msg, old) == getattr(msg, new) == getattr(info, new)
    assert pool_from_proto(pb.Pool.FromString(msg.SerializeToString())) == info


def test_a_ready_pool_reads_as_done_and_a_failed_one_keeps_its_reason() -> None:
    ready = pool_from_proto(pool_to_proto(PoolInfo(spec=SPEC, size_tokens=64, page_bytes=8,
                                                   progress=0.0)))
    assert (ready.state, ready.progress) == ("READY", 1.0)
    failed = pool_from_proto(pool_to_proto(PoolInfo(
        spec=SPEC, size_tokens=64, page_bytes=8, state=pools.FAILED, progress=0.5,
        error="no memory", error_reason="HOST_MEMORY_INSUFFICIENT")))
    assert (failed.state, failed.progress, failed.error_reason) == (
        "FAILED", 0.5, "HOST_MEMORY_INSUFFICIENT")


def test_an_older_daemons_reply_with_only_the_old_names_reads_through() -> None:
    msg = pb.Pool(pinned_pages=3, remote_namespace="ns", remote_puts=4, remote_pending=5)
    msg.spec.CopyFrom(pool_to_proto(PoolInfo(spec=SPEC, size_tokens=64, page_bytes=8)).spec)
    info = pool_from_proto(msg)
    assert (info.busy_pages, info.cluster_namespace, info.cluster_puts,
            info.cluster_pending) == (3, "ns", 4, 5)


def test_the_old_names_answer_the_new_fields_values_and_nothing_else_answers() -> None:
    info = _every_field_set()
    for old, new in DEPRECATED_FIELDS["Pool"].items():
        assert getattr(info, old) == getattr(info, new)
    with pytest.raises(AttributeError, match="no field 'pinned_page'"):
        _ = info.pinned_page
    assert pickle.loads(pickle.dumps(info)) == info
    assert dataclasses.replace(info, keys=1).keys == 1
