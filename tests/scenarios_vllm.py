"""Scenarios run by ``tests/vllm_harness.py`` in a vLLM subprocess; each returns what it saw.

Nothing of ``hicache_vllm`` is imported here at the top: vLLM loads it where an engine starts
(``refused_at_start`` relies on that)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from tests.vllm_harness import Engine


def _prompt(n: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 104729) % 997 + 1 for i in range(n)]


def store_reset_reload(model: str, target: str, blocks: int = 5, extra_tokens: int = 9,
                       **kw: Any) -> dict[str, Any]:
    """A prompt stored; the prefix cache reset and the KV zeroed; the same prefix loaded back."""
    from hicache_vllm.spec import HicachedOffloadingSpec

    e = Engine(model, target, **kw)
    bs = e.block_size
    prompt = _prompt(blocks * bs + 1)
    e.add("a", prompt)
    # nothing cached: told MISS at once (its first key looked up now), scheduled in this step
    scheduled = [r.req_id for r in e.step().scheduled_new_reqs]
    asked = e.manager_stats()
    at_once = scheduled == ["a"] and asked["lookups"] == 1 and not asked["lookups_down"]
    e.run()
    first = e.results.get("a")
    stored = e.worker_stats()
    assert e.scheduler.reset_prefix_cache()
    e.zero()
    e.add("b", prompt[:blocks * bs] + _prompt(extra_tokens, seed=2))
    e.run()
    # what vLLM's steps collected for its metrics (its connector, its scheduler side, then the
    # manager), summed by vLLM's own aggregation; then one more collection: nothing new
    cls = type(e.scheduler.connector)
    total = None
    for payload in e.connector_payloads:
        got = cls.build_kv_connector_stats(data=payload)
        total = got if total is None else total.aggregate(got)
    reported = [total, e.scheduler.connector.get_kv_connector_stats()]
    out = {"first": first, "second": e.results.get("b"), "loaded": e.loaded_tokens["b"],
           "stored": stored, "worker": e.worker_stats(), "manager": e.manager_stats(),
           "miss_scheduled_at_once": at_once,
           "vllm_stats": [r.reduce() if r is not None else None for r in reported],
           "declared": sorted(HicachedOffloadingSpec.build_metric_definitions({}))}
    e.close()
    return out


def store_only(model: str, target: str, blocks: int = 4, seed: int = 3, **kw: Any
               ) -> dict[str, Any]:
    """One engine stores a prompt and goes away (its session ends; the pages stay)."""
    e = Engine(model, target, **kw)
    prompt = _prompt(blocks * e.block_size + 1, seed)
    e.add("a", prompt)
    e.run()
    out = {"first": e.results.get("a"), "worker": e.worker_stats()}
    e.close()
    return out


def reload_only(model: str, target: str, blocks: int = 4, seed: int = 3, shared: int = -1,
                **kw: Any) -> dict[str, Any]:
    """A fresh engine (its KV all zeros) asks for a prompt whose first ``shared`` blocks
    (all when -1) another engine stored: they load back, the rest is computed."""
    e = Engine(model, target, **kw)
    bs = e.block_size
    shared = blocks if shared < 0 else shared
    prompt = _prompt(blocks * bs + 1, seed)[:shared * bs] + _prompt(blocks * bs, seed + 50)
    e.add("b", prompt[:blocks * bs + 1])
    e.run()
    out = {"second": e.results.get("b"), "loaded": e.loaded_tokens["b"],
           "worker": e.worker_stats(), "manager": e.manager_stats()}
    e.close()
    return out


def preemption(model: str, target: str, **kw: Any) -> dict[str, Any]:
    """Too few engine blocks for the requests' decodes: vLLM preempts (its store jobs flushed)
    and resumes them; every prompt token's KV is exact in the end, whatever was loaded."""
    e = Engine(model, target, num_blocks=14, **kw)
    bs = e.block_size
    prompts = {f"r{i}": _prompt(4 * bs + 1, 20 + i) for i in range(3)}
    for rid, p in prompts.items():
        e.add(rid, p, max_tokens=3 * bs)
    preempted = 0
    end = time.monotonic() + 60
    while e.scheduler.has_unfinished_requests() and time.monotonic() < end:
        out = e.step()
        preempted += len(getattr(out, "preempted_req_ids", None) or ())
    e.run()
    out = {"preempted": preempted, "checks": e.results,
           "worker": e.worker_stats(), "manager": e.manager_stats()}
    e.close()
    return out


def daemon_restart(model: str, target: str, sync_dir: str, blocks: int = 4, **kw: Any
                   ) -> dict[str, Any]:
    """Store; the daemon is SIGKILLed (by the test): a request is a miss, nothing raises, its
    store is dropped; the daemon restarts on its state: new requests are stored and hit again
    (``after``: how soon), the links came back by themselves, and the first prompt's blocks
    load back exact."""
    sync = Path(sync_dir)
    e = Engine(model, target, **kw)
    bs = e.block_size
    prompt = _prompt(blocks * bs + 1, 9)
    e.add("a", prompt)
    e.run()
    out: dict[str, Any] = {"first": e.results.get("a"), "stored": e.worker_stats()}
    (sync / "stored").touch()
    _wait_file(sync / "killed")
    assert e.scheduler.reset_prefix_cache()
    e.zero()
    e.add("b", prompt[:blocks * bs] + _prompt(5, 10))
    e.run(until_idle=30)
    out.update(down_loaded=e.loaded_tokens["b"], down=e.results.get("b"),
               down_manager=e.manager_stats(), down_worker=e.worker_stats())
    (sync / "missed").touch()
    _wait_file(sync / "restarted")
    out["after"] = _stored_and_hit_after(e, 400)  # new requests, from the daemon serving on
    end = time.monotonic() + 20
    while not e.links_up() and time.monotonic() < end:
        time.sleep(0.05)
    out["reconnected_in_s"] = round(20 - (end - time.monotonic()), 2)
    assert e.scheduler.reset_prefix_cache()
    e.zero()
    e.add("c", prompt[:blocks * bs] + _prompt(7, 11))
    e.run(until_idle=30)
    out.update(up_loaded=e.loaded_tokens["c"], up=e.results.get("c"),
               manager=e.manager_stats(), worker=e.worker_stats())
    e.close()
    return out


def stopped_daemon(model: str, target: str, sync_dir: str, blocks: int = 4, **kw: Any
                   ) -> dict[str, Any]:
    """Store; the daemon is SIGSTOPped (by the test): no scheduler step waits on it past the
    lookup deadline (steps timed), a request with the stored prefix is computed (misses,
    nothing raised); SIGCONT: the link is fenced and up again by itself, the prefix hits."""
    sync = Path(sync_dir)
    e = Engine(model, target, **kw)
    steps: list[float] = []
    untimed = e.step

    def timed() -> Any:
        t0 = time.perf_counter()
        got = untimed()
        steps.append(time.perf_counter() - t0)
        return got

    e.step = timed  # type: ignore[method-assign]
    bs = e.block_size
    prompt = _prompt(blocks * bs + 1, 13)
    e.add("a", prompt)
    e.run()
    out: dict[str, Any] = {"first": e.results.get("a"), "steps_up": max(steps)}
    (sync / "stored").touch()
    _wait_file(sync / "stopped")
    steps.clear()
    assert e.scheduler.reset_prefix_cache()
    e.zero()
    e.add("b", prompt[:blocks * bs] + _prompt(5, 14))
    e.run(until_idle=30)
    out.update(stopped_loaded=e.loaded_tokens["b"], stopped=e.results.get("b"),
               longest_step_s=max(steps), stopped_steps=len(steps),
               stopped_manager=e.manager_stats())
    (sync / "missed").touch()
    _wait_file(sync / "continued")
    end = time.monotonic() + 30
    while not e.links_up() and time.monotonic() < end:
        time.sleep(0.05)
    assert e.scheduler.reset_prefix_cache()
    e.zero()
    e.add("c", prompt[:blocks * bs] + _prompt(7, 15))
    e.run(until_idle=30)
    out.update(up_loaded=e.loaded_tokens["c"], up=e.results.get("c"),
               worker=e.worker_stats())
    e.close()
    return out


def _wait_file(path: Path, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{path} never came")
        time.sleep(0.02)


def held_hit_survives_eviction(model: str, target: str, blocks: int = 4, **kw: Any
                               ) -> dict[str, Any]:
    """A hit is a promise: once ``lookup`` said HIT, another writer filling the pool past
    its size (every page not held evicted) cannot take the blocks before vLLM loads them.
    (The pool is 16 pages: a session holds at most a quarter of it, the 4 blocks.)"""
    import numpy as np

    from hicache_client import HiCacheClient
    from hicache_client.shm import ShmDeviceBuffers

    e = Engine(model, target, extra={"pool_size_tokens": 16 * 16}, **kw)
    bs = e.block_size
    prompt = _prompt(blocks * bs + 1, 31)
    e.add("a", prompt)
    e.run()
    assert e.scheduler.reset_prefix_cache()
    e.zero()
    e.add("b", prompt[:blocks * bs] + _prompt(3, 32))
    promises = e.scheduler_side.manager.promises
    e.step()  # the lookup is asked (vLLM hears RETRY) ...
    end = time.monotonic() + 10
    while not any(r.answers for r in promises._requests.values()):  # ... and answered,
        assert time.monotonic() < end  # while the scheduler does not step: the hook
        time.sleep(0.001)
    pool = e.worker.connector_worker.worker.pool
    filled = 0
    with HiCacheClient(target) as c, \
            ShmDeviceBuffers.create(pool, bs, sealed=True) as buf:
        s = c.open_session(pool.name, "filler", buf.descriptors, fds=buf.fds)
        for i in range(32):  # twice the pool: all but the held pages go
            r = s.store([f"filler-{i}".encode()], np.arange(bs, dtype=np.int64))
            filled += r.stored
        s.close()

    e.run()
    out = {"filled": filled, "loaded": e.loaded_tokens["b"], "second": e.results.get("b"),
           "manager": e.manager_stats(), "worker": e.worker_stats()}
    e.close()
    return out


def touch_keeps_pages(model: str, target: str, touch: bool, blocks: int = 4, **kw: Any
                      ) -> dict[str, Any]:
    """Prompt A is stored, then prompt B (16-page pool: 8 used); with ``touch`` vLLM says A's
    blocks are in use (``manager.touch``, as its prefix cache would), then another writer
    stores 10 pages, evicting the 2 least recently used: B's first two if A was touched, A's
    otherwise. Returns each prompt's tier bytes in the pool afterwards."""
    import numpy as np
    from vllm.v1.kv_offload.base import ReqContext

    from hicache_client import HiCacheClient
    from hicache_client.shm import ShmDeviceBuffers

    e = Engine(model, target, extra={"pool_size_tokens": 16 * 16}, **kw)
    bs = e.block_size
    a, b = _prompt(blocks * bs + 1, 41), _prompt(blocks * bs + 1, 42)
    for name, prompt in (("a", a), ("b", b)):
        e.add(name, prompt)
        e.run()
    manager = e.scheduler_side.manager
    ka, kb = e.offload_keys(a), e.offload_keys(b)
    if touch:
        t0 = time.monotonic()
        manager.touch(ka, ReqContext(req_id="c"))
        returned_s = time.monotonic() - t0
        assert manager.holds.settle(10)
    pool = e.worker.connector_worker.worker.pool
    with HiCacheClient(target) as c, ShmDeviceBuffers.create(pool, bs, sealed=True) as buf:
        s = c.open_session(pool.name, "filler", buf.descriptors, fds=buf.fds)
        filled = sum(s.store([f"filler-{i}".encode()], np.arange(bs, dtype=np.int64)).stored
                     for i in range(10))
        s.close()
        out = {"a": c.lookup(pool.name, ka).tiers.hex(), "b": c.lookup(pool.name, kb).tiers.hex(),
               "filled": filled, "manager": e.manager_stats(),
               "returned_s": returned_s if touch else 0.0}
    e.close()
    return out


def router_tokens(model: str, target: str, connector: str, blocks: int = 40, **kw: Any
                  ) -> dict[str, Any]:
    """A prompt of ``blocks`` blocks is stored (640 tokens, prefilled in two steps of at most
    512: the second step's store continues the first's chain, its parent the first's last
    page), each in rounds of 8 staged pages (``staging_blocks``: every round after a job's
    first is chained to the round before). Returns its whole-block tokens and the pool, for a
    router to be asked about."""
    e = Engine(model, target, connector=connector, extra={"staging_blocks": 8}, **kw)
    bs = e.block_size
    prompt = _prompt(blocks * bs + 1, 51)
    e.add("a", prompt)
    e.run()
    out = {"prompt": prompt[:blocks * bs], "pool": e.worker.connector_worker.worker.pool.name,
           "block": bs, "manager": e.manager_stats()}
    e.close()
    return out


def tp_roundtrip(model: str, target: str, rank: int, port: int, mla: bool = False,
                 blocks: int = 4, drop_last_of: str = "", **kw: Any) -> dict[str, Any]:
    """Two ranks (one process each, gloo): a prompt stored by every rank (MHA: each its own
    pool; MLA: rank 0 alone, one pool), the prefix cache reset and every rank's KV zeroed, the
    same prefix loaded back into each rank, exact. ``drop_last_of``: the prompt's last block
    is removed from that pool first (a block is a hit only where every rank's pool has it)."""
    e = Engine(model, target, tp=2, rank=rank, port=port, mla=mla, **kw)
    if rank != 0:
        e.follow()
        out = {"results": e.results, "worker": e.worker_stats()}
        e.close()
        return out
    bs = e.block_size
    prompt = _prompt(blocks * bs + 1, 41)
    e.add("a", prompt)
    e.run()
    removed = 0
    if drop_last_of:
        from hicache_client import HiCacheClient

        with HiCacheClient(target) as c:
            removed = c.remove_keys(drop_last_of, [e.offload_keys(prompt)[blocks - 1]])
    assert e.scheduler.reset_prefix_cache()
    e.zero()
    e.add("b", prompt[:blocks * bs] + _prompt(6, 42))
    e.run()
    out = {"results": e.results, "loaded": e.loaded_tokens["b"], "worker": e.worker_stats(),
           "removed": removed,
           "manager": e.manager_stats(), "pools": e.scheduler_side.manager.plan.pool_names}
    e.close()
    return out


def parse_serve(argv: list[str], model: str) -> dict[str, Any]:
    """A ``vllm serve ...`` command line read by vLLM's own argument parser, as its CLI reads
    it, and the connector settings it leads to (``EngineArgs.from_cli_args``; the model
    replaced by ``model``, a local directory: no hub here)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert argv[:2] == ["vllm", "serve"], argv[:2]
    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(argv[1:])
    named = args.model_tag or args.model
    args.model_tag = args.model = model
    kv = EngineArgs.from_cli_args(args).kv_transfer_config
    assert kv is not None
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from hicache_vllm.config import SpecConfig

    spec_cls = OffloadingSpecFactory.get_spec_cls(kv.kv_connector_extra_config)
    SpecConfig.from_extra(kv.kv_connector_extra_config)  # our part of it is valid
    conn_cls = KVConnectorFactory.get_connector_class(kv)  # as vLLM's factory finds it
    import inspect
    from importlib import metadata

    import vllm

    return {"model": named, "spec": f"{spec_cls.__module__}.{spec_cls.__name__}",
            "spec_file": inspect.getfile(spec_cls), "connector_file": inspect.getfile(conn_cls),
            "vllm": metadata.version("vllm"), "vllm_file": vllm.__file__,
            "kv_connector": kv.kv_connector,
            "connector_class": f"{conn_cls.__module__}.{conn_cls.__name__}",
            "failure_policy": kv.kv_load_failure_policy,
            "kv_role": kv.kv_role, "extra": kv.kv_connector_extra_config,
            "block_size": args.block_size, "prefix_caching": args.enable_prefix_caching}


def lookup_deadline_across_pools(timeout: float = 0.3, slow: float = 0.2) -> dict[str, Any]:
    """The manager's ``_lookup`` over two ranks' pools whose daemon answers each ``Lookup``
    only after ``slow`` seconds: one deadline for both (the second is cut short and fails),
    and the hold the first took is let go on the hold book's thread, not on the caller's."""
    import threading
    from types import SimpleNamespace

    from hicache.errors import DeadlinePassed
    from hicache_client.hold_book import HoldBook
    from hicache_client.link import DaemonLink
    from hicache_vllm.config import SpecConfig
    from hicache_vllm.manager import HicachedOffloadingManager

    released: list[tuple[int, int, str]] = []

    class SlowLink:
        usable, up, max_keys = True, True, 0
        gate, call = DaemonLink.gate, DaemonLink.call  # the real gate over this stand-in

        def __init__(self, i: int) -> None:
            self.client = SimpleNamespace(lookup=self._lookup)
            self.session = SimpleNamespace(pool=f"p{i}", session_id=f"s{i}",
                                           release_holds=self._release)
            self.i = i
            self.reported: list[str] = []

        def _lookup(self, pool: str, keys: list[bytes], timeout: float, **kw: Any) -> Any:
            time.sleep(min(slow, timeout))
            if timeout < slow:
                raise DeadlinePassed("too late")
            return SimpleNamespace(held=len(keys), promised=len(keys))

        def _release(self, keys: list[bytes], timeout: float) -> None:
            released.append((self.i, len(keys), threading.current_thread().name))

        def report(self, exc: BaseException, session: Any = None) -> bool:
            self.reported.append(type(exc).__name__)
            return True

    m = HicachedOffloadingManager.__new__(HicachedOffloadingManager)
    m.config = SpecConfig(target="unix:/nowhere", lookup_timeout_s=timeout)
    links = [SlowLink(0), SlowLink(1)]
    m.links = links  # type: ignore[assignment]
    m.holds = HoldBook(1000, m._release, "hicache-vllm-holds")
    t0 = time.perf_counter()
    try:
        m._lookup([bytes([i]) * 32 for i in range(4)])
        failed = ""
    except Exception as exc:
        failed = type(exc).__name__
    took = time.perf_counter() - t0
    m.holds.close()
    return {"took_s": took, "failed": failed, "released": released,
            "reported": [link.reported for link in links]}


def manager_books_stay_bounded(followed: int = 70_000, threads: int = 4,
                               each: int = 20_000) -> dict[str, Any]:
    """The manager's books over a long life: requests followed but never reported finished
    (the most recent ``MAX_FOLLOWED`` kept), and its counters added to from several threads
    at once (the scheduler's and the hold book's) while read: none lost, none ever lower than
    a read before."""
    import itertools
    import threading
    from types import SimpleNamespace

    from hicache_vllm.manager import _STATS, MAX_FOLLOWED, HicachedOffloadingManager

    m = HicachedOffloadingManager.__new__(HicachedOffloadingManager)
    m._requests = {}
    m._stats_lock = threading.Lock()
    m.stats = dict.fromkeys(_STATS, 0)
    for i in range(followed):
        m.follow(SimpleNamespace(request_id=f"r{i}"))
    kept = list(m._requests)
    reads: list[int] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            with m._stats_lock:
                reads.append(m.stats["touches_dropped"])

    def add() -> None:
        for _ in range(each):
            m._count("touches_dropped")

    reader = threading.Thread(target=read)
    reader.start()
    adders = [threading.Thread(target=add) for _ in range(threads)]
    for t in adders:
        t.start()
    for t in adders:
        t.join()
    stop.set()
    reader.join()
    return {"kept": len(kept), "max": MAX_FOLLOWED, "newest": kept[-1],
            "oldest": kept[0], "count": m.stats["touches_dropped"],
            "monotonic": all(a <= b for a, b in itertools.pairwise(reads))}


def lookahead_chains() -> dict[str, Any]:
    """The manager's chain of a store with lookahead hashes, without an engine: a request of
    10 pages of 4 tokens (offloaded blocks of 2 vLLM blocks), its keys ending where vLLM
    recorded them; stores of pages 2-4 with 0, 3 and more lookahead tokens than the daemon
    takes, and of its last pages, whose lookahead tokens are not all there yet."""
    import threading
    from types import SimpleNamespace

    from hicache_vllm.manager import _STATS, HicachedOffloadingManager

    m = HicachedOffloadingManager.__new__(HicachedOffloadingManager)
    m._requests, m._stats_lock, m.stats = {}, threading.Lock(), dict.fromkeys(_STATS, 0)
    m.plan = SimpleNamespace(page_tokens=4, blocks_per_chunk=2)  # type: ignore[assignment]
    m.hash_lookahead(0)
    tokens = list(range(100, 141))  # 10 pages and one token
    keys = [bytes([i]) * 32 + b"\0\0\0\0" for i in range(10)]
    hashes = [bytes([i, j]) * 16 for i in range(10) for j in range(2)]  # 2 per page
    m.follow(SimpleNamespace(request_id="r", all_token_ids=tokens, block_hashes=hashes,
                             lora_request=None, cache_salt=None))
    ctx = SimpleNamespace(req_id="r", get_offload_key_position=lambda k: 4 * (k[0] + 1))

    def chain(pages: list[int]) -> Any:
        c = m._chain([keys[i] for i in pages], ctx)  # type: ignore[arg-type]
        return None if c is None else {
            "tokens": c.token_ids.tolist(), "parent": c.parent_key.hex(),
            "lookahead": None if c.lookahead is None else c.lookahead.tolist()}

    out: dict[str, Any] = {"plain": chain([2, 3, 4])}
    m.hash_lookahead(3)
    out["three"] = chain([2, 3, 4])
    out["tail"] = chain([8, 9])  # page 9 ends at 40: of the 3 tokens after it, 1 is there
    out["round"] = None
    if out["three"] is not None:
        c = m._chain([keys[i] for i in (2, 3, 4)], ctx)  # type: ignore[arg-type]
        assert c is not None
        r = c.of_round([keys[i] for i in (2, 3, 4)], 1, 3)
        out["round"] = {"tokens": r.token_ids.tolist(), "parent": r.parent_key.hex(),
                        "lookahead": None if r.lookahead is None else r.lookahead.tolist()}
    m.hash_lookahead(65)
    out["too_many"] = chain([2, 3, 4])
    out["parent_of_2"] = (hashes[3] + b"\0\0\0\0").hex()  # page 1's last vLLM block
    return out


# -- a daemon that hangs or loses the keys between a hit and its load ----------------------

CLEAN = {"bad": [], "n_bad": 0}


def _on_first_load(e: Engine, hook: Any) -> None:
    """``hook(round)`` runs once, on the worker's load thread, just before its first
    ``LoadKeys``: after the lookup said HIT and vLLM scheduled the load (the hook point)."""
    worker = e.worker.connector_worker.worker
    original = worker._load_round
    done: list[bool] = []

    def hooked(r: Any, *rest: Any) -> Any:
        if not done:
            done.append(True)
            hook(r)
        return original(r, *rest)

    worker._load_round = hooked


def _stored_and_hit_after(e: Engine, seed: int, tries: int = 40) -> dict[str, Any]:
    """From now, new requests one after another (a prompt stored, then the same prefix asked
    with the engine's own prefix cache reset and its KV zeroed) until one prompt's blocks come
    back from the daemon exact: how long that took, and each try's (seconds, tokens loaded)."""
    bs = e.block_size
    start = time.monotonic()
    seen: list[tuple[float, int]] = []
    for i in range(tries):
        prompt = _prompt(2 * bs + 1, seed + i)
        e.add(f"new{seed}-{i}", prompt)
        e.run(until_idle=30)
        assert e.scheduler.reset_prefix_cache()
        e.zero()
        rid = f"hit{seed}-{i}"
        e.add(rid, [*prompt[:2 * bs], 5])
        e.run(until_idle=30)
        seen.append((round(time.monotonic() - start, 3), e.loaded_tokens[rid]))
        if e.loaded_tokens[rid] == 2 * bs and e.results[rid] == CLEAN:
            return {"first_hit_s": seen[-1][0], "tries": seen}
        time.sleep(0.05)
    return {"first_hit_s": None, "tries": seen}


def hang_between_hit_and_load(model: str, target: str, sync_dir: str, connector: str,
                              daemon_pid: int, policy: str = "fail", blocks: int = 8,
                              hang_s: float = 1.6, defaults: bool = False, **kw: Any
                              ) -> dict[str, Any]:
    """A prompt stored; the prefix cache reset and the KV zeroed; a request ``b`` with that
    prefix is told HIT and its load scheduled, and just before the load's ``LoadKeys`` the
    daemon is SIGSTOPped (by the test, told through ``loading``) for longer than the
    session's lease and ``load_retry_s``; another request ``c`` (a new prompt) runs beside it.
    The test resumes it (``continued``): new requests are stored and hit (``after``).

    Then the engine idles and the daemon is stopped again (by the test, told through
    ``idle``) for ``hang_s``, past the lease: this process resumes it (SIGCONT to
    ``daemon_pid``) and at once sends a new request, the first call the daemon sees after it
    answers again: it must be stored, and hit (``after_hang``). ``defaults``: the spec's
    own deadlines (``load_retry_s`` 10 s, ``rpc_timeout_s`` 5 s, ...) instead of short ones."""
    sync = Path(sync_dir)
    extra = {} if defaults else {"load_retry_s": 1.0, "rpc_timeout_s": 1.0,
                                 "lookup_timeout_s": 0.3}
    e = Engine(model, target, connector=connector, failure_policy=policy, extra=extra, **kw)
    bs = e.block_size
    prompt = _prompt(blocks * bs + 1, 61)
    e.add("a", prompt)
    e.run()
    assert e.scheduler.reset_prefix_cache()
    e.zero()

    def stop(r: Any) -> None:
        (sync / "loading").touch()
        _wait_file(sync / "stopped")

    _on_first_load(e, stop)
    e.add("b", prompt[:blocks * bs] + _prompt(5, 62))
    e.add("c", _prompt(3 * bs + 1, 63))
    t0 = time.monotonic()
    e.run(until_idle=60)
    out: dict[str, Any] = {
        "first": e.results.get("a"), "b": e.results.get("b"), "c": e.results.get("c"),
        "b_loaded": e.loaded_tokens.get("b"), "finish": dict(e.finish_reasons),
        "emitted": dict(e.emitted), "invalid_blocks": len(e.invalid_blocks),
        "settled_s": round(time.monotonic() - t0, 2),
        "settled_before_continue": not (sync / "continued").exists(),
        "worker": e.worker_stats()}
    (sync / "settled").touch()
    _wait_file(sync / "continued")
    out["after"] = _stored_and_hit_after(e, 300)
    (sync / "idle").touch()
    _wait_file(sync / "stopped-idle")
    time.sleep(hang_s)
    os.kill(daemon_pid, signal.SIGCONT)
    out["after_hang"] = _stored_and_hit_after(e, 500)
    out["manager"] = e.manager_stats()
    out["worker_after"] = e.worker_stats()
    e.close()
    return out


def keys_gone_before_load(model: str, target: str, connector: str, policy: str = "fail",
                          sync_load: bool = False, blocks: int = 6, **kw: Any
                          ) -> dict[str, Any]:
    """Request ``b`` is told HIT; before its load the keys are removed from the pool (another
    client's ``RemoveKeys``; the manager's holds keep the pages, not the keys, for another
    session): ``LoadKeys`` answers KEY_NOT_FOUND, the load is given up at once. ``c`` (a new
    prompt) is in the same batch. ``sync_load``: vLLM loads within the step that runs ``b``."""
    from hicache_client import HiCacheClient

    extra: dict[str, Any] = {"load_retry_s": 5.0}
    if sync_load:
        extra["sync_load_budget_bytes"] = 1 << 30
    e = Engine(model, target, connector=connector, failure_policy=policy, extra=extra, **kw)
    bs = e.block_size
    prompt = _prompt(blocks * bs + 1, 71)
    e.add("a", prompt)
    e.run()
    assert e.scheduler.reset_prefix_cache()
    e.zero()
    pool = e.worker.connector_worker.worker.pool.name
    removed: list[int] = []

    def remove(r: Any) -> None:
        with HiCacheClient(target) as c:
            removed.append(c.remove_keys(pool, r.keys))

    _on_first_load(e, remove)
    e.add("b", prompt[:blocks * bs] + _prompt(5, 72))
    e.add("c", _prompt(3 * bs + 1, 73))
    t0 = time.monotonic()
    raised = ""
    try:
        e.run(until_idle=30)
    except Exception as exc:  # what vLLM's worker would raise out of its step
        raised = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    out = {"removed": removed, "raised": raised, "took_s": round(time.monotonic() - t0, 2),
           "b": e.results.get("b"), "c": e.results.get("c"),
           "b_loaded": e.loaded_tokens.get("b"), "finish": dict(e.finish_reasons),
           "emitted": dict(e.emitted), "invalid_blocks": len(e.invalid_blocks),
           "worker": e.worker_stats()}
    if not raised:
        e.close()
    return out


def reset_keeps_shared_pages(model: str, target: str, blocks: int = 4, **kw: Any
                             ) -> dict[str, Any]:
    """This engine stores a prompt and holds a hit on another engine's prompt (``store_only``
    with seed 3 ran first), then vLLM resets its connector (``reset_prefix_cache(
    reset_connector=True)``): its own holds are let go, and neither engine's pages leave the
    pool: both load back."""
    e = Engine(model, target, connector="hicached", **kw)
    bs = e.block_size
    mine = _prompt(blocks * bs + 1, 81)
    e.add("a", mine)
    e.run()
    theirs = e.offload_keys(_prompt(blocks * bs + 1, 3))
    manager = e.scheduler_side.manager
    # a request of this engine told HIT for the other's prompt, not loaded yet: held for it
    assert manager.promises.answer("waiting", theirs[0], lambda: theirs)
    held = manager.holds.claimed
    assert e.scheduler.reset_prefix_cache(reset_connector=True)
    end = time.monotonic() + 10
    while manager.stats["reset_holds_released"] < held and time.monotonic() < end:
        time.sleep(0.01)
    e.zero()
    e.add("b", [*mine[:blocks * bs], 9])  # this engine's own pages, after its reset
    e.add("t", [*_prompt(blocks * bs + 1, 3)[:blocks * bs], 9])  # the other engine's
    e.run()
    out = {"held": held, "manager": e.manager_stats(), "loaded": e.loaded_tokens["b"],
           "b": e.results.get("b"), "theirs_loaded": e.loaded_tokens["t"],
           "theirs": e.results.get("t")}
    e.close()
    return out


def own_block_hashes(model: str, target: str, blocks: int = 6, cache_salt: str = "",
                     expect: list[int] | None = None, **kw: Any) -> dict[str, Any]:
    """vLLM's scheduler with its own KV events on stores a prompt through the connector: the
    block hashes vLLM publishes for it (its GPU blocks, and the connector's offloaded ones)
    and those the daemon's pool stream publishes for the same pages, each read with vLLM's own
    ``KVEventBatch`` decoder; with ``cache_salt``, the request's (vLLM hashes it into its
    blocks): what vLLM's GPU events and the daemon's say of it too."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    from hicache_client import HiCacheClient

    e = Engine(model, target, events=True, **kw)
    published: list[Any] = []
    e.scheduler.kv_event_publisher.publish = published.append  # the null publisher's input
    bs = e.block_size
    e.add("a", _prompt(blocks * bs + 1, 61), cache_salt=cache_salt or None)
    e.run()
    pool = e.worker.connector_worker.worker.pool.name
    ours: dict[str, list[int]] = {}
    vllm_names: list[Any] = []
    for batch in published:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                ours.setdefault(str(ev.medium), []).extend(int(h) for h in ev.block_hashes)
                if str(ev.medium) == "GPU":
                    vllm_names.append([ev.lora_name, ev.extra_keys])
    with HiCacheClient(target) as c:
        endpoint = c.get_pool(pool).kv_events_endpoint
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    daemon: list[int] = []
    daemon_names: dict[str, list[Any]] = {}
    """Each block the daemon told of: the LoRA name and cache salt it was told with."""
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)  # joining, it is sent a snapshot of the pool
        deadline = time.monotonic() + 10
        # until this prompt's blocks came and the snapshot of what was there before has too
        # (``expect``: blocks an earlier run stored, which the snapshot must name)
        while time.monotonic() < deadline and (
                len(daemon) < blocks or sub.poll(300)
                or any(str(h) not in daemon_names for h in expect or ())):
            if sub.poll(100):
                payload = sub.recv_multipart()[2]
                for ev in decoder.decode(payload).events:
                    if isinstance(ev, BlockStored):  # (a block told twice counts once)
                        daemon.extend(h for h in map(int, ev.block_hashes) if h not in daemon)
                # the fields vLLM's BlockStored has no place for (SGLang's has), untyped
                for ev in msgspec.msgpack.decode(payload)[1]:
                    if ev.get("type") == "BlockStored":
                        for h in ev["block_hashes"]:
                            daemon_names[str(h)] = [ev.get("lora_name"), ev.get("cache_salt")]
    finally:
        ctx.destroy(linger=0)
    out = {"vllm": ours, "daemon": daemon, "block": bs, "vllm_names": vllm_names,
           "daemon_names": daemon_names}
    e.close()
    return out


def lookahead_block_hashes(model: str, target: str, lookahead: int, blocks: int = 6,
                           chunk: int = 1, connector: str = "hicached", **kw: Any
                           ) -> dict[str, Any]:
    """vLLM 0.34's lookahead block hashes (``num_hash_lookahead_tokens`` = ``lookahead``:
    ``tests.vllm_harness.hash_lookahead``) with its own KV events on, the offloading
    connector's self-describing too, and an offloaded block of ``chunk`` vLLM blocks: a
    prompt of ``blocks`` blocks (and the ``lookahead`` tokens the last one's hash needs) is
    stored. What vLLM's events say of each block (its GPU blocks and the connector's
    offloaded ones: hash, lookahead tokens), what the daemon's pool stream says (read with
    vLLM's own ``KVEventBatch`` decoder), and the daemon's blocks hashed again from what it
    told, as a router that matches tokens with vLLM's hash does: each page's tokens and
    lookahead tokens, from the chain's first page on (vLLM's ``hash_block_tokens``, sha256,
    its extra keys ``(None, *lookahead)`` for a request without adapter, salt or media; None
    without lookahead hashes)."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

    from hicache_client import HiCacheClient

    extra: dict[str, Any] = {"self_describing_kv_events": True}
    if chunk > 1:
        extra["block_size"] = 16 * chunk  # vLLM's offloaded block: chunk engine blocks
    e = Engine(model, target, events=True, connector=connector, lookahead=lookahead,
               extra=extra, **kw)
    published: list[Any] = []
    e.scheduler.kv_event_publisher.publish = published.append  # the null publisher's input
    bs = e.block_size
    prompt = _prompt(blocks * bs + lookahead, 67)
    e.add("a", prompt)
    e.run()
    pool = e.worker.connector_worker.worker.pool.name
    vllm_says: dict[str, list[Any]] = {}
    """Per medium, each block vLLM's events name: [hash, its lookahead tokens]."""
    for batch in published:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                ahead = ev.lookahead_token_ids or [None] * len(ev.block_hashes)
                assert len(ahead) == len(ev.block_hashes), ev
                vllm_says.setdefault(str(ev.medium), []).extend(
                    [int(h), a] for h, a in zip(ev.block_hashes, ahead, strict=True))
    with HiCacheClient(target) as c:
        endpoint = c.get_pool(pool).kv_events_endpoint
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    told: list[Any] = []
    """The daemon's ``BlockStored`` events, as vLLM's decoder reads them."""
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)  # joining, it is sent a snapshot of the pool
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
                len({h for ev in told for h in ev.block_hashes}) < blocks // chunk
                or sub.poll(300)):
            if sub.poll(100):
                told += [ev for ev in decoder.decode(sub.recv_multipart()[2]).events
                         if isinstance(ev, BlockStored)]
    finally:
        ctx.destroy(linger=0)
    daemon: list[Any] = []
    """Each block the daemon told of: [hash, its lookahead tokens, its tokens]."""
    recomputed: list[int] = []
    """The daemon's blocks hashed again from its tokens and lookahead tokens."""
    parent: Any = None
    per = bs * chunk
    for ev in told:
        ahead = ev.lookahead_token_ids or [None] * len(ev.block_hashes)
        assert ev.block_size == per and len(ahead) == len(ev.block_hashes), ev
        for i, h in enumerate(ev.block_hashes):
            tokens = list(ev.token_ids[i * per:(i + 1) * per])
            if any(h == d[0] for d in daemon):
                assert [int(h), ahead[i], tokens] in daemon, ev  # told again: told alike
                continue
            daemon.append([int(h), ahead[i], tokens])
            if len(tokens) != per or (lookahead and ahead[i] is None):
                continue  # (told without what its hash covers: no router can hash it)
            span = tokens + list(ahead[i] or ())  # the page's blocks, each with its lookahead
            for j in range(chunk):
                after = span[(j + 1) * bs:(j + 1) * bs + lookahead]
                parent = hash_block_tokens(sha256, parent, span[j * bs:(j + 1) * bs],
                                           (None, *after) if lookahead else None)
            recomputed.append(int(maybe_convert_block_hash(parent)))
    out = {"vllm": vllm_says, "daemon": daemon, "recomputed": recomputed, "block": bs,
           "prompt": prompt, "parents": [ev.parent_block_hash for ev in told],
           "manager": e.manager_stats()}
    e.close()
    return out


def whoami(fail: bool = False) -> dict[str, Any]:
    """The engine process itself (``tests.vllm_zygote`` forks one per scenario): its pid and
    parent's, and the threads it has; ``fail``: a scenario that raises."""
    import threading

    if fail:
        raise RuntimeError("a scenario that fails")
    return {"pid": os.getpid(), "parent": os.getppid(), "threads": threading.active_count()}


# -- the release adapters (hicache_vllm.vllm_api) -------------------------------------------

def device_blocks() -> dict[str, Any]:
    """A job's engine blocks as this release's own connector hands them to the worker (0.34:
    ``DevicePointers`` from vLLM's ``resolve_device_pointers``; 0.33: the
    ``GPULoadStoreSpec`` itself), over a KV cache of two groups (three data references over
    tensors of 4 KiB pages, two over 1 KiB ones), read back by the release's adapter; then
    device sides vLLM never hands over, each refused (the error's text)."""
    import dataclasses

    import numpy as np
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )

    from hicache_vllm.blocks import Job
    from hicache_vllm.vllm_api import Api034, current

    api = current()
    pages = [4096] * 3 + [1024] * 2
    tensors = [torch.zeros(16, p, dtype=torch.int8) for p in pages]
    kv = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=p)
                 for t, p in zip(tensors, pages, strict=True)],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=pages[i])
                          for i in (0, 1, 2)],
                         [CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=pages[i])
                          for i in (3, 4)]])

    def side(ids: list[int], sizes: list[int], firsts: list[int]) -> Any:
        return api.device_side(GPULoadStoreSpec(ids, sizes, firsts), kv)

    def read(device: Any) -> list[list[Any]]:
        return [[g.group, [int(b) for b in g.block_ids], g.first]
                for g in api.device_blocks(device, kv)]

    def refused(device: Any) -> str:
        try:
            api.device_blocks(device, kv)
        except ValueError as exc:
            return str(exc)
        return ""

    out: dict[str, Any] = {
        "line": api.line.line,
        "both": read(side([5, 6, 7, 9, 2], [3, 2], [4, 1])),
        "second_only": read(side([3, 15], [0, 2], [0, 6])),
        "one_group_job": len(Job.of([b"k"] * 2, api.device_blocks(
            side([1, 2, 3, 4], [0, 4], [0, 0]), kv), 2).block_ids),
    }
    try:
        Job.of([b"k"] * 3, api.device_blocks(side([5, 6, 7, 9, 2], [3, 2], [4, 1]), kv), 1)
        out["two_groups_job"] = ""
    except ValueError as exc:
        out["two_groups_job"] = str(exc)
    bad: dict[str, str] = {}
    good = side([5, 6, 7, 9, 2], [3, 2], [4, 1])
    if isinstance(api, Api034):
        def changed(**kw: Any) -> Any:
            return dataclasses.replace(good, **kw)

        off = good.ptrs.copy()
        off[1] += np.uint64(1)
        bad["off_a_block"] = refused(changed(ptrs=off))
        past = good.ptrs.copy()
        past[0] = np.uint64(tensors[0].data_ptr() + 16 * 4096)
        bad["past_the_tensor"] = refused(changed(ptrs=past))
        below = good.ptrs.copy()
        below[0] = np.uint64(tensors[0].data_ptr() - 4096)
        bad["below_the_tensor"] = refused(changed(ptrs=below))
        sizes = good.sizes.copy()
        sizes[2] = np.uint64(2048)
        bad["wrong_size"] = refused(changed(sizes=sizes))
        swapped = good.ptrs.copy()
        swapped[3], swapped[4] = swapped[4], swapped[3]  # the second reference's first two
        bad["references_disagree"] = refused(changed(ptrs=swapped))
        bad["groups_miscounted"] = refused(changed(group_block_counts=(3,),
                                                   group_data_ref_counts=(3,),
                                                   block_indices=(4,)))
        bad["pointers_miscounted"] = refused(changed(ptrs=good.ptrs[:-1],
                                                     sizes=good.sizes[:-1]))
        bad["references_miscounted"] = refused(changed(group_data_ref_counts=(3, 3)))
    else:
        from types import SimpleNamespace

        bad["groups_miscounted"] = refused(SimpleNamespace(block_ids=[1, 2, 3],
                                                           group_sizes=[2, 2],
                                                           block_indices=[0, 0]))
    out["refused"] = bad
    return out


def refused_at_start(model: str, target: str, connector: str = "plain", **kw: Any
                     ) -> dict[str, Any]:
    """An engine whose vLLM is not one hicached serves (the test puts a distribution of
    another version first on the path): where vLLM starts with hicached's spec it stops, and
    how."""
    from importlib import metadata

    try:
        Engine(model, target, connector=connector, **kw)
    except Exception as exc:
        return {"vllm": metadata.version("vllm"), "type": type(exc).__name__,
                "reason": getattr(exc, "reason", ""), "metadata": getattr(exc, "metadata", {}),
                "message": str(exc)}
    return {"vllm": metadata.version("vllm"), "type": ""}


def kv_cache_access(target: str) -> dict[str, Any]:
    """What ``HicachedOffloadingConnector`` declares to this vLLM about its KV cache, for each
    ``cuda_sharing``: on this CPU host, and as on a CUDA host (vLLM's platform asked
    ``is_cuda``, answered yes: the only stand-in, there is no GPU here)."""
    from vllm.config import KVTransferConfig
    from vllm.platforms import current_platform

    from hicache_vllm.connector import HicachedOffloadingConnector

    def declared(extra: dict[str, Any]) -> str:
        kv = KVTransferConfig(kv_connector="HicachedOffloadingConnector",
                              kv_connector_module_path="hicache_vllm.connector",
                              kv_role="kv_both", kv_connector_extra_config=extra)
        try:
            got = HicachedOffloadingConnector.kv_cache_access(kv)
        except Exception as exc:
            return f"{type(exc).__name__}: {getattr(exc, 'reason', '')}: {exc}"
        return "" if got is None else str(getattr(got, "name", got))

    cases = {"default": {"target": target}, "fd": {"target": target, "cuda_sharing": "fd"},
             "legacy_ipc": {"target": target, "cuda_sharing": "legacy_ipc"},
             "fd_over_tcp": {"target": "127.0.0.1:50051"},
             "legacy_ipc_over_tcp": {"target": "127.0.0.1:50051", "cuda_sharing": "legacy_ipc"},
             "bad": {"target": target, "cuda_sharing": "auto"}}
    out: dict[str, Any] = {"cpu": {k: declared(v) for k, v in cases.items()}}
    platform = type(current_platform)
    real = platform.is_cuda
    platform.is_cuda = classmethod(lambda cls: True)  # type: ignore[assignment,method-assign]
    try:
        out["cuda"] = {k: declared(v) for k, v in cases.items()}
    finally:
        platform.is_cuda = real  # type: ignore[method-assign]
    return out
