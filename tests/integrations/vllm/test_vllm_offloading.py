"""hicached as vLLM's KV offloading backend, end to end on CPU: vLLM's own ``Scheduler`` and
``OffloadingConnector`` (both roles) load ``hicache_vllm.spec`` by module path and drive it
against a real ``hicached serve``; the engines run in processes of their own with a vLLM
release's code from ``.vllm-<release>`` (``tests/vllm_harness.py``,
``tests/scenarios_vllm.py``). Every scenario runs on the newest release served (0.34); the
core ones (``CORE``: store, hit, load exact, restart) on every release (0.33 too).

Every load is checked into KV zeroed first, against rows derived from each token's whole
prefix: a page in the wrong block, a stale page or a partial copy fails.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hicache_client import HiCacheClient
from tests.daemon_proc import REPO, DaemonProc, Daemons, start_daemon
from tests.vllm_harness import model_dir
from tests.vllm_runs import BS, CLEAN, CORE, RELEASES, engine, result, results, run, wait_file


@pytest.fixture
def daemon(daemons: Daemons) -> DaemonProc:
    return daemons.start()


@pytest.fixture
def model(tmp_path: Path) -> str:
    return str(model_dir(tmp_path))


def vllm_pools(target: str) -> dict[str, int]:
    with HiCacheClient(target) as c:
        return {p.spec.name: p.keys for p in c.list_pools() if p.spec.name.startswith("vllm-")}


@CORE
def test_a_prompt_stored_comes_back_exact_after_a_prefix_cache_reset(daemon: DaemonProc,
                                                                      model: str,
                                                                      vllm: str) -> None:
    got = run("store_reset_reload", vllm=vllm, model=model, target=daemon.target, blocks=5)
    assert got["first"] == CLEAN
    assert got["miss_scheduled_at_once"]  # a miss costs the request no step
    assert got["stored"]["store_pages"] == 5
    assert got["loaded"] == 5 * BS  # every block of the prefix came from the daemon
    assert got["second"] == CLEAN  # into KV zeroed first
    assert got["worker"]["load_pages"] == 5 and got["worker"]["load_failures"] == 0
    assert got["manager"]["held_blocks"] >= 5  # the hit was held before vLLM loaded it
    # the hit answered in the step that scanned it (the request's keys in one Lookup): no
    # RETRY, no step lost
    assert got["manager"]["deferred"] == 0 and got["manager"]["lookups"] == 2
    # what vLLM's metrics show of it: every count once, and the link up
    first, again = got["vllm_stats"]
    assert first["vllm:kv_offload_hicached_held_blocks"] == got["manager"]["held_blocks"]
    assert first["vllm:kv_offload_hicached_store_blocks"] == got["manager"]["store_blocks"]
    assert first["vllm:kv_offload_hicached_load_blocks"] == 5
    assert first["vllm:kv_offload_hicached_lookups"] == 2
    assert first["vllm:kv_offload_hicached_links_up"] == 1
    assert not any(k.startswith("vllm:kv_offload_hicached_") and not k.endswith("links_up")
                   for k in again)
    assert {k for k in first if k.startswith("vllm:kv_offload_hicached_")} <= set(
        got["declared"])  # vLLM's Prometheus side knows each name it is sent
    assert "Traceback" not in got["stderr"]
    assert list(vllm_pools(daemon.target).values()) == [5]


def test_a_second_engine_process_hits_what_the_first_stored(daemon: DaemonProc,
                                                           model: str) -> None:
    first = run("store_only", model=model, target=daemon.target, blocks=4)
    assert first["first"] == CLEAN and first["worker"]["store_pages"] == 4
    second = run("reload_only", model=model, target=daemon.target, blocks=4)
    assert second["loaded"] == 4 * BS
    assert second["second"] == CLEAN


def test_a_partial_prefix_loads_what_is_shared_and_computes_the_rest(daemon: DaemonProc,
                                                                     model: str) -> None:
    run("store_only", model=model, target=daemon.target, blocks=5)
    got = run("reload_only", model=model, target=daemon.target, blocks=5, shared=3)
    assert got["loaded"] == 3 * BS
    assert got["second"] == CLEAN
    assert got["worker"]["load_pages"] == 3


def test_blocks_only_the_disk_tier_holds_are_a_hit_and_load_exact(daemons: Daemons,
                                                                  tmp_path: Path,
                                                                  model: str) -> None:
    """A host pool of four blocks over a disk tier: a prompt's four blocks spilled, then
    evicted by another prompt's, are found on disk only. A fresh engine's lookup is answered
    with what the daemon promises (kept on disk for it, promoted for its load), so vLLM is told
    HIT and loads them back exact, into KV zeroed first."""
    # the disk is shared by the pools' shares of the memory budget: 64 GiB over the default
    # 2 GiB budget gives this pool 32 pages below its 4; one session may hold the whole pool
    # (a promise below host memory is bounded by the session's share of it)
    d = daemons.start("--disk-path", str(tmp_path / "disk"), "--disk-capacity", "64GiB",
                      "--max-held-fraction", "1")
    small = {"pool_size_tokens": 4 * BS}
    run("store_only", model=model, target=d.target, blocks=4, seed=3, extra=small)
    (pool,) = vllm_pools(d.target)
    with HiCacheClient(d.target) as c:
        wait_for(lambda: c.get_pool(pool).disk_keys >= 4, "the first prompt spilled")
        run("store_only", model=model, target=d.target, blocks=4, seed=4, extra=small)
        wait_for(lambda: c.get_pool(pool).disk_keys >= 8, "the second prompt spilled")
        assert c.get_pool(pool).keys == 4  # host memory holds the second prompt only
    got = run("reload_only", model=model, target=d.target, blocks=4, seed=3, extra=small)
    assert got["manager"]["held_blocks"] >= 4, got["manager"]  # promised from the disk
    assert got["loaded"] == 4 * BS and got["worker"]["load_failures"] == 0
    assert got["second"] == CLEAN


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {timeout:.0f} s"
        time.sleep(0.02)


def test_preemption_flushes_stores_and_every_request_ends_exact(daemon: DaemonProc,
                                                                model: str) -> None:
    got = run("preemption", model=model, target=daemon.target)
    assert got["preempted"] >= 1
    assert got["checks"] == {f"r{i}": CLEAN for i in range(3)}
    assert got["worker"]["store_pages"] >= 8 and got["worker"]["load_failures"] == 0


@CORE
def test_a_killed_daemon_means_misses_then_hits_again_after_its_restart(
        tmp_path: Path, model: str, vllm: str) -> None:
    sync = tmp_path / "sync"
    sync.mkdir()
    d = start_daemon(tmp_path)
    proc = engine("daemon_restart", vllm=vllm, model=model, target=d.target,
                  sync_dir=str(sync))
    try:
        wait_file(sync / "stored", proc)
        d.stop(signal.SIGKILL)
        (sync / "killed").touch()
        wait_file(sync / "missed", proc)
        d = start_daemon(tmp_path)  # the same state directory: the pool comes back
        (sync / "restarted").touch()
        got = result(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
        d.stop()
    assert got["first"] == CLEAN
    assert got["down_loaded"] == 0  # a miss: no hit is promised by a daemon that is not there
    assert got["down"] == CLEAN  # computed, nothing raised into the scheduler
    assert got["down_manager"]["lookups_down"] + got["down_manager"]["lookup_failures"] > 0
    assert got["down_manager"]["stores_dropped"] >= 1  # dropped and counted, never raised
    assert got["up_loaded"] == 4 * BS  # the restarted daemon's pool, reached again by itself
    assert got["up"] == CLEAN
    # new requests are stored and hit within about a second of the daemon serving again
    # (the links reconnect every reconnect_interval_s, 1 s)
    after = got["after"]
    assert after["first_hit_s"] is not None and after["first_hit_s"] < 1.5, after


def test_a_stopped_daemon_never_holds_the_scheduler_past_the_lookup_deadline(
        tmp_path: Path, model: str) -> None:
    """SIGSTOP: the daemon accepts connections and answers nothing. The scheduler's thread
    waits on it only in lookups, each bounded by ``lookup_timeout_s``; after the first misses
    it the link is late and skipped; the request is computed."""
    sync = tmp_path / "sync"
    sync.mkdir()
    d = start_daemon(tmp_path)
    deadline = 0.3
    proc = engine("stopped_daemon", model=model, target=d.target, sync_dir=str(sync),
                  extra={"lookup_timeout_s": deadline})
    try:
        wait_file(sync / "stored", proc)
        d.proc.send_signal(signal.SIGSTOP)
        (sync / "stopped").touch()
        wait_file(sync / "missed", proc)
        d.proc.send_signal(signal.SIGCONT)
        (sync / "continued").touch()
        got = result(proc)
    finally:
        d.proc.send_signal(signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
        d.stop()
    assert got["first"] == CLEAN
    assert got["stopped_loaded"] == 0 and got["stopped"] == CLEAN  # computed, nothing raised
    assert got["stopped_manager"]["lookup_failures"] + got["stopped_manager"]["lookups_down"] >= 1
    # the one lookup that met the stopped daemon waited its deadline, no step waited longer
    # (the margin: the stand-in forward and vLLM's own step on a loaded machine)
    assert got["longest_step_s"] < deadline + 0.5, got["longest_step_s"]
    assert got["up_loaded"] == 4 * BS and got["up"] == CLEAN  # back by itself, hits again


def test_a_hit_is_held_through_another_writer_filling_the_pool(daemon: DaemonProc,
                                                                model: str) -> None:
    got = run("held_hit_survives_eviction", model=model, target=daemon.target)
    assert got["filled"] >= 16  # the filler's pages went in, evicting all that was not held
    assert got["loaded"] == 4 * BS
    assert got["second"] == CLEAN
    assert got["worker"]["load_failures"] == 0


@pytest.mark.parametrize("touch", [False, True])
def test_blocks_vllm_touches_are_the_last_the_daemon_evicts(daemon: DaemonProc, model: str,
                                                            touch: bool) -> None:
    """vLLM 0.33's manager API has ``touch`` (0.34's has not: there the manager is never
    told of the engine's own prefix hits), though its connector never calls it (its tiering
    manager does): called as it would be, the touched blocks outlive the ones stored after
    them; untouched, the oldest go first, the tail of a chain before its head (the daemon's
    ``reuse`` eviction), so what is left of it still hits. The scheduler's thread only queues
    the touch."""
    got = run("touch_keeps_pages", vllm=RELEASES[-1], model=model, target=daemon.target,
              touch=touch)
    assert got["filled"] == 10
    kept, gone = "01" * 4, "01" * 2 + "00" * 2
    assert (got["a"], got["b"]) == ((kept, gone) if touch else (gone, kept))
    assert got["manager"].get("touched_blocks", 0) == (4 if touch else 0)
    assert got["returned_s"] < 0.05


def test_sglang_and_vllm_on_one_daemon_at_once_each_exact(tmp_path: Path, model: str) -> None:
    """The same model served by SGLang's linker and vLLM's spec: two pools (their pages are
    laid out differently), each engine exact, at the same time."""
    from tests.helpers import require_module

    require_module("sglang", "sglang==0.5.23 (scripts/setup.sh --test)")
    import torch

    from tests.sglang_harness import LAYERS, SGLangCache, tokens_of

    d = start_daemon(tmp_path, "--no-shm-paths")
    try:
        proc = engine("store_reset_reload", model=model, target=d.target, blocks=5)
        cache = SGLangCache(d.target, d.shm_dir, model=model)
        try:
            for start in range(0, 600, 200):
                tokens = tokens_of(start, 64)
                assert cache.offload_and_evict(tokens) == len(tokens)
                cache.zero_kv()
                hit, failed, slots = cache.hit_and_load(tokens)
                assert (hit, failed) == (len(tokens), []) and slots is not None
                for role in cache.roles:
                    for layer in range(LAYERS):
                        assert torch.equal(cache.layer_rows(role, layer, slots),
                                           cache.expected(tokens, role, layer))
        finally:
            cache.close()
        got = result(proc)
        with HiCacheClient(d.target) as c:
            names = [p.spec.name for p in c.list_pools()]
    finally:
        d.stop(signal.SIGKILL)
    assert got["loaded"] == 5 * BS and got["second"] == CLEAN
    assert len(names) == 2 and sorted(n.split("-")[0] for n in names) == ["sgl", "vllm"]


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_tensor_parallel_ranks_store_and_load_their_pages(daemon: DaemonProc, tmp_path: Path,
                                                          mla: bool) -> None:
    """Two ranks in two processes (gloo): MHA pages differ per rank (a pool each, a block a
    hit only when both hold it); MLA pages are the same on every rank (one pool, rank 0
    writes, both read)."""
    from tests.helpers import free_port
    from tests.vllm_harness import mla_model_dir

    m = str(mla_model_dir(tmp_path) if mla else model_dir(tmp_path))
    port = free_port()
    procs = [engine("tp_roundtrip", model=m, target=daemon.target, rank=r, port=port, mla=mla)
             for r in range(2)]
    r0, r1 = results(procs)
    assert r0["loaded"] == 4 * BS
    assert r0["results"] == {"a": CLEAN, "b": CLEAN} == r1["results"]
    pools = vllm_pools(daemon.target)
    if not mla:  # rank 1's pool loses the last block: both ranks load three
        rank1 = sorted(pools)[1]
        port = free_port()  # one rendezvous for both ranks
        procs = [engine("tp_roundtrip", model=m, target=daemon.target, rank=r, port=port,
                        drop_last_of=rank1) for r in range(2)]
        d0, d1 = results(procs)
        assert d0["removed"] == 1 and d0["loaded"] == 3 * BS
        assert d0["results"] == {"a": CLEAN, "b": CLEAN} == d1["results"]
    if mla:
        assert list(pools.values()) == [4] and r0["pools"][0].endswith("-rankall")
        assert r0["worker"]["store_pages"] == 4 and r1["worker"]["store_pages"] == 0
    else:
        assert sorted(pools) == sorted(r0["pools"]) and list(pools.values()) == [4, 4]
        assert r0["worker"]["store_pages"] == 4 == r1["worker"]["store_pages"]
    assert r0["worker"]["load_pages"] == 4 == r1["worker"]["load_pages"]


def readme_vllm_serve() -> list[str]:
    """The ``vllm serve`` command of README.md's "Use with vLLM", as a shell splits it."""
    import re
    import shlex

    text = (REPO / "README.md").read_text()
    section = text.split("## Use with vLLM", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, re.S)
    return shlex.split(block.replace("\\\n", " "))


def pod_vllm_serve(name: str) -> list[str]:
    from tests.deploy_files import KUBE, docs

    pod = docs(KUBE / name)[0]
    (c,) = [c for c in pod["spec"]["containers"] if c["name"] == "vllm"]
    return [*c["command"], *c["args"]]


@pytest.mark.parametrize("source", ["README.md", "vllm-pod.yaml", "vllm-sidecar-pod.yaml"])
def test_the_documented_vllm_serve_lines_parse_with_vllms_own_parser(tmp_path: Path,
                                                                     source: str) -> None:
    argv = readme_vllm_serve() if source == "README.md" else pod_vllm_serve(source)
    got = run("parse_serve", argv=argv, model=str(model_dir(tmp_path)))
    assert got["kv_role"] == "kv_both"
    assert got["spec"] == "hicache_vllm.spec.HicachedOffloadingSpec"  # as vLLM's factory finds it
    # the connector with vLLM's load-error path: a load given up is recomputed
    assert got["connector_class"] == "hicache_vllm.connector.HicachedOffloadingConnector"
    assert got["failure_policy"] == "recompute"
    assert got["block_size"] == 16 and got["model"].startswith("meta-llama/")
    if source != "README.md":
        assert got["extra"]["target"] == "unix:/run/hicached/api/hicached.sock"


def test_each_scenario_runs_in_an_engine_process_of_its_own() -> None:
    """``run`` forks every scenario from one process that imported vLLM: each child is a new
    process with no thread but its own, and a failing one says why."""
    import os

    first, second = run("whoami"), run("whoami")
    assert first["pid"] != second["pid"] and os.getpid() not in (first["pid"], second["pid"])
    assert first["parent"] == second["parent"] != os.getpid()  # the zygote, not the test
    assert first["threads"] == 1 == second["threads"]  # (faulthandler's watchdog is C)
    with pytest.raises(AssertionError, match="RuntimeError: a scenario that fails"):
        run("whoami", fail=True)


def test_a_scenario_runs_in_a_test_process_holding_more_files_than_select_can_watch() -> None:
    """A test process that has opened over FD_SETSIZE (1,024) files (a worker of the
    parallel suite, after other files' tests) still reads its scenario's answer."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the file limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        from tests import vllm_runs

        for zygote in vllm_runs._zygotes.values():  # the next zygote's pipe opens above them
            zygote.close()
        vllm_runs._zygotes.clear()
        assert run("whoami")["threads"] == 1
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.alone  # 0.1 s of margin over the deadline: beside other tests it measures them
def test_one_lookup_deadline_covers_every_ranks_pool() -> None:
    got = run("lookup_deadline_across_pools", timeout=0.3, slow=0.2)
    assert got["failed"] == "DeadlinePassed"  # the second pool's Lookup had 0.1 s left
    assert got["took_s"] < 0.3 + 0.1, got["took_s"]  # not 0.2 + 0.2, nor 2 x the deadline
    assert got["reported"] == [[], ["DeadlinePassed"]]
    # the first pool's hold of the 4 keys let go, off the caller's thread
    assert [(i, n) for i, n, _ in got["released"]] == [(0, 4)]
    assert got["released"][0][2] == "hicache-vllm-holds"


def test_the_managers_books_stay_bounded_and_its_counters_exact() -> None:
    got = run("manager_books_stay_bounded", followed=70_000, threads=4, each=20_000)
    assert got["kept"] == got["max"] and got["newest"] == "r69999"
    assert got["oldest"] == f"r{70_000 - got['max']}"
    assert got["count"] == 4 * 20_000 and got["monotonic"]


def test_a_stores_chain_carries_the_lookahead_tokens_after_each_page() -> None:
    """vLLM's lookahead block hashes: a page's row is the L tokens after the page's end (what
    vLLM's events say for the page's key, its last block), one row per page, sliced with the
    pages of a staged round; a store whose last page's tokens after it are not all known yet
    carries no chain, nor one under more lookahead than the daemon takes; without lookahead
    the chain is what it was."""
    got = run("lookahead_chains")
    tokens = list(range(100, 141))
    pages = tokens[8:20]  # pages 2-4 of 4 tokens
    assert got["plain"] == {"tokens": pages, "parent": got["parent_of_2"], "lookahead": None}
    assert got["three"] == {"tokens": pages, "parent": got["parent_of_2"],
                            "lookahead": [tokens[12:15], tokens[16:19], tokens[20:23]]}
    assert got["round"] is not None and got["round"]["tokens"] == tokens[12:20]
    assert got["round"]["lookahead"] == [tokens[16:19], tokens[20:23]]
    assert got["round"]["parent"] == (bytes([2]) * 32 + bytes(4)).hex()  # the round before
    assert got["tail"] is None and got["too_many"] is None
