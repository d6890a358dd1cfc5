"""``hicachectl``: status, pools and sessions of a running daemon, as tables or ``--json``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from google.protobuf.json_format import MessageToDict

from hicache.errors import HiCacheError
from hicache_client.client import HiCacheClient


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hicachectl", description="Inspect a hicached daemon.")
    ap.add_argument("--target", help="daemon address (default: the local socket)")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("status", help="version, transports, memory")
    sub.add_parser("pools", help="pools with occupancy")
    sp = sub.add_parser("sessions", help="open worker sessions")
    sp.add_argument("--pool", default="", help="only this pool")
    args = ap.parse_args(argv)
    client = HiCacheClient(args.target, reconnect_seconds=2.0, timeout=10.0)
    try:
        return _run(client, args)
    except HiCacheError as exc:
        print(f"hicachectl: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()


def _run(client: HiCacheClient, args: argparse.Namespace) -> int:
    if args.command == "status":
        info = client.get_info()
        if args.json:
            print(json.dumps(MessageToDict(info, preserving_proto_field_name=True,
                                           always_print_fields_with_no_presence=True)))
            return 0
        print(_table(["field", "value"], [
            ("version", info.version), ("serving", info.serving),
            ("transports", ", ".join(info.transports)),
            ("budget", _size(info.memory_budget_bytes)),
            ("used", _size(info.memory_used_bytes)),
            ("host available", _size(info.memory_available_bytes)),
            ("shm dir", info.shm_dir), ("pools", info.pools), ("sessions", info.sessions),
            ("metrics port", info.metrics_port or "off"),
            *((f"gpu {d.ordinal}", f"{d.uuid} {d.name} {_size(d.total_bytes)}")
              for d in info.cuda_devices)]))
        return 0
    if args.command == "pools":
        resp = client.list_pools_raw()
        if args.json:
            print(json.dumps([MessageToDict(p, preserving_proto_field_name=True,
                                            always_print_fields_with_no_presence=True)
                              for p in resp.pools]))
            return 0
        print(_table(["pool", "kind", "layout", "page", "pages", "used", "capacity",
                      "sessions"], [
            (p.spec.name, p.spec.kind, p.spec.layout, p.spec.page_size, p.page_num,
             f"{p.used_pages} ({100 * p.used_pages / max(p.page_num, 1):.0f}%)",
             _size(p.capacity_bytes), p.sessions) for p in resp.pools]))
        return 0
    sessions = client.list_sessions(args.pool)
    if args.json:
        print(json.dumps([MessageToDict(s, preserving_proto_field_name=True,
                                        always_print_fields_with_no_presence=True)
                          for s in sessions]))
        return 0
    print(_table(["session", "pool", "worker", "device", "attached", "expires in",
                  "transfers"], [
        (s.session_id, s.pool, s.worker_id, s.device_uuid or "shm", _size(s.attached_bytes),
         f"{s.expires_in_ms / 1000:.1f}s", s.transfers) for s in sessions]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
