"""The compatibility rule of the wire contract: proto changes are additive only.

A release snapshots the contract (every message's fields with number, type, label, message or
enum type and oneof; every enum value's number; every RPC's request and response) as JSON under
protos/released/. ``breaking_changes(old, new)`` lists what a later proto broke: a message,
field, enum value, service or RPC removed or renamed, or a field / value / RPC whose number or
type changed. Adding is always allowed. tests/client/test_api_compat.py runs it against the newest
snapshot.

Usage:
  python scripts/proto_compat.py --snapshot VERSION   write protos/released/hicache-v1-VERSION.json
  python scripts/proto_compat.py --check              compare the current proto with the newest
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parent.parent
RELEASED = ROOT / "protos" / "released"

Contract = dict[str, dict[str, Any]]


def _fields(msg: descriptor_pb2.DescriptorProto) -> dict[str, dict[str, Any]]:
    out = {}
    for f in msg.field:
        oneof = msg.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else ""
        out[f.name] = {
            "number": f.number,
            "type": descriptor_pb2.FieldDescriptorProto.Type.Name(f.type),
            "label": descriptor_pb2.FieldDescriptorProto.Label.Name(f.label),
            "type_name": f.type_name,
            "oneof": oneof,
        }
    return out


def describe(file_proto: descriptor_pb2.FileDescriptorProto) -> Contract:
    """The contract of one .proto file as plain data (what a snapshot stores)."""
    pkg = file_proto.package
    messages: dict[str, Any] = {}
    enums: dict[str, Any] = {}

    def walk(prefix: str, msgs: Any, enum_types: Any) -> None:
        for e in enum_types:
            enums[f"{prefix}.{e.name}"] = {v.name: v.number for v in e.value}
        for m in msgs:
            name = f"{prefix}.{m.name}"
            messages[name] = _fields(m)
            walk(name, m.nested_type, m.enum_type)

    walk(pkg, file_proto.message_type, file_proto.enum_type)
    services = {f"{pkg}.{s.name}": {m.name: {"input": m.input_type, "output": m.output_type}
                                    for m in s.method}
                for s in file_proto.service}
    return {"messages": messages, "enums": enums, "services": services}


def current() -> Contract:
    """The contract of the generated stubs now on the import path."""
    from hicache.v1 import hicache_pb2

    fp = descriptor_pb2.FileDescriptorProto()
    hicache_pb2.DESCRIPTOR.CopyToProto(fp)
    return describe(fp)


def breaking_changes(old: Contract, new: Contract) -> list[str]:
    """Everything ``new`` removed, renamed or changed of ``old`` (empty: compatible)."""
    out: list[str] = []
    for name, fields in old["messages"].items():
        now = new["messages"].get(name)
        if now is None:
            out.append(f"message {name} was removed or renamed")
            continue
        for field, was in fields.items():
            got = now.get(field)
            if got is None:
                out.append(f"field {name}.{field} (number {was['number']}) was removed or "
                           f"renamed")
            elif got != was:
                changed = ", ".join(f"{k} {was[k]!r} -> {got[k]!r}" for k in was
                                    if got.get(k) != was[k])
                out.append(f"field {name}.{field} changed: {changed}")
    for name, values in old["enums"].items():
        now = new["enums"].get(name)
        if now is None:
            out.append(f"enum {name} was removed or renamed")
            continue
        for value, number in values.items():
            if now.get(value) != number:
                out.append(f"enum value {name}.{value} = {number} was removed, renamed or "
                           f"renumbered (now {now.get(value)})")
    for name, methods in old["services"].items():
        now = new["services"].get(name)
        if now is None:
            out.append(f"service {name} was removed or renamed")
            continue
        for method, was in methods.items():
            if now.get(method) != was:
                out.append(f"rpc {name}.{method} was removed, renamed or retyped "
                           f"({was} -> {now.get(method)})")
    return out


def newest_snapshot() -> tuple[Path, Contract]:
    snaps = sorted(RELEASED.glob("hicache-v1-*.json"),
                   key=lambda p: tuple(int(x) for x in p.stem.rsplit("-", 1)[1].split(".")))
    if not snaps:
        raise SystemExit(f"no released snapshot under {RELEASED}")
    return snaps[-1], json.loads(snaps[-1].read_text())


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--snapshot":
        RELEASED.mkdir(parents=True, exist_ok=True)
        path = RELEASED / f"hicache-v1-{argv[1]}.json"
        path.write_text(json.dumps(current(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {path}")
        return 0
    if argv == ["--check"]:
        path, old = newest_snapshot()
        broken = breaking_changes(old, current())
        for line in broken:
            print(line)
        print(f"{len(broken)} breaking change(s) against {path.name}")
        return 1 if broken else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
