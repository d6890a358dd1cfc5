"""The glossary's names are real: every field, metric and reason code docs/glossary.md names
exists on the wire (the proto), in the daemon's metrics (docs/operations.md's table, itself
checked against the daemon) or in the error table; and the words keep their places: a pool's
"busy" pages and its "pinned" bytes are different fields."""

from __future__ import annotations

import re

from hicache import errors
from hicache.v1 import hicache_pb2 as pb
from tests.daemon_proc import REPO

GLOSSARY = (REPO / "docs" / "glossary.md").read_text()
OPERATIONS = (REPO / "docs" / "operations.md").read_text()
API = (REPO / "docs" / "api.md").read_text()
PROTO = (REPO / "protos" / "hicache" / "v1" / "hicache.proto").read_text()
REASONS = {c.reason for c in vars(errors).values()
           if isinstance(c, type) and issubclass(c, errors.HiCacheError)}


def named() -> set[str]:
    return set(re.findall(r"`([A-Za-z_.\[\]]+)`", GLOSSARY))


def exists(name: str) -> bool:
    if name.startswith("hicache_"):  # a metric: in the metrics table
        return f"`{name}`" in OPERATIONS
    if re.fullmatch(r"[A-Z][A-Z_]+", name):  # a reason code
        return name in REASONS
    if re.fullmatch(r"[A-Z]\w+\.\w+", name):  # a message's field or an enum's value
        message, field = name.split(".")
        d = getattr(pb, message).DESCRIPTOR
        if hasattr(d, "values_by_name"):  # PoolKind.OPAQUE is POOL_KIND_OPAQUE on the wire
            return any(v.endswith(f"_{field}") for v in d.values_by_name)
        return field in d.fields_by_name
    if re.fullmatch(r"[A-Z]\w+", name):  # an RPC
        return name in pb.DESCRIPTOR.services_by_name["HostCache"].methods_by_name
    # a field, setting, config table or name of the docs
    return name in PROTO or name in OPERATIONS or name in API


def test_every_name_the_glossary_gives_exists() -> None:
    names = named()
    assert {"Pool.busy_pages", "hicache_pool_busy_pages", "PAGE_BUSY", "PIN_FAILED"} <= names
    missing = sorted(n for n in names if not exists(n))
    assert not missing, f"docs/glossary.md names what does not exist: {missing}"


def test_busy_and_pinned_are_apart() -> None:
    fields = pb.Pool.DESCRIPTOR.fields_by_name
    assert "busy_pages" in fields and "pinned_bytes" in fields
    assert "deprecated" in OPERATIONS.split("`hicache_pool_pinned_pages`")[1].split("\n")[0]
