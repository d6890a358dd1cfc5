"""A real router on the pages vLLM itself stores: vLLM 0.33's scheduler and connector drive the
spec against a real ``hicached serve`` whose pools each have their own KV event stream, and
Dynamo's standalone indexer (``tests.dynamo_indexer``), following the engine's pool, matches
the engine's prompts by their tokens: the stores carry them, and the key of the page before
(a prompt prefilled in two steps is stored in two, one chain), and names each block by
vLLM's own block hash, as vLLM's KV events do. Under vLLM's plain
``OffloadingConnector`` the manager is not handed the requests and the pages are told without
tokens: the router cannot match them (the limitation ``HicachedOffloadingConnector`` lifts).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_client import HiCacheClient
from tests.daemon_proc import DaemonProc, Daemons
from tests.dynamo_indexer import DynamoIndexer, unavailable
from tests.kv_event_workers import pool_stream_args
from tests.mooncake_env import Netns
from tests.vllm_harness import model_dir
from tests.vllm_runs import BS, run

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "available")


@pytest.fixture
def daemon(daemons: Daemons, tmp_path: Path) -> DaemonProc:
    return daemons.start(*pool_stream_args(tmp_path))


@pytest.mark.parametrize("connector", ["hicached", "plain"])
def test_a_router_matches_the_prompts_vllm_stored_by_their_tokens(
        daemon: DaemonProc, netns: Netns, tmp_path: Path, connector: str) -> None:
    got = run("router_tokens", model=str(model_dir(tmp_path)), target=daemon.target,
              connector=connector)
    assert got["block"] == BS
    with HiCacheClient(daemon.target) as c:
        pool = c.get_pool(got["pool"])
    router = DynamoIndexer(netns, tmp_path, block_size=pool.spec.page_size)
    router.start()
    try:
        router.register(1, pool.kv_events_endpoint, pool.kv_events_replay_endpoint)
        if connector == "plain":  # told without tokens: nothing to match
            router.until(lambda: router.query(got["prompt"]) == {1: 0}, 5)
            return
        # the snapshot the router's subscription gets: every page with its tokens and parent
        prompt = got["prompt"]
        router.until(lambda: router.query(prompt) == {1: len(prompt)}, 5)
        assert router.query([*prompt[:2 * BS], *range(7, 7 + 2 * BS)]) == {1: 2 * BS}
        assert got["manager"]["store_blocks"] == len(prompt) // BS
    finally:
        router.kill()


def test_the_daemon_names_vllms_blocks_as_vllm_does(daemon: DaemonProc, tmp_path: Path) -> None:
    """vLLM's own KV events (its GPU blocks, and the offloaded blocks its connector reports)
    and the daemon's pool stream name the prompt's blocks alike: a router following both sees
    one block per page, not two trees."""
    got = run("own_block_hashes", model=str(model_dir(tmp_path)), target=daemon.target)
    gpu, daemon_says = got["vllm"].get("GPU", []), got["daemon"]
    assert len(daemon_says) == 6 and len(set(daemon_says)) == 6, got
    assert daemon_says == gpu[:6], got
    offloaded = [h for medium, hs in got["vllm"].items() if medium != "GPU" for h in hs]
    assert sorted(offloaded) == sorted(daemon_says), got
    assert all(got["daemon_names"][str(h)] == [None, None] for h in daemon_says), got


def test_a_salted_request_s_blocks_are_named_as_vllm_names_them(daemon: DaemonProc,
                                                                tmp_path: Path) -> None:
    """A request with a cache salt (vLLM hashes it into its first block, so its blocks are
    other blocks than the same tokens' unsalted ones), through the connector that tells the
    manager each request: the daemon's events name the same block hashes as vLLM's GPU
    events, and say the salt vLLM's events carry; an unsalted request's say none."""
    got = run("own_block_hashes", model=str(model_dir(tmp_path)), target=daemon.target,
              cache_salt="tenant-7", connector="hicached")  # the connector that tells tokens
    gpu, daemon_says = got["vllm"].get("GPU", []), got["daemon"]
    assert len(daemon_says) == 6 and daemon_says == gpu[:6], got
    assert all(got["daemon_names"][str(h)] == [None, "tenant-7"] for h in daemon_says), got
    assert any("tenant-7" in (extra or ()) for _, extras in got["vllm_names"]
               for extra in (extras or ())), got  # vLLM's own events carry the salt
    plain = run("own_block_hashes", model=str(model_dir(tmp_path)), target=daemon.target,
                connector="hicached", expect=daemon_says)
    unsalted = plain["vllm"]["GPU"][:6]  # the same tokens unsalted: other blocks, also told
    assert not set(unsalted) & set(daemon_says) and set(unsalted) <= set(plain["daemon"]), plain
    named = plain["daemon_names"]  # this subscription's snapshot tells both prompts' blocks
    assert all(named[str(h)] == [None, None] for h in unsalted), plain
    assert all(named[str(h)] == [None, "tenant-7"] for h in daemon_says), plain


@pytest.mark.parametrize(("lookahead", "chunk", "connector"),
                         [(1, 1, "hicached"), (2, 2, "hicached"), (0, 2, "hicached"),
                          (1, 1, "plain")],
                         ids=["eagle", "mtp2-chunks-of-2", "no-lookahead", "plain-connector"])
def test_a_router_hashes_vllms_lookahead_blocks_again_from_what_the_daemon_told(
        daemon: DaemonProc, tmp_path: Path, lookahead: int, chunk: int, connector: str
        ) -> None:
    """vLLM 0.34's lookahead block hashes (EAGLE: 1 token after each block; an MTP chain of 2,
    with offloaded blocks of 2 vLLM blocks): the daemon's events, read with vLLM's decoder,
    name each page as vLLM names the page's last block, on its GPU and in its offloading
    connector's own events, with the lookahead tokens vLLM's events give that block (the
    tokens after the page); and vLLM's hash of each page's tokens and lookahead tokens, from
    the chain's first page on, is the block hash the daemon published: what a router that
    matches tokens as vLLM hashes them does. Without lookahead hashes no event says any; under
    vLLM's plain ``OffloadingConnector`` the daemon tells the blocks by the same hashes, with
    neither tokens nor lookahead tokens (the manager never sees the request)."""
    got = run("lookahead_block_hashes", model=str(model_dir(tmp_path)), target=daemon.target,
              lookahead=lookahead, chunk=chunk, connector=connector)
    prompt, page = got["prompt"], got["block"] * chunk
    told = got["daemon"]
    hashes = [h for h, _, _ in told]
    assert len(hashes) == 6 // chunk and len(set(hashes)) == len(hashes), got
    gpu = [h for h, _ in got["vllm"]["GPU"]][:6]
    assert hashes == gpu[chunk - 1::chunk], got  # each page is its last vLLM block
    vllm_ahead = {medium: {h: a for h, a in blocks} for medium, blocks in got["vllm"].items()}
    assert set(vllm_ahead) == {"GPU", "CPU"}, got
    assert set(hashes) <= set(vllm_ahead["CPU"]), got  # the connector's offloaded blocks
    assert got["parents"][0] is None, got
    for i, (h, ahead, tokens) in enumerate(told):
        end = (i + 1) * page
        want = prompt[end:end + lookahead] if lookahead else None
        assert vllm_ahead["GPU"][h] == vllm_ahead["CPU"][h] == want, (i, got)
        if connector == "plain":
            assert (ahead, tokens) == (None, []), (i, got)
            continue
        assert ahead == want and tokens == prompt[end - page:end], (i, got)
    if connector == "plain":
        assert got["recomputed"] == []
    else:
        assert got["recomputed"] == hashes, got  # a router's hashes are vLLM's
        assert got["manager"]["store_blocks"] == 6 // chunk
