"""Real SGLang 0.5.23 servers on CPU with the hicached linker, beside a real ``hicached serve``
(tests/sglang_server_harness.py), with the README's linker config (only ``target``) and the
daemon's default lease: what a user who follows the README gets.

Two server instances share one daemon. Every hit is checked against a device hit of the same
prompt (tokens and the first logprob equal bit for bit; a prompt whose first token differs
gives others, so the check sees the prefix). Across the two instances that holds only where
both processes compute alike: CPU kernels are chosen per process (instruction set, matrix
units) and a prompt computed by different ones differs in its last bits. The fixture probes
that once (``kernels_agree``); where they differ, a check across instances is held to
``DECODE_LOGPROB_TOLERANCE`` and says so, and checks within one instance stay exact.

Covered: a prompt SGLang's device cache evicted comes back from the daemon; a second instance
hits the first's pages on its first request; a flush on one instance leaves every instance's
hits; requests SGLang cannot admit yet cost at most two Lookups each;
the daemon SIGSTOPped past its lease while serving (every request completes, none waits past
the lookup deadline, hits return after SIGCONT) and SIGKILLed while serving (requests complete,
hits return after a restart). The daemon gives each pool its own KV event stream, and a real
router (Dynamo's indexer) following it matches the servers' prompts by their tokens.
"""

from __future__ import annotations

import os
import random
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from hicache.keys import sglang_page_keys
from hicache_client import HiCacheClient
from hicache_sglang.config import LinkerConfig
from tests.daemon_proc import DaemonProc, start_daemon
from tests.dynamo_indexer import DynamoIndexer
from tests.dynamo_indexer import unavailable as router_unavailable
from tests.kv_event_workers import pool_stream_args
from tests.mooncake_env import Netns
from tests.sglang_server_harness import (
    PAGE_SIZE,
    Generation,
    SGLangServer,
    metric,
    missing_server_modules,
    model_dir,
)

if missing := missing_server_modules():
    if os.environ.get("CI"):
        raise RuntimeError(f"SGLang's HTTP server cannot start without {missing} "
                           "(scripts/setup.sh --test installs them)")
    pytest.skip(f"SGLang's HTTP server needs {missing}", allow_module_level=True)

# one test bounds a request's latency against compute timed a moment earlier, and with the two
# servers computing beside the rest of the suite a timing-bounded test of another file failed
# once (a vLLM hang scenario's first request after the hang missed): the whole file runs alone
pytestmark = [pytest.mark.slow, pytest.mark.alone]

DAEMON_FLAGS = ("--lease-seconds", "5")  # the daemon's default (tests/daemon_proc.py: LEASE_S)
LOOKUP_TIMEOUT_S = LinkerConfig().lookup_timeout_s


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]  # 0..2: special tokens of the config


def matched(ids: list[int]) -> int:
    """The prompt tokens SGLang can take from a cache: whole pages, one token short of all."""
    return (len(ids) - 1) // PAGE_SIZE * PAGE_SIZE


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} after {timeout:.0f} s"
        time.sleep(0.05)


@dataclass
class Node:
    """One daemon and two SGLang instances of the same model beside it."""

    work: Path
    daemon: DaemonProc
    a: SGLangServer
    b: SGLangServer
    exact: bool = True
    """Whether ``a`` and ``b`` compute a prompt bit for bit alike (``kernels_agree``): checks
    across the two instances are exact where they do."""
    probe: str = ""
    """What the probe saw, for the messages of checks across instances."""

    def count(self, name: str, **labels: str) -> float:
        return metric(self.daemon.metrics(), name, **labels)

    def lookups(self) -> float:
        return self.count("hicache_rpc_requests_total", method="Lookup")

    def wait_stored(self, ids: list[int]) -> None:
        """Until the daemon holds every full page of ``ids`` (write-through is asynchronous):
        its keys, SGLang's page hashes, are looked up through a Lookup of its own."""
        keys = sglang_page_keys(ids, PAGE_SIZE)
        with HiCacheClient(self.daemon.target) as c:
            (pool,) = [p.spec.name for p in c.list_pools()]
            wait_for(lambda: c.lookup(pool, keys).hit_prefix == len(keys),
                     f"{len(keys)} pages not stored in the daemon")

    def restart_daemon(self) -> None:
        self.daemon = start_daemon(self.work, *daemon_flags(self.work))


def kernels_agree(a: SGLangServer, b: SGLangServer) -> tuple[bool, str]:
    """Both instances compute one 1K-token prompt at the same moment, each as a miss (both
    look it up before either has stored a page of it; a probe where either hit is tried again
    with another prompt): whether their outputs are equal bit for bit, and what they were."""
    for seed in (91, 92, 93):
        ids = prompt(1024, seed)
        with ThreadPoolExecutor(2) as pool:
            ga, gb = pool.map(lambda s, ids=ids: s.generate(ids), (a, b))
        if ga.cached_tokens == 0 and gb.cached_tokens == 0:
            alike = ga.output_ids == gb.output_ids and ga.logprobs == gb.logprobs
            return alike, (f"the probe's logprobs: a {ga.logprobs[:3]}, b {gb.logprobs[:3]}"
                           f" ({'alike' if alike else 'the kernels differ'})")
    raise AssertionError("no probe prompt was computed whole by both instances")


def daemon_flags(work: Path) -> tuple[str, ...]:
    return (*DAEMON_FLAGS, *pool_stream_args(work))  # a KV event stream per pool


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    work = tmp_path_factory.mktemp("sglang-node")
    model = model_dir(tmp_path_factory.mktemp("sglang-model"))
    daemon = start_daemon(work, *daemon_flags(work))
    a = SGLangServer(model, daemon.target, work / "a")
    b = SGLangServer(model, daemon.target, work / "b")
    n = Node(work, daemon, a, b)
    try:
        with ThreadPoolExecutor(2) as pool:  # both start at once: a minute, not two
            for f in [pool.submit(a.start), pool.submit(b.start)]:
                f.result()
        n.exact, n.probe = kernels_agree(a, b)
        if not n.exact:
            warnings.warn(f"the two SGLang instances compute with different kernels; checks "
                          f"across them are held to a tolerance: {n.probe}", stacklevel=1)
        yield n
    finally:
        for s in (a, b):
            s.stop()
        n.daemon.stop(signal.SIGKILL)


def same(got: Generation, want: Generation, server: SGLangServer, what: str,
         node: Node | None = None) -> None:
    """``got`` computed as ``want`` was: equal bit for bit. ``node``: ``want`` is the other
    instance's, exact only where the two compute alike (``Node.exact``), else the first token
    equal and its logprob within ``DECODE_LOGPROB_TOLERANCE``."""
    if node is not None and not node.exact:
        return near(got, want, server, f"{what} ({node.probe})")
    assert got.output_ids == want.output_ids, server.explain(f"{what}: tokens differ")
    assert got.logprobs == want.logprobs, server.explain(f"{what}: logprobs differ")


def near(got: Generation, want: Generation, server: SGLangServer, what: str) -> None:
    """Computed by different kernels: the first token is the same and its logprob close (a
    greedy token later on may flip where the random model's distribution is flat)."""
    assert got.output_ids[0] == want.output_ids[0], server.explain(
        f"{what}: the first token differs")
    gap = abs(got.logprobs[0] - want.logprobs[0])
    assert gap < DECODE_LOGPROB_TOLERANCE, server.explain(
        f"{what}: the first token's logprob differs by {gap:.2e}")


def device_hit(server: SGLangServer, ids: list[int], miss: Generation) -> Generation:
    """``ids`` again on ``server`` right after its ``miss``: its pages from SGLang's own device
    cache, the reference a hit from the daemon is held to (``same_hit``)."""
    got = server.generate(ids)
    assert got.device_hits == matched(ids), server.explain(f"no device hit: {got.meta_info}")
    assert got.output_ids == miss.output_ids, server.explain("a device hit: tokens differ")
    return got


DECODE_LOGPROB_TOLERANCE = 0.05
"""bf16 KV of a page computed by a 16-row extend against the same page from a 1,024-row
prefill: up to 7.6e-3 apart in the logprobs of the random test model on an AMX host."""


def same_hit(got: Generation, ref: Generation, server: SGLangServer, what: str,
             node: Node | None = None) -> None:
    """A hit from the daemon against a device hit of the same prompt (``device_hit``).
    ``node``: ``ref`` is the other instance's (see ``same``).

    The first token's logprob is bit for bit the device hit's: both compute the prompt's last
    page over the same cached pages, so it reads every layer of every page the daemon loaded.
    A whole-prompt prefill (a miss) is no such reference where the CPU's matrix kernels round
    by the number of rows (on AMX hosts its logprobs differ from any hit's in the last bits).
    The tokens are the same; later logprobs are within ``DECODE_LOGPROB_TOLERANCE``: each
    request decodes over the last prompt page of its own tree, which a device hit took from
    the prefill that first computed it and a hit from the daemon computes (SGLang computes
    the last prompt token, so it never loads that page)."""
    if node is not None and not node.exact:
        return near(got, ref, server, f"{what} ({node.probe})")
    assert got.output_ids == ref.output_ids, server.explain(f"{what}: tokens differ")
    assert got.logprobs[0] == ref.logprobs[0], server.explain(
        f"{what}: the first token's logprob differs: {got.logprobs[0]!r} != {ref.logprobs[0]!r}")
    worst = max(abs(x - y) for x, y in zip(got.logprobs, ref.logprobs, strict=True))
    assert worst < DECODE_LOGPROB_TOLERANCE, server.explain(
        f"{what}: logprobs differ by up to {worst:.2e}")


def test_a_prompt_the_device_evicted_comes_back_from_the_daemon(node: Node) -> None:
    a = node.a
    ids = prompt(2048, seed=11)
    lookups, requests = node.lookups(), 0
    miss = a.generate(ids)
    requests += 1
    assert miss.cached_tokens == 0, a.explain(str(miss.meta_info))
    ref = device_hit(a, ids, miss)
    requests += 1
    node.wait_stored(ids)
    for seed in (21, 22, 23):  # 4.5K tokens through a 4K-token device pool: `ids` leaves it
        a.generate(prompt(1500, seed), max_new_tokens=1)
        requests += 1
    hit = a.generate(ids)
    requests += 1
    assert hit.host_hits > 0, a.explain(f"no hit from the daemon: {hit.meta_info}")
    assert hit.host_hits + hit.device_hits == matched(ids), a.explain(str(hit.meta_info))
    same_hit(hit, ref, a, "a hit from the daemon")
    other = a.generate([ids[0] + 1, *ids[1:]])  # every page key differs: no hit anywhere
    requests += 1
    assert other.cached_tokens == 0, a.explain(str(other.meta_info))
    assert other.logprobs != miss.logprobs, "the output does not depend on the prefix"
    assert node.lookups() - lookups <= 2 * requests


def test_a_second_instance_hits_the_first_ones_pages(node: Node) -> None:
    ids = prompt(2048, seed=11)  # the first test's prompt, computed by `a` only
    ref = node.a.generate(ids)  # a hit there, from its device or the daemon
    lookups = node.lookups()
    first = node.b.generate(ids)
    assert first.host_hits == matched(ids), node.b.explain(str(first.meta_info))
    same_hit(first, ref, node.b, "another instance's pages", node)
    assert node.lookups() - lookups == 1


def test_requests_sglang_cannot_admit_yet_cost_at_most_two_lookups(node: Node) -> None:
    """Eight 1K-token prompts at once into a 4K-token device pool: some wait while others
    run, and SGLang matches every waiting request again each time a running one leaves."""
    prompts = [prompt(1000, seed) for seed in range(61, 69)]
    lookups = node.lookups()
    with ThreadPoolExecutor(len(prompts)) as pool:
        done = list(pool.map(lambda i: node.b.generate(prompts[i], max_new_tokens=4 + 4 * i),
                             range(len(prompts))))
    assert [len(g.output_ids) for g in done] == [4 + 4 * i for i in range(len(prompts))]
    per_request = (node.lookups() - lookups) / len(prompts)
    assert per_request <= 2, f"{per_request:.1f} daemon Lookups per admitted request"


def test_a_flush_on_one_instance_leaves_every_instances_hits(node: Node) -> None:
    ids = prompt(1024, seed=31)
    miss = node.a.generate(ids)
    assert miss.cached_tokens == 0
    ref = device_hit(node.a, ids, miss)
    node.wait_stored(ids)
    node.a.flush()  # SGLang's /flush_cache: the linker's reset
    for server in (node.b, node.a):
        got = server.generate(ids)
        assert got.host_hits == matched(ids), server.explain(f"after a/flush: {got.meta_info}")
        same_hit(got, ref, server, "a hit after the other instance's flush",
                 node if server is node.b else None)


@pytest.mark.skipif(bool(router_unavailable()), reason=router_unavailable() or "available")
def test_a_router_matches_the_prompts_the_servers_stored(node: Node, netns: Netns,
                                                         tmp_path: Path) -> None:
    """Dynamo's indexer registers both instances on the pool's own stream (one model, one
    pool: what either stored, both can load): a prompt ``a`` computed matches for both as far
    as its whole pages go, a prompt that shares its head matches that head, an unrelated one
    nothing."""
    ids, other = prompt(1024, seed=71), prompt(1024, seed=72)
    node.a.generate(ids)
    node.wait_stored(ids)
    with HiCacheClient(node.daemon.target) as c:
        (pool,) = c.list_pools()
    router = DynamoIndexer(netns, tmp_path, block_size=PAGE_SIZE)
    router.start()
    try:
        for instance in (1, 2):
            router.register(instance, pool.kv_events_endpoint, pool.kv_events_replay_endpoint)
        whole = len(ids) // PAGE_SIZE * PAGE_SIZE
        router.until(lambda: router.query(ids) == {1: whole, 2: whole}, 10)
        assert router.query([*ids[:256], *other[:256]]) == {1: 256, 2: 256}
        assert router.query(other) == {1: 0, 2: 0}
    finally:
        router.kill()


def test_a_daemon_stopped_past_its_lease_while_serving(node: Node) -> None:
    """SIGSTOP for longer than the session's lease: requests are computed (the hit one
    included), each waits on the daemon at most once for the lookup deadline, the outputs
    are exact; after SIGCONT the linker's session is opened again and hits come back."""
    a, b = node.a, node.b
    stored, fresh = prompt(1024, seed=41), prompt(1024, seed=42)
    refs = [b.generate(stored)]  # b computes both: the references
    stored_hit = device_hit(b, stored, refs[0])
    refs.append(b.generate(fresh))
    node.wait_stored(stored)
    base = max(r.latency_s for r in refs)
    node.daemon.pause()
    t0 = time.monotonic()
    try:
        for ids, ref in zip((stored, fresh, stored), (*refs, refs[0]), strict=True):
            got = a.generate(ids)
            assert got.host_hits == 0
            same(got, ref, a, "computed while the daemon is stopped", node)
            assert got.latency_s < base + LOOKUP_TIMEOUT_S + 3.0, a.explain(
                f"a request waited {got.latency_s:.2f} s on a stopped daemon (computing "
                f"alone took {base:.2f} s)")
            a.flush()
        time.sleep(max(0.0, 7.0 - (time.monotonic() - t0)))  # past the 5 s lease
    finally:
        node.daemon.resume()
    back = time.monotonic()
    while True:
        got = a.generate(stored)
        if got.host_hits:
            break
        assert time.monotonic() - back < 15, a.explain("no hits since SIGCONT")
        a.flush()
    assert got.host_hits == matched(stored), a.explain(str(got.meta_info))
    same_hit(got, stored_hit, a, "a hit after SIGCONT", node)


def test_a_daemon_killed_while_serving(node: Node) -> None:
    """SIGKILL while a request computes: it completes exactly, as does the next one (with no
    daemon); a daemon restarted on the same state directory serves the pages again. (The
    request that dies under the daemon may hit the pages ``b`` wrote through: then it is held
    to its first token and logprob within ``DECODE_LOGPROB_TOLERANCE``, as a hit computed by
    other rows than the reference's prefill.)"""
    a, b = node.a, node.b
    kept, during, after = prompt(1024, seed=51), prompt(2048, seed=52), prompt(512, seed=53)
    refs = [b.generate(kept)]
    kept_hit = device_hit(b, kept, refs[0])  # before the others push it out of b's device
    refs += [b.generate(ids) for ids in (during, after)]  # computed whole on a too
    node.wait_stored(kept)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(a.generate, during)
        time.sleep(0.3)  # admitted: its lookup was answered; it computes
        node.daemon.stop(signal.SIGKILL)
        got = running.result()
        if got.host_hits:  # b's write-through of it beat a's Lookup: a hit computes other
            near(got, refs[1], a, "a request the daemon died under (a hit)")  # rows, last bits
        else:
            same(got, refs[1], a, "a request the daemon died under", node)
    same(a.generate(after), refs[2], a, "a request with no daemon", node)
    node.restart_daemon()
    back = time.monotonic()
    while True:
        a.flush()
        got = a.generate(kept)
        if got.host_hits:
            break
        assert time.monotonic() - back < 15, a.explain("no hits since the restart")
    assert got.host_hits == matched(kept), a.explain(str(got.meta_info))
    same_hit(got, kept_hit, a, "a hit from the restarted daemon", node)
