"""SGLang 0.5.23's own cache, with its KV events on, writing through the hicached linker to a
daemon that publishes its own: for every page, the block hash in SGLang's
``BlockStored(medium=GPU)`` is the block hash in the daemon's ``BlockStored(medium=
CPU_PINNED)``, so a router sees one block whether the engine or the node's cache reports it.
Evicted from the device (SGLang's ``BlockRemoved(GPU)``), the page stays in the daemon's
report, and a later request loads it back from there.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.daemon_proc import DaemonProc, Daemons
from tests.helpers import require_module

require_module("sglang", "sglang==0.5.23 (scripts/setup.sh --test)")

from tests.kv_event_follower import Follower  # noqa: E402
from tests.sglang_harness import PAGE, SGLangCache, tokens_of  # noqa: E402


@pytest.fixture
def daemon(daemons: Daemons, tmp_path: Path) -> DaemonProc:
    return daemons.start("--no-shm-paths", f"--kv-events-endpoint=ipc://{tmp_path}/kv.sock",
                         f"--kv-events-replay-endpoint=ipc://{tmp_path}/r.sock")


def test_the_daemon_reports_sglangs_own_block_hashes(daemon: DaemonProc,
                                                     tmp_path: Path) -> None:
    f = Follower(f"ipc://{tmp_path}/kv.sock", f"ipc://{tmp_path}/r.sock")
    cache = SGLangCache(daemon.target, daemon.shm_dir, kv_events=True)
    try:
        time.sleep(0.2)
        f.sync()
        pool = cache.linker.spec.name
        tokens = tokens_of(1000, 3 * PAGE)
        cache.prefill(tokens)
        cache.poll_offloads()
        engine = cache.cache.take_events()
        gpu = [h for e in engine if type(e).__name__ == "BlockStored" and e.medium == "GPU"
               for h in e.block_hashes]
        assert len(gpu) == 3
        f.until(lambda: f.held(pool, "CPU_PINNED") == set(gpu))
        ours = [h for e in f.stored(pool, "CPU_PINNED") for h in e.block_hashes]
        assert ours == gpu  # the same blocks, in the same order
        assert cache.evict_all() == len(tokens)
        removed = [h for e in cache.cache.take_events()
                   if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]
        assert sorted(removed) == sorted(gpu)  # gone from the GPU ...
        f.poll(0.2)
        assert f.held(pool, "CPU_PINNED") == set(gpu)  # ... still on the node
        hit, failed, _ = cache.hit_and_load(tokens)
        assert (hit, failed) == (len(tokens), [])
    finally:
        cache.linker.close()
        f.close()
