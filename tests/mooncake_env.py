"""A private network namespace with a real Mooncake master in it, for the cluster-tier tests.

Mooncake's master and transfer engines bind wildcard addresses, so nothing of theirs runs on
this machine's network: a namespace made with ``unshare -n`` (``-rn``, a user namespace too,
when not root) holds only a loopback interface; the master and the daemons run in it
(``nsenter``), and tests reach the daemons through their Unix sockets, which a network
namespace does not separate.

Primitives:

- ``unavailable()``: why these tests cannot run here ('' when they can).
- ``Netns()``: ``popen(argv)``, ``run(argv)``, ``fetch(url)`` (HTTP inside),
  ``wait_http(url, proc, log, what, timeout)`` (until a server inside answers), ``prefix``
  (the ``nsenter`` argv), ``close()``.
- ``Master(netns, workdir)``: ``start()``, ``kill()``, ``pause()`` / ``resume()``
  (SIGSTOP / SIGCONT: a master that takes connections and never answers), ``address``.
- ``mooncake_toml(master, **settings)``: a ``[tier.mooncake]`` table for a daemon.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

FETCH = ("import sys, urllib.request; "
         "sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())")


def master_binary() -> str:
    import mooncake

    return str(Path(mooncake.__file__).parent / "mooncake_master")


def unavailable() -> str:
    try:
        binary = master_binary()
    except ImportError:
        return "the Mooncake wheel (mooncake-transfer-engine-non-cuda) is not installed"
    if not os.access(binary, os.X_OK):
        return f"{binary} is not executable"
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is missing (util-linux, iproute2)"
    probe = subprocess.run(["unshare", *_unshare_flags(), "true"], capture_output=True)
    if probe.returncode:
        return f"cannot make a network namespace: {probe.stderr.decode().strip()}"
    return ""


@functools.cache
def _unshare_flags() -> list[str]:
    """``-n`` as root; a user namespace too (``-rn``) otherwise, or where root may not make
    a network namespace by itself (a container without CAP_SYS_ADMIN)."""
    if os.geteuid() == 0 and subprocess.run(["unshare", "-n", "true"],
                                            capture_output=True).returncode == 0:
        return ["-n"]
    return ["-rn"]


class Netns:
    def __init__(self) -> None:
        self.holder = subprocess.Popen(["unshare", *_unshare_flags(), "sleep", "infinity"])
        ours = os.readlink("/proc/self/ns/net")
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{self.holder.pid}/ns/net") == ours:
            assert time.monotonic() < deadline, "unshare did not make a namespace"
            time.sleep(0.01)
        user = [] if _unshare_flags() == ["-n"] else ["-U", "--preserve-credentials"]
        self.prefix = ["nsenter", "-t", str(self.holder.pid), *user, "-n"]
        self.run(["ip", "link", "set", "lo", "up"])

    def popen(self, argv: list[str], **kw: object) -> subprocess.Popen[bytes]:
        return subprocess.Popen([*self.prefix, *argv], **kw)  # type: ignore[call-overload, no-any-return]

    def run(self, argv: list[str]) -> str:
        r = subprocess.run([*self.prefix, *argv], capture_output=True, timeout=60)
        assert r.returncode == 0, f"{argv} failed: {r.stderr.decode()}"
        return r.stdout.decode()

    def fetch(self, url: str) -> str:
        return self.run([sys.executable, "-c", FETCH, url])

    def wait_http(self, url: str, proc: subprocess.Popen[bytes], log: Callable[[], str],
                  what: str, timeout: float) -> None:
        """Until ``url`` answers inside: ``proc`` serving (its ``log`` in the failure when it
        exited first), or ``what did not start`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.fetch(url)
                return
            except AssertionError:
                assert proc.poll() is None, log()
                assert time.monotonic() < deadline, f"{what} did not start"
                time.sleep(0.2)

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait()


class Master:
    def __init__(self, netns: Netns, workdir: Path, client_ttl: int | None = None) -> None:
        """``client_ttl``: seconds the master keeps a silent node's segment (None: Mooncake's
        own default, 10 s, as an operator runs it)."""
        self.netns, self.workdir = netns, workdir
        self.client_ttl = client_ttl
        self.port = random.randrange(20000, 40000)
        self.metrics_port = self.port + 1
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        log = open(self.workdir / "mooncake-master.log", "ab")  # noqa: SIM115 (the child's)
        self.proc = self.netns.popen(
            [master_binary(), "--rpc_address=127.0.0.1", f"--rpc_port={self.port}",
             "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
             *([] if self.client_ttl is None else [f"--client_ttl={self.client_ttl}"])],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        # serving once its metrics endpoint answers
        self.netns.wait_http(f"http://127.0.0.1:{self.metrics_port}/metrics", self.proc,
                             self.log, "the Mooncake master", 20)

    def log(self) -> str:
        return (self.workdir / "mooncake-master.log").read_text(errors="replace")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


def mooncake_toml(master: str, **settings: object) -> str:
    """``[tier.mooncake]`` for a daemon of this namespace (loopback addresses, fast retry; a
    1 s timeout rather than the default 0.3 s, so that a test machine busy with other tests
    does not flap the tier)."""
    table: dict[str, object] = {"master": master, "local_hostname": "127.0.0.1",
                                "retry_seconds": 0.3, "timeout_seconds": 1.0, **settings}
    lines = ["[tier.mooncake]"]
    for k, v in table.items():
        lines.append(f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"')
    return "\n".join(lines) + "\n"
