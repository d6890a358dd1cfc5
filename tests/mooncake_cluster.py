"""A Mooncake cluster for the cluster-tier tests: a real master in a private network namespace
(``tests/mooncake_env.py``), daemons joined to it ("nodes"), and workers of one daemon that
store random pages and check loads into rows zeroed first. Importing it under CI where the
cluster cannot run fails (it says why); elsewhere ``WHY`` says why the tests skip.

Primitives: ``WHY``; ``PS``, ``GEOMETRY``, ``spec(name, pages, layout)``; ``Worker(daemon,
spec)``: ``store``, ``load_exact``, ``zeroed``, ``close``; fixtures ``cluster`` (the namespace
and master, per module) and ``master`` (started again if a test killed it); ``node(cluster,
workdir, ...)``; ``wait_tier``, ``wait_puts``; ``scrape``, ``scrape_names``, ``metric`` (the
daemon's metrics, fetched inside the namespace); ``keys_of(tag, n)``.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache_client import HiCacheClient, ShmDeviceBuffers, WorkerSession
from tests import prom
from tests.daemon_proc import DaemonProc, start_daemon
from tests.mooncake_env import Master, Netns, mooncake_toml, unavailable

WHY = unavailable()
if WHY and os.environ.get("CI"):
    raise RuntimeError(f"the cluster-tier tests cannot run: {WHY}")

PS = 16
GEOMETRY = KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 1, 16)


def spec(name: str, pages: int = 64, layout: Layout = Layout.LAYER_FIRST) -> PoolSpec:
    return PoolSpec(name, GEOMETRY, PS, layout, size_tokens=PS * pages)


class Worker:
    """A worker of one daemon: random pages stored, loads checked in zeroed rows."""

    def __init__(self, d: DaemonProc, sp: PoolSpec, rows: int = 32) -> None:
        self.spec = sp
        self.client = HiCacheClient(d.target)
        self.client.create_pool(sp)
        self.bufs = ShmDeviceBuffers.create(sp, rows * PS, sealed=True)
        self.rows = [t.view(torch.uint8) for t in self.bufs.all_tensors()]
        self.session: WorkerSession = self.client.open_session(
            sp.name, "w", self.bufs.descriptors, fds=self.bufs.fds, heartbeat=True)

    def store(self, keys: list[bytes]) -> dict[bytes, list[torch.Tensor]]:
        n = len(keys) * PS
        for r in self.rows:
            r[:n] = torch.randint(0, 256, r[:n].shape, dtype=torch.uint8)
        want = {k: [r[i * PS:(i + 1) * PS].clone() for r in self.rows]
                for i, k in enumerate(keys)}
        assert self.session.store(keys, torch.arange(n)).stored == len(keys)
        return want

    def load_exact(self, keys: list[bytes], want: dict[bytes, list[torch.Tensor]]) -> bool:
        for r in self.rows:
            r.zero_()
        self.session.load_keys(keys, torch.arange(len(keys) * PS))
        return all(torch.equal(r[i * PS:(i + 1) * PS], want[k][j])
                   for i, k in enumerate(keys) for j, r in enumerate(self.rows))

    def zeroed(self) -> bool:
        return all(int(r.count_nonzero()) == 0 for r in self.rows)

    def close(self) -> None:
        self.session.close()
        self.bufs.close()
        self.client.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Netns, Master]]:
    work = tmp_path_factory.mktemp("mooncake")
    ns = Netns()
    master = Master(ns, work)
    master.start()
    yield ns, master
    master.kill()
    ns.close()


@pytest.fixture
def master(cluster: tuple[Netns, Master]) -> Master:
    m = cluster[1]
    if m.proc is None or m.proc.poll() is not None:
        m.start()  # a test before this one killed it
    m.resume()
    return m


def node(cluster: tuple[Netns, Master], workdir: Path, *extra: str,
         env: dict[str, str] | None = None, **settings: object) -> DaemonProc:
    ns, m = cluster
    workdir.mkdir(exist_ok=True)
    cfg = workdir / "hicached.toml"
    cfg.write_text(mooncake_toml(m.address, segment_size="64MiB", **settings))
    d = start_daemon(workdir, "--config", str(cfg), *extra, prefix=ns.prefix, env=env)
    wait_tier(d, "up")
    return d


def wait_tier(d: DaemonProc, state: str, seconds: float = 30) -> str:
    deadline = time.monotonic() + seconds
    with HiCacheClient(d.target) as c:
        while not (got := c.get_info().cluster_tier).startswith(state):
            assert time.monotonic() < deadline, f"the tier stayed {got!r}, not {state!r}"
            time.sleep(0.05)
    return got


def wait_puts(w: Worker, n: int) -> None:
    deadline = time.monotonic() + 30
    while (p := w.client.get_pool(w.spec.name)).cluster_puts < n:
        assert time.monotonic() < deadline, f"only {p.cluster_puts} of {n} keys were put"
        time.sleep(0.02)


def scrape(ns: Netns, d: DaemonProc) -> str:
    port = re.findall(r"metrics port (\d+)", d.log())[-1]
    return ns.fetch(f"http://127.0.0.1:{port}/metrics")


def scrape_names(ns: Netns, d: DaemonProc) -> set[str]:
    return prom.names(scrape(ns, d))


def metric(ns: Netns, d: DaemonProc, name: str) -> float:
    return prom.value(scrape(ns, d), name)


def keys_of(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i:03d}".encode() for i in range(n)]
