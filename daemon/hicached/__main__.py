"""``hicached serve``: configuration from a TOML file, ``HICACHED_*`` environment and flags.

Precedence, lowest to highest: built-in defaults, the config file (``--config``), the
environment (``HICACHED_<SETTING>``, e.g. ``HICACHED_SHM_DIR``; lists comma-separated), flags.
SIGTERM / SIGINT (or the Drain RPC, ``hicachectl drain``) drain the daemon: NOT_SERVING, new
work refused with UNAVAILABLE, in-flight transfers finish, pools are freed. Argument and
environment parsing happen here only; everything below takes a ``ServerConfig``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import tomllib
from dataclasses import fields
from typing import Any

from hicache.errors import HiCacheError
from hicached.server.config import ServerConfig, config_from_mapping

ENV_PREFIX = "HICACHED_"
SIGNAL_CHECK_SECONDS = 0.25
"""How often the main thread wakes to run a signal's handler that another thread received."""
_FLAGS: dict[str, tuple[str, str]] = {
    # flag -> (setting, help)
    "--listen": ("listen", "gRPC target, repeatable: unix:PATH (default: a 0600 socket in "
                           "$XDG_RUNTIME_DIR/hicached) or HOST:PORT"),
    "--socket-mode": ("socket_mode", "API socket permissions: 0600 or 0660 (group workers)"),
    "--socket-group": ("socket_group", "group of the API socket (default: the daemon's)"),
    "--shm-dir": ("shm_dir", "the only directory workers may hand buffers from (/dev/shm)"),
    "--state-dir": ("state_dir", "pools as files that outlive the daemon (/dev/shm/hicached-UID; "
                                 "'' = none)"),
    "--metrics-listen": ("metrics_listen", "HOST:PORT of the Prometheus endpoint "
                                           "(127.0.0.1:9464; empty disables)"),
    "--memory-budget": ("memory_budget", "bytes all pools may use, e.g. 64GiB (default: half "
                                         "of available memory)"),
    "--reserve": ("reserve", "memory left to the host (1GiB)"),
    "--lease-seconds": ("lease_seconds", "session lease (5)"),
    "--max-lease-seconds": ("max_lease_seconds", "longest lease a worker may ask for (60)"),
    "--copy-threads": ("copy_threads", "threads per copy (0 = a quarter of the CPUs, 1 to 8)"),
    "--copy-spin-us": ("copy_spin_us", "microseconds copy threads spin after a job (0 = none)"),
    "--fast-path-spin-us": ("fast_path_spin_us", "most microseconds a fast-path connection "
                                                 "polls for the next request (200; 0 = none)"),
    "--fast-path-body-timeout-s": ("fast_path_body_timeout_s", "seconds a fast-path frame's "
                                                               "body may take to arrive (5)"),
    "--fast-path-inflight-bytes": ("fast_path_inflight_bytes", "bytes of fast-path frames "
                                                               "read at once (256MiB)"),
    "--max-keys-per-call": ("max_keys_per_call", "keys one call may name (65536)"),
    "--grpc-threads": ("grpc_threads", "concurrent RPCs (16)"),
    "--max-data-rpcs": ("max_data_rpcs", "data calls at once before OVERLOADED "
                                         "(grpc-threads - 4)"),
    "--max-pending-rpcs": ("max_pending_rpcs", "calls queued for a thread (256)"),
    "--health-listen": ("health_listen", "health-only gRPC target, repeatable (probes)"),
    "--max-watchers": ("max_watchers", "WatchEvents streams at once (4)"),
    "--grace-seconds": ("grace_seconds", "drain time on SIGTERM (10)"),
    "--max-hold-ms": ("max_hold_ms", "longest a Lookup's hold lasts (30000)"),
    "--max-held-fraction": ("max_held_fraction", "share of a pool one session may hold (0.25)"),
    "--eviction": ("eviction", "which pages a full pool evicts first: reuse or lru (reuse)"),
    "--tls-cert": ("tls_cert", "PEM certificate for TCP listeners"),
    "--tls-key": ("tls_key", "PEM key for TCP listeners"),
    "--tls-client-ca": ("tls_client_ca", "PEM CA that signs TCP clients' certificates (mTLS)"),
    "--auth-token-file": ("auth_token_file", "bearer token TCP clients must send (over TLS)"),
    "--log-format": ("log_format", "text or json"),
    "--log-level": ("log_level", "DEBUG, INFO, WARNING, ..."),
    "--cuda-driver": ("cuda_driver", "CUDA driver library for IPC and pinning (libcuda.so.1)"),
    "--cuda-copy-paths": ("cuda_copy_paths", "ways GPU copies may go, chosen per batch by "
                                             "measurement: dma[,batch][,kernel] (dma)"),
}
_KINDS = {f.name: str(f.type) for f in fields(ServerConfig)}
"""Each setting's type as ``ServerConfig`` declares it: how a string from the environment or
a flag is read (sizes and the octal ``socket_mode`` are read by ``config_from_mapping``)."""
_LISTS = {name for name, kind in _KINDS.items() if kind == "tuple[str, ...]"}
_BOOLS = {name for name, kind in _KINDS.items() if kind == "bool"}
_SUB_TABLES = (  # flags over one key of a table of the file: (flag, table path, key, help)
    ("--disk-path", ("tier", "disk"), "path", "directory of the disk tier ([tier.disk] path)"),
    ("--disk-capacity", ("tier", "disk"), "capacity",
     "disk tier size, e.g. 500GiB ([tier.disk])"),
    ("--mooncake-master", ("tier", "mooncake"), "master",
     "the Mooncake master, host:port ([tier.mooncake] master)"),
    ("--mooncake-hostname", ("tier", "mooncake"), "local_hostname",
     "this node's address for Mooncake transfers ([tier.mooncake] local_hostname)"),
    ("--kv-events-endpoint", ("kv_events",), "endpoint",
     "publish KV events (SGLang's ZMQ format) on this PUB endpoint: ipc:///path or a "
     "loopback tcp://127.0.0.1:PORT ([kv_events] endpoint; off by default)"),
    ("--kv-events-replay-endpoint", ("kv_events",), "replay_endpoint",
     "answer replay requests on this ROUTER endpoint ([kv_events] replay_endpoint)"),
    ("--kv-events-pool-endpoint", ("kv_events",), "pool_endpoint",
     "a KV event stream per pool, for routers that follow engine instances: "
     "ipc:///dir/{pool} ([kv_events] pool_endpoint)"),
    ("--kv-events-pool-replay-endpoint", ("kv_events",), "pool_replay_endpoint",
     "each pool's stream's replay socket: ipc:///dir/{pool}.replay ([kv_events] "
     "pool_replay_endpoint)"))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname,
               "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def _coerce(setting: str, value: str) -> Any:
    kind = _KINDS.get(setting)
    if kind == "float":
        return float(value)
    if kind == "int" and not setting.endswith("_bytes") and setting != "socket_mode":
        return int(value)
    if setting in _LISTS:
        return [v for v in value.split(",") if v]
    if kind == "bool":
        return value.lower() in ("1", "true", "yes", "on")
    return value


def build_config(args: argparse.Namespace, environ: dict[str, str]) -> ServerConfig:
    merged: dict[str, Any] = {}
    if args.config:
        with open(args.config, "rb") as f:
            merged.update(tomllib.load(f))
    settings = {s for s, _ in _FLAGS.values()} | _BOOLS
    for setting in sorted(settings):
        env = environ.get(ENV_PREFIX + setting.upper())
        if env is not None:
            merged[setting] = _coerce(setting, env)
    for flag, (setting, _) in _FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            merged[setting] = value if setting in _LISTS else _coerce(setting, value)
    if getattr(args, "insecure_tcp", False):
        merged["insecure_tcp"] = True
    if getattr(args, "no_shm_paths", False):
        merged["accept_shm_paths"] = False
    if getattr(args, "no_fast_path", False):
        merged["fast_path"] = False
    for flag, path, key, _help in _SUB_TABLES:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is None or (value == "" and path[0] == "tier"):
            continue
        table = merged  # copied on the way down: the file's tables stay as they were read
        for name in path:
            table[name] = dict(table.get(name, {}))
            table = table[name]
        table[key] = value
    return config_from_mapping(merged)


def _setup_logging(config: ServerConfig) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if config.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(config.log_level.upper())


def serve(config: ServerConfig) -> int:
    from hicache.errors import PinFailed
    from hicached.core.trusted_paths import UntrustedPath
    from hicached.server.app import create_server
    from hicached.server.locks import AlreadyServing

    _setup_logging(config)
    try:
        server, _bound = create_server(config, wait_ready=False)  # pools build meanwhile
    except (AlreadyServing, UntrustedPath, PinFailed) as exc:
        logging.getLogger("hicached").error("%s", exc)
        return 2
    def drain() -> None:
        t0 = time.monotonic()
        server.drain_and_stop()  # waits for a drain already under way
        logging.getLogger("hicached").info("drained in %.2fs", time.monotonic() - t0)

    def on_signal(signum: int, _frame: object) -> None:
        logging.getLogger("hicached").info("received %s", signal.Signals(signum).name)
        threading.Thread(target=drain, name="drain").start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # asleep until stopped: by a signal's drain, or by the Drain RPC (hicachectl drain). In
    # short waits: a signal the kernel hands to another thread (one of gRPC's or ZeroMQ's)
    # only flags the interpreter, and the handler runs when this thread next runs Python
    while not server.wait(SIGNAL_CHECK_SECONDS):
        pass
    for t in threading.enumerate():
        if t.name == "drain":
            t.join()  # its last log line
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="hicached", description="Host-memory KV cache daemon.",
        epilog="'hicached' with no command, or with flags only, is 'hicached serve'; "
               "'hicached serve --help' lists its flags. The control CLI is 'hicachectl'.")
    sub = ap.add_subparsers(dest="command", title="commands", metavar="{serve}")
    sp = sub.add_parser("serve", help="run the daemon (the default command)")
    sp.add_argument("--config", help="TOML config file")
    for flag, (setting, text) in _FLAGS.items():
        kw: dict[str, Any] = {"help": text, "default": None}
        if setting in _LISTS:
            kw["action"] = "append"
        sp.add_argument(flag, **kw)
    sp.add_argument("--insecure-tcp", action="store_true",
                    help="allow TCP listeners without TLS client authentication")
    for flag, _path, _key, text in _SUB_TABLES:
        sp.add_argument(flag, help=text)
    sp.add_argument("--no-shm-paths", action="store_true",
                    help="refuse shm buffers named by path: CPU workers hand over sealed memfds")
    sp.add_argument("--no-fast-path", action="store_true",
                    help="serve the data calls over gRPC only (no <socket>.fast)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["serve", *argv]
    args = ap.parse_args(argv)
    try:
        config = build_config(args, dict(os.environ))
    except (HiCacheError, OSError, tomllib.TOMLDecodeError, ValueError) as exc:
        print(f"hicached: invalid configuration: {exc}", file=sys.stderr)
        return 2
    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
