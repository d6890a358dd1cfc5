"""``hicachectl``: inspect and administer a running daemon.

Reads: ``status``, ``pools``, ``sessions`` (tables, or ``--json``); ``health [--service S]``
(exit 0 only when SERVING: a probe for containers whose API has no network port).
Admin verbs: ``delete-pool NAME`` (refused while sessions are open), ``clear-pool NAME`` (drop
every cached key; raw pages stay), ``close-session ID`` (the worker's mappings are released once
its in-flight copies end), ``drain [--grace S]`` (graceful shutdown, as SIGTERM),
``drop-state [NAME...] [--state-dir D]`` (delete pools a stopped daemon saved; a running one
deletes a pool's files with ``delete-pool``).
Exit status: 0 on success, 1 when the daemon refused (the reason code is printed), 2 on usage
errors.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
from collections.abc import Sequence

from google.protobuf.json_format import MessageToDict

from hicache.codec import spec_from_proto
from hicache.errors import HiCacheError
from hicache.paths import DEFAULT_STATE_DIR, remove_state
from hicache.v1 import hicache_pb2 as pb
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


def parser() -> argparse.ArgumentParser:
    """hicachectl's arguments: one subcommand per verb."""
    ap = argparse.ArgumentParser(prog="hicachectl", description="Inspect a hicached daemon.")
    ap.add_argument("--target", help="daemon address (default: the local socket)")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("status", help="version, transports, memory")
    hp = sub.add_parser("health", help="gRPC health; exit status 0 only when SERVING")
    hp.add_argument("--service", default="",
                    help="'' (liveness) or hicache.v1.HostCache (readiness)")
    sub.add_parser("pools", help="pools with occupancy")
    sp = sub.add_parser("sessions", help="open worker sessions")
    sp.add_argument("--pool", default="", help="only this pool")
    dp = sub.add_parser("delete-pool", help="delete a pool and free its memory")
    dp.add_argument("name")
    xp = sub.add_parser("clear-pool", help="drop every cached key of a pool (raw pages stay)")
    xp.add_argument("name")
    cp = sub.add_parser("close-session", help="close a worker session, releasing its mappings")
    cp.add_argument("session_id")
    rp = sub.add_parser("drop-state", help="delete saved pool state while no daemon uses it "
                                           "(a running daemon: delete-pool)")
    rp.add_argument("names", nargs="*", help="pools (default: every pool saved there)")
    rp.add_argument("--state-dir", default=DEFAULT_STATE_DIR,
                    help=f"the daemon's --state-dir ({DEFAULT_STATE_DIR})")
    gp = sub.add_parser("drain", help="graceful shutdown: refuse new work, finish in-flight "
                                      "transfers, stop")
    gp.add_argument("--grace", type=float, default=0.0,
                    help="seconds in-flight transfers may take (default: the daemon's)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "drop-state":
        return drop_state(args.state_dir, args.names, args.json)
    client = HiCacheClient(args.target, reconnect_seconds=2.0, timeout=10.0)
    try:
        return _run(client, args)
    except HiCacheError as exc:
        print(f"hicachectl: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()


def drop_state(state_dir: str, names: Sequence[str], as_json: bool) -> int:
    """Remove saved pools (``<name>.meta`` / ``.data``) from a state directory no daemon
    holds (its ``.lock``); refuses while one does."""
    try:
        fd = os.open(os.path.join(state_dir, ".lock"), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = -1
    if fd >= 0:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            print(f"hicachectl: hicached (pid {holder}) uses {state_dir}: drop a pool with "
                  "delete-pool while it runs", file=sys.stderr)
            return 1
        finally:
            os.close(fd)
    saved = sorted({f.rsplit(".", 1)[0] for f in _listdir(state_dir)
                    if f.endswith((".meta", ".data"))})
    missing = [n for n in names if n not in saved]
    if missing:
        print(f"hicachectl: no saved state for {', '.join(missing)} in {state_dir}",
              file=sys.stderr)
        return 1
    dropped = list(names) or saved
    for name in dropped:
        remove_state(state_dir, name)
    print(json.dumps({"dropped": dropped}) if as_json else
          f"dropped {', '.join(dropped) or 'nothing'}")
    return 0


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def _pool_row(p: pb.Pool) -> tuple[object, ...]:
    spec = spec_from_proto(p.spec)
    kinds = "+".join([spec.geometry.kind.value, *(s.geometry.kind.value
                                                  for s in spec.side_pools)])
    return (spec.name, kinds, spec.geometry.dtype.value.lower(), spec.layout.value,
            spec.page_size, p.page_num,
            f"{p.used_pages} ({100 * p.used_pages / max(p.page_num, 1):.0f}%)",
            _size(p.capacity_bytes), _share(p), p.tenant or "-", p.sessions, p.keys,
            f"{p.disk_keys}/{p.disk_capacity_pages}" if p.disk_capacity_pages else "-",
            f"{p.cluster_puts} put, {p.cluster_pending} waiting" if p.cluster_namespace else "-",
            p.raw_pages, p.busy_pages or p.pinned_pages, _state(p), p.attach_outcome or "-")


def _share(p: pb.Pool) -> str:
    """An elastic pool's share of the memory budget with its floor and ceiling ("-" for a pool
    of fixed size)."""
    if not p.share_bytes:
        return "-"
    return (f"{_size(p.share_bytes)} ({_size(p.floor_bytes)}.."
            f"{_size(p.ceiling_bytes)})")


def _state(p: pb.Pool) -> str:
    if p.state == pb.POOL_STATE_CREATING:
        return f"creating {p.progress:.0%}"
    return "FAILED: " + p.error_reason if p.state == pb.POOL_STATE_FAILED else "ready"


def _admin(client: HiCacheClient, args: argparse.Namespace) -> dict[str, object]:
    if args.command == "delete-pool":
        client.delete_pool(args.name)
        return {"deleted_pool": args.name}
    if args.command == "clear-pool":
        return {"cleared_pool": args.name, "keys_removed": client.clear_pool(args.name)}
    if args.command == "close-session":
        client.close_session(args.session_id)
        return {"closed_session": args.session_id}
    r = client.drain(args.grace)
    return {"draining": True, "grace_seconds": r.grace_seconds, "in_flight": r.in_flight,
            "already_draining": r.already_draining}


def _run(client: HiCacheClient, args: argparse.Namespace) -> int:
    if args.command == "health":
        ok = client.health(args.service)
        print(json.dumps({"serving": ok}) if args.json else
              ("SERVING" if ok else "NOT_SERVING"))
        return 0 if ok else 1
    if args.command in ("delete-pool", "clear-pool", "close-session", "drain"):
        done = _admin(client, args)
        print(json.dumps(done) if args.json else
              "  ".join(f"{k.replace('_', ' ')} {v}" for k, v in done.items()))
        return 0
    if args.command == "status":
        info = client.get_info()
        if args.json:
            print(json.dumps(MessageToDict(info, preserving_proto_field_name=True,
                                           always_print_fields_with_no_presence=True)))
            return 0
        print(_table(["field", "value"], [
            ("version", info.version), ("target", client.target),
            ("serving", info.serving),
            ("transports", ", ".join(info.transports)),
            ("budget", _size(info.memory_budget_bytes)),
            ("used", _size(info.memory_used_bytes)),
            ("host available", _size(info.memory_available_bytes)),
            ("shm dir", info.shm_dir), ("pools", info.pools), ("sessions", info.sessions),
            ("metrics port", info.metrics_port or "off"),
            ("cluster tier", info.cluster_tier or info.remote_tier or "none"),
            ("fast path", info.fast_path or "off"),
            ("kv events", (f"{info.kv_events_endpoint} (replay "
                           f"{info.kv_events_replay_endpoint or 'none'}, topic "
                           f"{info.kv_events_topic!r})") if info.kv_events_endpoint
             else "off"),
            ("data calls over", client.data_path),
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
        print(_table(["pool", "kind", "dtype", "layout", "page", "pages", "used", "capacity",
                      "share (floor..ceiling)", "tenant", "sessions", "keys", "disk",
                      "cluster", "raw", "busy", "state", "attach"],
                     [_pool_row(p) for p in resp.pools]))
        for p in resp.pools:  # where a router follows the instances of each pool
            if p.kv_events_endpoint:
                print(f"{p.spec.name}: KV events on {p.kv_events_endpoint}"
                      + (f" (replay {p.kv_events_replay_endpoint})"
                         if p.kv_events_replay_endpoint else ""))
        return 0
    sessions = client.list_sessions(args.pool)
    if args.json:
        print(json.dumps([MessageToDict(s, preserving_proto_field_name=True,
                                        always_print_fields_with_no_presence=True)
                          for s in sessions]))
        return 0
    print(_table(["session", "pool", "worker", "device", "attached", "expires in",
                  "transfers"], [
        (s.public_id, s.pool, s.worker_id, s.device_uuid or "shm", _size(s.attached_bytes),
         f"{s.expires_in_ms / 1000:.1f}s", s.transfers) for s in sessions]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
