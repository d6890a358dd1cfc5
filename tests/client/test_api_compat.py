"""The wire contract only grows: the last released proto is a snapshot, and nothing in it may
disappear, be renamed, or change number or type (scripts/proto_compat.py)."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.daemon_proc import REPO


def _compat() -> ModuleType:
    spec = importlib.util.spec_from_file_location("proto_compat",
                                                  Path(REPO, "scripts", "proto_compat.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


COMPAT = _compat()


def test_the_current_proto_keeps_every_released_name_number_and_type() -> None:
    path, released = COMPAT.newest_snapshot()
    assert released["services"]["hicache.v1.HostCache"], path
    assert COMPAT.breaking_changes(released, COMPAT.current()) == []


def test_the_snapshot_is_the_released_contract() -> None:
    """The snapshot of 0.1.0 holds what clients of 0.1.0 rely on."""
    released = json.loads(Path(REPO, "protos/released/hicache-v1-0.1.0.json").read_text())
    field = released["messages"]["hicache.v1.TransferRequest"]["host_indices"]
    assert field == {"number": 2, "type": "TYPE_BYTES", "label": "LABEL_OPTIONAL",
                     "type_name": "", "oneof": ""}
    assert released["enums"]["hicache.v1.PoolKind"]["POOL_KIND_DSA_INDEXER"] == 3
    assert set(released["services"]["hicache.v1.HostCache"]) >= {"Backup", "Load", "CreatePool"}


def _mutations() -> list[tuple[str, str]]:
    return [("renumbered field", "number"), ("retyped field", "type"),
            ("repeated field", "label"), ("field moved into a oneof", "oneof")]


@pytest.mark.parametrize(("what", "key"), _mutations())
def test_a_changed_field_is_reported(what: str, key: str) -> None:
    old = COMPAT.current()
    new = copy.deepcopy(old)
    f = new["messages"]["hicache.v1.TransferRequest"]["layer_begin"]
    f[key] = {"number": 99, "type": "TYPE_STRING", "label": "LABEL_REPEATED",
              "oneof": "x"}[key]
    broken = COMPAT.breaking_changes(old, new)
    assert len(broken) == 1 and "TransferRequest.layer_begin" in broken[0], what


def test_removals_and_renames_are_reported_additions_are_not() -> None:
    old = COMPAT.current()
    new = copy.deepcopy(old)
    msgs, enums, rpcs = new["messages"], new["enums"], new["services"]["hicache.v1.HostCache"]
    msgs["hicache.v1.Pool"]["page_count"] = msgs["hicache.v1.Pool"].pop("page_num")  # rename
    del msgs["hicache.v1.PingRequest"]
    enums["hicache.v1.DType"]["DTYPE_UINT8"] = 7
    rpcs["Load"] = {**rpcs["Load"], "output": ".hicache.v1.PingResponse"}
    del rpcs["Ping"]
    msgs["hicache.v1.Pool"]["added_later"] = {"number": 50, "type": "TYPE_INT64",
                                              "label": "LABEL_OPTIONAL", "type_name": "",
                                              "oneof": ""}
    rpcs["Added"] = {"input": ".hicache.v1.PingRequest", "output": ".hicache.v1.PingResponse"}
    broken = COMPAT.breaking_changes(old, new)
    assert len(broken) == 5, broken
    for needle in ("Pool.page_num", "PingRequest", "DTYPE_UINT8", "HostCache.Load",
                   "HostCache.Ping"):
        assert any(needle in b for b in broken), needle
