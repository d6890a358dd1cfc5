"""A real router on the pages SGLang itself stores: SGLang 0.5.23's cache classes write through
the hicached linker to a real ``hicached serve`` whose pools each have their own KV event
stream, and Dynamo's standalone indexer (``tests.dynamo_indexer``), following the engine's
pool, matches prompts by their tokens. SGLang hands the linker page keys only; the linker
tells each store the tree node's tokens and the key of the page before
(``hicache_sglang.origins``), so prompts that grew, split and diverged in SGLang's tree match
exactly as far as they were stored.
"""

from __future__ import annotations

from array import array
from pathlib import Path

import pytest

from hicache_client import HiCacheClient
from tests.daemon_proc import DaemonProc, Daemons
from tests.dynamo_indexer import DynamoIndexer, unavailable
from tests.helpers import require_module
from tests.kv_event_workers import pool_stream_args
from tests.mooncake_env import Netns

require_module("sglang", "sglang==0.5.23 (scripts/setup.sh --test)")

from tests.sglang_harness import PAGE, SGLangCache, tokens_of  # noqa: E402

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "available")


@pytest.fixture
def daemon(daemons: Daemons, tmp_path: Path) -> DaemonProc:
    return daemons.start(*pool_stream_args(tmp_path))


def test_a_router_matches_the_prompts_sglang_stored_by_their_tokens(
        daemon: DaemonProc, netns: Netns, tmp_path: Path) -> None:
    cache = SGLangCache(daemon.target, daemon.shm_dir)
    router = DynamoIndexer(netns, tmp_path, block_size=PAGE)
    try:
        with HiCacheClient(daemon.target) as c:
            pool = c.get_pool(cache.linker.spec.name)
        router.start()
        router.register(1, pool.kv_events_endpoint, pool.kv_events_replay_endpoint)
        a = tokens_of(1000, 6 * PAGE)
        cache.prefill(a[:3 * PAGE])  # a prompt, then its next turn: two nodes, one chain
        cache.poll_offloads()
        cache.prefill(a)
        cache.poll_offloads()
        b = a[:2 * PAGE] + tokens_of(5000, 2 * PAGE)  # splits the first node, then diverges
        cache.prefill(b)
        cache.poll_offloads()
        router.until(lambda: router.query(a) == {1: len(a)}, 5)
        assert router.query(b) == {1: len(b)}
        assert router.query([*a[:2 * PAGE], *range(9000, 9000 + 2 * PAGE)]) == {1: 2 * PAGE}
        assert router.query(tokens_of(7000, 4 * PAGE)) == {1: 0}
        stats = cache.linker.stats
        assert stats["offloads"] == 3 and stats["offloads_without_tokens"] == 0, stats
        # the device copy gone, the node still has it: the router's view is unchanged
        assert cache.evict_all() > 0
        assert router.query(a) == {1: len(a)}
        hit, failed, _ = cache.hit_and_load(array("q", a))
        assert (hit, failed) == (len(a), [])
    finally:
        router.kill()
        cache.close()
