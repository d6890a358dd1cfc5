"""The cluster tier end to end: a real Mooncake master and two daemons, "node A" and "node B".

Everything Mooncake runs inside a private network namespace (``tests/mooncake_env.py``);
workers are this test process, talking to each daemon over its Unix socket with sealed memfd
buffers. Keys stored through A are found through B (tier 3) and load there exact, into rows
zeroed first; a key that vanished fails B's load whole; A killed and restarted, B still loads
(two replicas); the master killed, both daemons keep serving host memory, report the tier
down, and bring it back up by themselves when the master returns; a master that stops
answering costs a Lookup at most the timeout, once.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hicache.errors import KeyNotFound
from hicache.specs import Layout
from tests.daemon_proc import REPO, DaemonProc
from tests.deploy_files import CLUSTER_TIER, deploy_metric_names, documented_metric
from tests.mooncake_cluster import (  # noqa: F401 (fixtures)
    PS,
    WHY,
    Worker,
    cluster,
    keys_of,
    master,
    metric,
    node,
    scrape,
    scrape_names,
    spec,
    wait_puts,
    wait_tier,
)
from tests.mooncake_env import Master, Netns

pytestmark = pytest.mark.skipif(bool(WHY), reason=WHY)


@pytest.fixture
def pair(cluster: tuple[Netns, Master], master: Master, tmp_path: Path,
         request: pytest.FixtureRequest) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    """Nodes A and B with the settings of the test's ``tier`` mark."""
    mark = request.node.get_closest_marker("tier")
    settings = mark.kwargs if mark is not None else {}
    a = node(cluster, tmp_path / "a", **settings)
    b = node(cluster, tmp_path / "b", **settings)
    yield a, b
    for d in (a, b):  # a clean stop unmounts their segments
        d.stop(signal.SIGTERM)


def test_stored_on_a_found_and_loaded_exact_on_b(cluster: tuple[Netns, Master],
                                                  pair: tuple[DaemonProc, DaemonProc],
                                                  tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    a, b = pair
    sp = spec("share")
    wa, wb = Worker(a, sp), Worker(b, sp)
    try:
        keys = keys_of("share", 24)
        want = wa.store(keys)
        wait_puts(wa, 24)
        look = wb.client.lookup(sp.name, [*keys, b"never-stored"])
        assert look.tiers == b"\x03" * 24 + b"\x00" and look.hit_prefix == 24
        assert wb.load_exact(keys, want)  # pulled into B's host memory, then copied
        assert wb.client.lookup(sp.name, keys).tiers == b"\x01" * 24
        ns = cluster[0]
        assert metric(ns, b, "hicache_cluster_get_pages_total") == 24
        assert metric(ns, a, "hicache_cluster_put_pages_total") == 24
        assert metric(ns, b, "hicache_cluster_up") == 1
        for name in ("get_pages_total", "put_pages_total", "up"):  # the deprecated names
            for d in (a, b):
                assert metric(ns, d, f"hicache_remote_{name}") == \
                    metric(ns, d, f"hicache_cluster_{name}")
        info, pool = wa.client.get_info(), wa.client.get_pool(sp.name)
        assert info.remote_tier == info.cluster_tier == "up"
        assert pool.cluster_puts == pool.remote_puts == 24
        from hicache_client.cli import main as hicachectl

        capsys.readouterr()
        assert hicachectl(["--target", a.target, "status"]) == 0
        assert re.search(r"cluster tier\s+up", capsys.readouterr().out)
        assert hicachectl(["--target", a.target, "pools"]) == 0
        assert "24 put, 0 waiting" in capsys.readouterr().out
        scraped = scrape_names(ns, b)
        ours = {n for n in scraped if n.startswith(CLUSTER_TIER)}
        used = {n for n in deploy_metric_names() if n.startswith(CLUSTER_TIER)}
        assert used and used <= scraped, used - scraped  # dashboard and alerts
        doc = (REPO / "docs" / "operations.md").read_text()
        assert ours and {n for n in ours if not documented_metric(n, doc)} == set()
        # the same name with another layout is another namespace: never these pages
        other = spec("share", layout=Layout.PAGE_FIRST)
        c = node(cluster, tmp_path / "c")
        try:
            wc = Worker(c, other)
            assert wc.client.lookup(other.name, keys).hits == 0
            wc.close()
        finally:
            c.stop(signal.SIGTERM)
    finally:
        wa.close()
        wb.close()


def test_a_key_vanished_fails_the_load_whole(pair: tuple[DaemonProc, DaemonProc]) -> None:
    a, b = pair
    sp = spec("vanish")
    wa, wb = Worker(a, sp), Worker(b, sp)
    try:
        keys = keys_of("vanish", 8)
        want = wa.store(keys)
        wait_puts(wa, 8)
        assert wb.client.lookup(sp.name, keys).tiers == b"\x03" * 8
        assert wa.client.remove_keys(sp.name, keys[5:6]) == 1  # from A's host and the cluster
        assert wb.client.lookup(sp.name, keys).tiers == b"\x03" * 5 + b"\x00" + b"\x03" * 2
        for r in wb.rows:
            r.zero_()
        with pytest.raises(KeyNotFound) as exc:
            wb.session.load_keys(keys, torch.arange(len(keys) * PS))
        assert exc.value.metadata["first_missing_position"] == "5"
        assert wb.zeroed(), "a failed load moved bytes"
        # a load that had to fail took no host pages: nothing was pulled in for it
        assert wb.client.get_pool(sp.name).keys == 0
        rest = keys[:5] + keys[6:]
        assert wb.load_exact(rest, want)
    finally:
        wa.close()
        wb.close()


@pytest.mark.tier(replicas=2)
def test_a_restarted_b_still_loads(cluster: tuple[Netns, Master],
                                   pair: tuple[DaemonProc, DaemonProc], tmp_path: Path) -> None:
    a, b = pair
    sp = spec("restart")
    wa, wb = Worker(a, sp), Worker(b, sp)
    keys = keys_of("restart", 16)
    want = wa.store(keys)
    wait_puts(wa, 16)
    wa.close()
    a.stop(signal.SIGKILL)  # its segment, with one replica of each key, is gone
    try:
        assert wb.client.lookup(sp.name, keys).tiers == b"\x03" * 16
        assert wb.load_exact(keys, want)
        a2 = node(cluster, tmp_path / "a", replicas=2)
        try:
            wa2 = Worker(a2, sp)
            assert wa2.load_exact(keys, want)  # its own pool came back from the state dir
            wa2.close()
        finally:
            a2.stop(signal.SIGTERM)
    finally:
        wb.close()


def test_master_killed_nodes_serve_host_then_recover(cluster: tuple[Netns, Master],
                                                     pair: tuple[DaemonProc, DaemonProc]
                                                     ) -> None:
    ns, m = cluster
    a, b = pair
    sp = spec("outage")
    wa, wb = Worker(a, sp), Worker(b, sp)
    try:
        keys = keys_of("outage", 8)
        want = wa.store(keys)
        wait_puts(wa, 8)
        m.kill()
        for d in (a, b):
            wait_tier(d, "down")
            assert metric(ns, d, "hicache_cluster_up") == 0
        t0 = time.monotonic()
        assert wa.client.lookup(sp.name, keys).tiers == b"\x01" * 8  # host memory serves
        assert wb.client.lookup(sp.name, keys).hits == 0  # the cluster is not asked
        assert time.monotonic() - t0 < 0.5
        assert wa.load_exact(keys, want)
        with pytest.raises(KeyNotFound):
            wb.session.load_keys(keys, torch.arange(8 * PS))
        more = keys_of("outage-more", 4)
        want.update(wa.store(more))  # Store never waits on the tier
        m.start()
        for d in (a, b):
            wait_tier(d, "up")
            assert metric(ns, d, "hicache_cluster_down_transitions_total") >= 1
        # a new master knows no keys; what is stored from now on is shared again
        late = keys_of("outage-late", 4)
        want.update(wa.store(late))
        deadline = time.monotonic() + 30
        while wb.client.lookup(sp.name, late).hits < 4:
            assert time.monotonic() < deadline, "keys stored after the outage never arrived"
            time.sleep(0.05)
        assert wb.load_exact(late, want)
    finally:
        wa.close()
        wb.close()


@pytest.mark.tier(timeout_seconds=0.5)
def test_master_not_answering_costs_one_timeout(cluster: tuple[Netns, Master],
                                                pair: tuple[DaemonProc, DaemonProc]) -> None:
    _, m = cluster
    _, b = pair
    sp = spec("stall")
    wb = Worker(b, sp)
    try:
        m.pause()  # connections stay open, nothing answers
        t0 = time.monotonic()
        assert wb.client.lookup(sp.name, [b"x"]).hits == 0
        first = time.monotonic() - t0
        assert first < 0.5 + 1.0, f"a Lookup waited {first:.2f} s on a stalled master"
        assert wait_tier(b, "down", 5).startswith("down")
        t0 = time.monotonic()
        for _ in range(10):
            assert wb.client.lookup(sp.name, [b"x"]).hits == 0
        assert time.monotonic() - t0 < 0.5, "a down tier was asked again"
        m.resume()
        wait_tier(b, "up")
    finally:
        m.resume()
        wb.close()


@pytest.mark.tier(timeout_seconds=0.5, retry_seconds=5.0)
def test_a_late_get_never_lands_in_a_reused_page(cluster: tuple[Netns, Master],
                                                 pair: tuple[DaemonProc, DaemonProc]) -> None:
    """B's LoadKeys of X times out on a stalled master and fails; the page the get would write
    is not handed to the next Store (Y) while the get can still land: when the master
    resumes and the late get completes, Y still holds Y's bytes."""
    _, m = cluster
    a, b = pair
    sp = spec("late", pages=8)
    wa, wb = Worker(a, sp), Worker(b, sp)
    try:
        want = wa.store([b"X"])
        wait_puts(wa, 1)
        assert wb.client.lookup(sp.name, [b"X"]).tiers == b"\x03"
        m.pause()
        with pytest.raises(KeyNotFound):
            wb.session.load_keys([b"X"], torch.arange(PS))
        for r in wb.rows:
            r[:PS] = torch.randint(0, 256, r[:PS].shape, dtype=torch.uint8)
        want_y = {b"Y": [r[:PS].clone() for r in wb.rows]}
        assert wb.session.store([b"Y"], torch.arange(PS)).stored == 1
        m.resume()
        wait_tier(b, "up")
        deadline = time.monotonic() + 30  # the late get ends, its pages go back
        while wb.client.get_pool(sp.name).busy_pages:
            assert time.monotonic() < deadline, "the late get's pages were never released"
            time.sleep(0.05)
        assert wb.load_exact([b"Y"], want_y), "a late get wrote into Y's page"
        assert wb.load_exact([b"X"], want)  # and X loads once the master answers
    finally:
        m.resume()
        wa.close()
        wb.close()


@pytest.mark.tier(timeout_seconds=0.5)
def test_a_key_removed_while_the_tier_is_down_does_not_come_back(
        cluster: tuple[Netns, Master], pair: tuple[DaemonProc, DaemonProc]) -> None:
    """A's tier goes down (the master stalls); RemoveKeys on A then cannot reach the cluster:
    the key is never found through A, and once the tier is back up A removes it there too, so
    B stops finding it. Stored again, it is shared again."""
    _, m = cluster
    a, b = pair
    sp = spec("tomb")
    wa, wb = Worker(a, sp), Worker(b, sp)
    try:
        wa.store([b"K"])
        wait_puts(wa, 1)
        assert wb.client.lookup(sp.name, [b"K"]).tiers == b"\x03"
        m.pause()
        assert wa.client.lookup(sp.name, [b"absent"]).hits == 0  # times out: A goes down
        assert wait_tier(a, "down").startswith("down")
        assert wa.client.remove_keys(sp.name, [b"K"]) == 1  # host memory only: A is down
        assert wa.client.lookup(sp.name, [b"K"]).tiers == b"\x00"
        m.resume()
        wait_tier(a, "up")
        assert wa.client.lookup(sp.name, [b"K"]).tiers == b"\x00"
        deadline = time.monotonic() + 20
        while wb.client.lookup(sp.name, [b"K"]).hits:
            assert time.monotonic() < deadline, "a removed key came back from the cluster"
            time.sleep(0.1)
        want = wa.store([b"K"])
        wait_puts(wa, 2)
        assert wb.load_exact([b"K"], want)
    finally:
        m.resume()
        wa.close()
        wb.close()


@pytest.mark.parametrize("seam", ["cluster.borrowed", "cluster.put"])
@pytest.mark.parametrize("how", ["remove", "clear"])
def test_a_removal_during_a_put_does_not_leave_the_key_in_the_cluster(
        cluster: tuple[Netns, Master], master: Master, tmp_path: Path, how: str,
        seam: str) -> None:
    """A's writer has borrowed a key's page (before its put, or after it but before it
    records it: a 1 s pause there) when the key is removed (RemoveKeys or ClearPool): the put
    is skipped or undone, and B does not find the key for good."""
    a = node(cluster, tmp_path / "a", env={"HICACHE_SEAM_DELAYS": f"{seam}=1000000"})
    b = node(cluster, tmp_path / "b")
    sp = spec(f"racing-{how}-{seam.split('.')[1]}")
    wa, wb = Worker(a, sp), Worker(b, sp)
    try:
        wa.store([b"R"])
        time.sleep(0.4)  # the put ran; the writer sits in the pause before it checks
        if how == "remove":
            assert wa.client.remove_keys(sp.name, [b"R"]) == 1
        else:
            wa.client.clear_pool(sp.name)
        deadline = time.monotonic() + 10
        while wb.client.lookup(sp.name, [b"R"]).hits:  # there for a moment, then undone
            assert time.monotonic() < deadline, "the removed key stayed in the cluster"
            time.sleep(0.05)
        time.sleep(1.5)
        assert wb.client.lookup(sp.name, [b"R"]).hits == 0, "the removed key came back"
        assert wa.client.lookup(sp.name, [b"R"]).hits == 0
    finally:
        wa.close()
        wb.close()
        a.stop(signal.SIGTERM)
        b.stop(signal.SIGTERM)


@pytest.mark.tier(write_policy="evict", queue_size="8KiB")
def test_evict_policy_puts_what_host_memory_gives_up(pair: tuple[DaemonProc, DaemonProc]
                                                     ) -> None:
    a, b = pair
    sp = spec("evict", pages=16)  # 2 KiB pages: 4 written ahead of eviction
    wa, wb = Worker(a, sp), Worker(b, sp)
    try:
        keys = keys_of("evict", 48)
        want: dict[bytes, list[torch.Tensor]] = {}
        for i in range(0, 48, 4):  # each batch waits until what became old is in the cluster
            want.update(wa.store(keys[i:i + 4]))
            if i + 4 > 12:
                wait_puts(wa, i + 4 - 12)
        look = wa.client.lookup(sp.name, keys)
        assert look.tiers[:16].count(3) >= 16 - 4 and look.hits == 48, look.tiers
        assert wa.client.get_pool(sp.name).cluster_puts < 48  # only what aged was put
        assert wa.load_exact(keys[:8], want)  # A's evicted keys come back from the cluster
        assert wb.load_exact(keys[:8], want)
    finally:
        wa.close()
        wb.close()


def test_evict_policy_beside_a_disk_tier(cluster: tuple[Netns, Master], master: Master,
                                         tmp_path: Path) -> None:
    """Keys leaving A's host memory go to A's disk and to the cluster: A finds them on its
    disk (tier 2), B in the cluster (tier 3); both load them exact."""
    a = node(cluster, tmp_path / "a", "--disk-path", str(tmp_path / "disk"), "--disk-capacity",
             "64GiB", write_policy="evict", queue_size="8KiB")
    b = node(cluster, tmp_path / "b")
    sp = spec("evict-disk", pages=16)
    wa, wb = Worker(a, sp), Worker(b, sp)
    try:
        keys = keys_of("evict-disk", 32)
        want: dict[bytes, list[torch.Tensor]] = {}
        for i in range(0, 32, 4):  # both spillers idle before more arrives (a 16-page pool)
            want.update(wa.store(keys[i:i + 4]))
            if i + 4 > 12:
                wait_puts(wa, i + 4 - 12)
            deadline = time.monotonic() + 20
            while wa.client.get_pool(sp.name).disk_keys < i + 4:  # the disk takes them all
                assert time.monotonic() < deadline, "the disk spiller fell behind"
                time.sleep(0.01)
        on_a = wa.client.lookup(sp.name, keys).tiers
        assert on_a.count(0) == 0 and on_a[:8] == b"\x02" * 8, on_a
        assert wb.client.lookup(sp.name, keys[:8]).tiers == b"\x03" * 8
        assert wa.load_exact(keys[:8], want)
        assert wb.load_exact(keys[:8], want)
    finally:
        wa.close()
        wb.close()
        for d in (a, b):
            d.stop(signal.SIGTERM)


def test_clear_pool_clears_its_namespace(pair: tuple[DaemonProc, DaemonProc]) -> None:
    a, b = pair
    sp = spec("clear")
    wa, wb = Worker(a, sp), Worker(b, sp)
    other = spec("clear-other")
    wo = Worker(a, other)
    try:
        wa.store(keys_of("clear", 6))
        wo.store(keys_of("clear", 6))
        wait_puts(wa, 6)
        wait_puts(wo, 6)
        assert wa.client.clear_pool(sp.name) == 6
        assert wb.client.lookup(sp.name, keys_of("clear", 6)).hits == 0
        wb.client.create_pool(other)
        assert wb.client.lookup(other.name, keys_of("clear", 6)).tiers == b"\x03" * 6
    finally:
        for w in (wa, wb, wo):
            w.close()


def test_a_corrupt_object_is_never_served(cluster: tuple[Netns, Master],
                                          pair: tuple[DaemonProc, DaemonProc]) -> None:
    """One bad node must not poison the others: an object whose bytes do not match its
    digest is not loaded, is counted, and is removed from the store."""
    import subprocess
    import sys

    from hicached.tiers.cluster import namespace

    ns, m = cluster
    _, b = pair
    sp = spec("poison")
    wb = Worker(b, sp)
    try:
        name = namespace(sp, "hicache") + b"bad-key".hex()
        r = subprocess.run([*ns.prefix, sys.executable, "-m", "tests.mooncake_poison",
                            m.address, name, str(sp.page_bytes + 8)], cwd=REPO, text=True,
                           capture_output=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert wb.client.lookup(sp.name, [b"bad-key"]).tiers == b"\x03"
        for rows in wb.rows:
            rows.zero_()
        with pytest.raises(KeyNotFound):  # served, it would land in the zeroed rows
            wb.session.load_keys([b"bad-key"], torch.arange(PS))
        assert wb.zeroed(), "a corrupt page reached the worker"
        text = scrape(ns, b)
        assert re.search(r'^hicache_cluster_checksum_failures_total{pool="poison"} 1\.0$',
                         text, re.M), text
        assert wb.client.lookup(sp.name, [b"bad-key"]).tiers == b"\x00", "still in the store"
    finally:
        wb.close()


def test_kv_events_tell_puts_and_removals_in_the_cluster(cluster: tuple[Netns, Master],
                                                         master: Master, tmp_path: Path) -> None:
    """Node A's KV event stream (decoded with SGLang's own decoder) tells every page it put
    as EXTERNAL and every removal it made there; node B, promoting them, tells its own host
    memory (its stream, not A's, is where they became local)."""
    from tests.kv_event_follower import Follower
    from tests.kv_event_workers import sglang_hash

    streams = {}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        streams[name] = (f"--kv-events-endpoint=ipc://{tmp_path}/{name}/kv.sock",
                         f"--kv-events-replay-endpoint=ipc://{tmp_path}/{name}/r.sock")
    a = node(cluster, tmp_path / "a", *streams["a"])
    b = node(cluster, tmp_path / "b", *streams["b"])
    fa = Follower(f"ipc://{tmp_path}/a/kv.sock", f"ipc://{tmp_path}/a/r.sock")
    fb = Follower(f"ipc://{tmp_path}/b/kv.sock", f"ipc://{tmp_path}/b/r.sock")
    sp = spec("events")
    wa, wb = Worker(a, sp), Worker(b, sp)
    try:
        keys = keys_of("events", 6)
        want = wa.store(keys)
        wait_puts(wa, 6)
        hashes = {sglang_hash(k) for k in keys}
        fa.until(lambda: fa.held(sp.name, "EXTERNAL") == hashes)
        assert fa.held(sp.name, "CPU_PINNED") == hashes
        assert wb.load_exact(keys, want)  # B promotes from the cluster
        fb.until(lambda: fb.held(sp.name, "CPU_PINNED") == hashes)
        assert not fb.held(sp.name, "EXTERNAL")  # B put none of them
        assert wa.client.remove_keys(sp.name, keys[:2]) == 2
        fa.until(lambda: fa.held(sp.name, "EXTERNAL") == hashes - {sglang_hash(k)
                                                                  for k in keys[:2]})
        wa.client.clear_pool(sp.name)
        fa.until(lambda: not fa.held(sp.name, "EXTERNAL") and not fa.held(sp.name,
                                                                          "CPU_PINNED"))
    finally:
        for w in (wa, wb):
            w.close()
        for f in (fa, fb):
            f.close()
        for d in (a, b):
            d.stop(signal.SIGTERM)
