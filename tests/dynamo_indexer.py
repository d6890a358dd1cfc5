"""A real KV router for the router tests: Dynamo's standalone KV indexer (``python -m
dynamo.indexer`` from ``ai-dynamo-runtime``): its own ZMQ listener, msgpack decoder, replay
client and radix tree, queried over its HTTP API as a router's operator does.

The indexer's HTTP server binds every address, so it runs in a private network namespace
(``tests.mooncake_env.Netns``); it reaches the daemon's KV event streams through their
``ipc://`` sockets, which a network namespace does not separate, and the tests query it with
``nsenter``.

Primitives:

- ``unavailable()``: why these tests cannot run here ('' when they can).
- ``DynamoIndexer(netns, workdir, block_size, model)``: ``start()``, ``kill()``,
  ``register(instance, endpoint, replay_endpoint)``, ``query(tokens)`` -> the tokens of the
  longest cached prefix per registered instance (0 where none), ``until(what, timeout)``,
  ``queries()`` -> ``Queries``: the same question through one client process that stays in
  the namespace (``ask(tokens)``, ``close()``: milliseconds a query, for benchmarks).
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tests.mooncake_env import Netns

QUERIES = """
import json, sys, urllib.request
url = sys.argv[1]
for line in sys.stdin:
    r = urllib.request.Request(url, data=line.encode(),
                               headers={"Content-Type": "application/json"})
    sys.stdout.write(urllib.request.urlopen(r, timeout=5).read().decode().strip() + "\\n")
    sys.stdout.flush()
"""

POST = ("import sys, urllib.request; r = urllib.request.Request(sys.argv[1], "
        "data=sys.argv[2].encode(), headers={'Content-Type': 'application/json'}); "
        "sys.stdout.write(urllib.request.urlopen(r, timeout=5).read().decode())")


def unavailable() -> str:
    try:
        import dynamo.indexer  # noqa: F401
    except ImportError:
        return "Dynamo's indexer (ai-dynamo-runtime) is not installed"
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is missing (util-linux, iproute2)"
    return ""


class DynamoIndexer:
    def __init__(self, netns: Netns, workdir: Path, block_size: int, model: str = "m") -> None:
        self.netns, self.workdir = netns, workdir
        self.block_size, self.model = block_size, model
        self.port = random.randrange(20000, 40000)
        self.proc: subprocess.Popen[bytes] | None = None
        self.instances: set[int] = set()

    def start(self) -> None:
        log = open(self.workdir / "dynamo-indexer.log", "ab")  # noqa: SIM115 (the child's)
        self.proc = self.netns.popen(
            [sys.executable, "-m", "dynamo.indexer", "--port", str(self.port),
             "--block-size", str(self.block_size), "--model-name", self.model,
             "--threads", "1"], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.instances = set()
        # serving once its HTTP API answers
        self.netns.wait_http(f"http://127.0.0.1:{self.port}/workers", self.proc, self.log,
                             "Dynamo's indexer", 30)

    def log(self) -> str:
        return (self.workdir / "dynamo-indexer.log").read_text(errors="replace")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def post(self, path: str, body: dict[str, Any]) -> Any:
        out = self.netns.run([sys.executable, "-c", POST,
                              f"http://127.0.0.1:{self.port}{path}", json.dumps(body)])
        return json.loads(out) if out.strip() else None

    def register(self, instance: int, endpoint: str, replay_endpoint: str = "") -> None:
        """The instance follows ``endpoint`` (as an operator registers an engine)."""
        body: dict[str, Any] = {"instance_id": instance, "endpoint": endpoint,
                                "model_name": self.model, "block_size": self.block_size}
        if replay_endpoint:
            body["replay_endpoint"] = replay_endpoint
        self.post("/register", body)
        self.instances.add(instance)

    def query(self, tokens: Sequence[int] | np.ndarray, lora_name: str = "") -> dict[int, int]:
        """Per registered instance, the tokens of the longest prefix of ``tokens`` the
        router believes it has cached (0 where none); ``lora_name``: a request for that LoRA
        adapter (Dynamo hashes its blocks apart from the base model's)."""
        body: dict[str, Any] = {"token_ids": [int(t) for t in tokens], "model_name": self.model}
        if lora_name:
            body["lora_name"] = lora_name
        got = self.post("/query", body)
        matched = {int(i): int(v.get("longest_matched", 0))
                   for i, v in (got.get("instances") or {}).items()}
        return {i: matched.get(i, 0) for i in sorted(self.instances)}

    def queries(self) -> Queries:
        return Queries(self)

    def until(self, what: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline, \
                f"the router's view never came true\n{self.log()[-3000:]}"
            time.sleep(0.1)


class Queries:
    """``DynamoIndexer.query`` through one process that stays in the namespace."""

    def __init__(self, router: DynamoIndexer) -> None:
        self.router = router
        self.proc = router.netns.popen(
            [sys.executable, "-c", QUERIES, f"http://127.0.0.1:{router.port}/query"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def ask(self, tokens: Sequence[int] | np.ndarray) -> dict[int, int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        body = {"token_ids": [int(t) for t in tokens], "model_name": self.router.model}
        self.proc.stdin.write(json.dumps(body).encode() + b"\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the query client exited\n{self.router.log()[-2000:]}"
        got = json.loads(line)
        matched = {int(i): int(v.get("longest_matched", 0))
                   for i, v in (got.get("instances") or {}).items()}
        return {i: matched.get(i, 0) for i in sorted(self.router.instances)}

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
