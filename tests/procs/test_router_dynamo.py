"""Routers per instance, with a real router: Dynamo's standalone KV indexer follows each
pool's own KV event stream (``[kv_events] pool_endpoint``) of a real ``hicached serve`` into
which real worker processes store, and ``/query`` gives each registered instance its true
overlap: shared, partial and unrelated prefixes; another pool's pages never counted for it;
removals and eviction followed within a bounded lag; a router restarted, or an instance
registered late, knows the whole pool from the snapshot its subscription gets.

Instance 1 loads from pool ``kv-a``, instance 2 from ``kv-b`` (another model's, or another
rank's, pool on the same daemon); both are registered under one model name, so one radix tree
holds both and a pool's pages counted for the wrong instance would show.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hicache_client import HiCacheClient
from tests.daemon_proc import DaemonProc, Daemons
from tests.dynamo_indexer import DynamoIndexer, unavailable
from tests.kv_event_workers import (
    OTHER,
    PS,
    SPEC,
    Worker,
    chain,
    pool_stream_args,
    pool_streams,
)
from tests.mooncake_env import Netns

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "available")

LAG_S = 5.0
"""The longest the router may believe what is no longer true (events gather for 20 ms)."""


@pytest.fixture
def daemon(daemons: Daemons, tmp_path: Path) -> DaemonProc:
    return daemons.start(*pool_stream_args(tmp_path))


@pytest.fixture
def router(netns: Netns, tmp_path: Path) -> Iterator[DynamoIndexer]:
    r = DynamoIndexer(netns, tmp_path, block_size=PS)
    r.start()
    yield r
    r.kill()


def test_each_instance_scores_what_its_pool_holds_and_nothing_else(
        daemon: DaemonProc, router: DynamoIndexer, tmp_path: Path) -> None:
    a, b = Worker(daemon, SPEC), Worker(daemon, OTHER)
    try:
        got = pool_streams(daemon)
        assert got["kv-a"] == (f"ipc://{tmp_path}/ev/kv-a", f"ipc://{tmp_path}/ev/kv-a.replay")
        router.register(1, *got["kv-a"])
        router.register(2, *got["kv-b"])
        time.sleep(0.5)  # the subscriptions reach the daemon (each gets its pool's snapshot)
        mine, mine_t = chain(1, 4)  # only in kv-a
        theirs, theirs_t = chain(2, 3)  # only in kv-b
        shared, shared_t = chain(3, 2)  # in both
        assert a.store(mine, mine_t) == 4 and b.store(theirs, theirs_t) == 3
        assert a.store(shared, shared_t) == 2 and b.store(shared, shared_t) == 2
        router.until(lambda: router.query(mine_t) == {1: 16, 2: 0}, LAG_S)
        assert router.query(theirs_t) == {1: 0, 2: 12}
        assert router.query(shared_t) == {1: 8, 2: 8}
        partial = np.concatenate([mine_t[:2 * PS], chain(9, 2)[1]])
        assert router.query(partial) == {1: 8, 2: 0}
        assert router.query(chain(10, 4)[1]) == {1: 0, 2: 0}  # unrelated
        # a removal in kv-a: the router follows within the lag, kv-b's view unchanged
        with HiCacheClient(daemon.target) as c:
            assert c.remove_keys("kv-a", mine[2:]) == 2
            assert c.remove_keys("kv-b", shared) == 2
        router.until(lambda: router.query(mine_t) == {1: 8, 2: 0}, LAG_S)
        router.until(lambda: router.query(shared_t) == {1: 8, 2: 0}, LAG_S)
        # eviction: kv-a has 8 pages, 4 used (mine[:2], shared); 6 more evict the 2 least
        # recently used (mine[:2]), 2 more after them evict shared; the router is told
        more, more_t = chain(4, 6)
        assert a.store(more, more_t) == 6
        router.until(lambda: router.query(mine_t) == {1: 0, 2: 0}, LAG_S)
        assert router.query(shared_t) == {1: 8, 2: 0}
        assert a.store(*chain(7, 2)) == 2
        router.until(lambda: router.query(shared_t) == {1: 0, 2: 0}, LAG_S)
        assert router.query(more_t) == {1: 24, 2: 0}
    finally:
        a.close()
        b.close()


def test_a_router_restarted_or_an_instance_registered_late_knows_the_whole_pool(
        daemon: DaemonProc, router: DynamoIndexer) -> None:
    a = Worker(daemon, SPEC)
    try:
        keys, tokens = chain(5, 5)
        assert a.store(keys, tokens) == 5  # before any router follows
        got = pool_streams(daemon)
        router.register(1, *got["kv-a"])
        router.until(lambda: router.query(tokens) == {1: 20}, LAG_S)
        # the router dies and comes back empty: its new subscription gets the pool again
        router.kill()
        router.start()
        router.register(1, *got["kv-a"])
        router.register(3, *got["kv-a"])  # a second instance sharing the pool, late
        router.until(lambda: router.query(tokens) == {1: 20, 3: 20}, LAG_S)
        more, more_t = chain(6, 2)
        assert a.store(more, more_t, parent=b"") == 2
        router.until(lambda: router.query(more_t) == {1: 8, 3: 8}, LAG_S)
    finally:
        a.close()


def test_a_lora_adapter_s_pages_score_for_its_requests_only(
        daemon: DaemonProc, router: DynamoIndexer, tmp_path: Path) -> None:
    """Pages a Store named with a LoRA adapter are that adapter's to the router (Dynamo hashes
    a LoRA request's blocks apart): a request for the adapter matches them, the base model's
    request for the same tokens does not, and the base model's pages do not match the
    adapter's request; an instance registered later learns the names from its snapshot."""
    a = Worker(daemon, SPEC)
    try:
        got = pool_streams(daemon)
        router.register(1, *got["kv-a"])
        time.sleep(0.5)
        tuned, tuned_t = chain(21, 3)
        base, base_t = chain(22, 2)
        a.session.store(tuned, np.arange(3 * PS), token_ids=tuned_t, lora_name="sql-adapter")
        assert a.store(base, base_t) == 2
        router.until(lambda: router.query(tuned_t, "sql-adapter") == {1: 12}, LAG_S)
        assert router.query(tuned_t) == {1: 0}
        assert router.query(base_t) == {1: 8}
        assert router.query(base_t, "sql-adapter") == {1: 0}
        assert router.query(tuned_t, "other-adapter") == {1: 0}
        router.register(2, *got["kv-a"])  # late: the snapshot names the adapter too
        router.until(lambda: router.query(tuned_t, "sql-adapter") == {1: 12, 2: 12}, LAG_S)
        assert router.query(tuned_t) == {1: 0, 2: 0}
        assert router.query(base_t) == {1: 8, 2: 8}
    finally:
        a.close()
