"""A node of the cluster tier dies and comes back, at Mooncake's real timings.

Two daemons, "A" and "B", keep two replicas of every key in a real Mooncake master's store
(its default ``client_ttl``, 10 s: a SIGKILLed node's segment stays registered that long).
A is killed and restarted while B stores and loads and the restarted A loads what B stored
and stores keys of its own. Keys whose only readable copy is B's must load exact throughout
(Mooncake alone chooses the dead copy for some keys until the master drops it: the tier reads
another replica), and no key stored meanwhile may be dropped from the cluster (puts placed on
the dead segment fail until then: the writer tries them again for ``put_retry_seconds``).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from hicache.errors import KeyNotFound
from tests import prom
from tests.daemon_proc import DaemonProc
from tests.mooncake_cluster import (  # noqa: F401 (fixtures)
    WHY,
    Worker,
    cluster,
    keys_of,
    master,
    metric,
    node,
    scrape,
    spec,
    wait_puts,
)
from tests.mooncake_env import Master, Netns

pytestmark = pytest.mark.skipif(bool(WHY), reason=WHY)

TTL = 10.0
"""Mooncake's default ``client_ttl``: the master's of this module sets none."""


def _settle(w: Worker, seconds: float) -> None:
    """Until ``w``'s pool has nothing left to put (every key put or dropped)."""
    deadline = time.monotonic() + seconds
    while w.client.get_pool(w.spec.name).cluster_pending:
        assert time.monotonic() < deadline, "the writer never emptied its queue"
        time.sleep(0.1)


def test_a_node_killed_and_restarted_costs_no_hit_and_no_put(
        cluster: tuple[Netns, Master], master: Master, tmp_path: Path) -> None:
    ns, m = cluster
    assert m.client_ttl is None, "this test is about Mooncake's default client_ttl"
    a = node(cluster, tmp_path / "a", replicas=2)
    b = node(cluster, tmp_path / "b", replicas=2)
    sp = spec("death", pages=512)
    wa, wb = Worker(a, sp, rows=8), Worker(b, sp, rows=8)
    a2 = None
    try:
        before = keys_of("death-b", 240)  # two copies each: on A's segment and on B's
        want = {}
        for i in range(0, 240, 8):
            want.update(wb.store(before[i:i + 8]))
        wait_puts(wb, 240)
        wa.close()
        a.stop(signal.SIGKILL)
        killed = time.monotonic()
        # B meanwhile: stores and loads go on (its reads prefer its own copy)
        during_b = keys_of("death-during-b", 8)
        want.update(wb.store(during_b))
        assert wb.load_exact(before[:8], want)
        a2 = node(cluster, tmp_path / "a", replicas=2)
        wa2 = Worker(a2, sp, rows=8)
        restarted = time.monotonic() - killed
        loads, failed = 0, []
        during_a: list[bytes] = []
        i = 8
        # the restarted A reads B's keys from the cluster (4 it lacks each time) until well
        # past the moment the master drops the dead segment
        while time.monotonic() - killed < TTL + 2 and i + 4 <= len(before):
            batch = before[i:i + 4]
            i += 4
            try:
                ok = wa2.load_exact(batch, want)
            except KeyNotFound as exc:
                ok = False
                failed.append((round(time.monotonic() - killed, 2), str(exc)[:120]))
            else:
                if not ok:
                    failed.append((round(time.monotonic() - killed, 2), "not exact"))
            loads += 1
            mine = keys_of(f"death-during-a-{i}", 2)
            want.update(wa2.store(mine))
            during_a += mine
            time.sleep(0.25)
        fallbacks = metric(ns, a2, "hicache_cluster_replica_fallback_pages_total")
        print(f"restart {restarted:.2f} s; {loads} loads of B's keys by the restarted A, "
              f"{len(failed)} failed; {fallbacks:.0f} pages read from the other replica")
        assert not failed, f"loads of keys with a live replica failed: {failed}"
        assert loads >= 10 and time.monotonic() - killed > TTL
        # every key stored during the outage reaches the cluster: none dropped
        _settle(wa2, 40)
        _settle(wb, 40)
        assert metric_pool(ns, a2, "hicache_cluster_dropped_pages_total", sp.name) == 0
        assert metric_pool(ns, b, "hicache_cluster_dropped_pages_total", sp.name) == 0
        assert wb.client.lookup(sp.name, during_a).tiers == b"\x03" * len(during_a)
        assert wb.load_exact(during_a[:8], want)
        assert wa2.load_exact(during_b, want)
        wa2.close()
    finally:
        wb.close()
        for d in (a2, b):
            if d is not None:
                d.stop(signal.SIGTERM)


def metric_pool(ns: Netns, d: DaemonProc, name: str, pool: str) -> float:
    return prom.value(scrape(ns, d), name, pool=pool)
