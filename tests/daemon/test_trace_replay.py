"""``hicache-bench trace``: the reference policies against small models of themselves, the trace
reader's refusals, and the replay through a real daemon, whose pools must hit exactly what the
reference of their eviction policy (LRU, or the default ``reuse``) hits on the same stream.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache.errors import SpecInvalid
from hicache_bench.trace import capacities, read_trace
from hicache_bench.trace_policies import (
    NEVER,
    POLICIES,
    Belady,
    CountOracle,
    Lru,
    RateOracle,
    lifetime_rates,
    next_uses,
    replay,
    use_counts,
)
from tests.daemon_proc import REPO

streams = st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=12, unique=True),
                   min_size=1, max_size=40)


@given(streams, st.integers(1, 12))
def test_lru_is_a_list_ordered_by_last_use(requests: list[list[int]], capacity: int) -> None:
    cache, model = Lru(capacity), OrderedDict[int, None]()
    for blocks in requests:
        for b in blocks:
            assert cache.holds(b) == (b in model)
            cache.access(b)
            model.pop(b, None)
            model[b] = None
            while len(model) > capacity:
                model.popitem(last=False)
            assert len(cache) == len(model)
    assert all(cache.holds(b) for b in model)


@given(streams, st.integers(1, 12), st.sampled_from(sorted(POLICIES)))
def test_every_policy_keeps_its_capacity_and_its_counts(
        requests: list[list[int]], capacity: int, name: str) -> None:
    """Never more than ``capacity`` blocks; held = stores - evictions; an accessed block is
    held right after (but where the offline optimum declines to store it)."""
    cache = POLICIES[name](capacity)
    uses = next_uses(requests)
    for blocks, nexts in zip(requests, uses, strict=True):
        for b, n in zip(blocks, nexts, strict=True):
            cache.access(b, n)
            assert len(cache) <= capacity
            assert len(cache) == cache.stores - cache.evictions
            assert cache.holds(b) or name == "belady"


ORACLES = ("rate", "rate_no_last_use", "count")


def oracle(name: str, capacity: int, requests: list[list[int]]
           ) -> tuple[RateOracle | CountOracle, Callable[[int, int], float]]:
    """The oracle ``name`` and, as a model, the rank it should give (block, next use)."""
    rates, counts = lifetime_rates(requests), use_counts(requests)
    if name == "rate":
        return (RateOracle(capacity, rates),
                lambda b, n: -1.0 if n == NEVER else rates[b])
    if name == "rate_no_last_use":
        return RateOracle(capacity, rates, last_use=False), lambda b, n: rates[b]
    return CountOracle(capacity, counts), lambda b, n: float(counts[b])


@pytest.mark.parametrize("name", ORACLES)
@given(requests=streams, capacity=st.integers(1, 12))
def test_an_oracle_keeps_the_blocks_it_ranks_highest(
        name: str, requests: list[list[int]], capacity: int) -> None:
    """Capacity and counts kept; a block left out (evicted or refused) ranks no higher than
    anything held at that moment, against a model that ranks every block from the stream
    itself (the rate oracle: a block past its last use below every living one)."""
    cache, model = oracle(name, capacity, requests)
    uses = next_uses(requests)
    rank: dict[int, float] = {}
    for blocks, nexts in zip(requests, uses, strict=True):
        for b, n in zip(blocks, nexts, strict=True):
            before = {x for x in rank if cache.holds(x)}
            rank[b] = model(b, n)
            cache.access(b, n)
            assert len(cache) <= capacity and len(cache) == cache.stores - cache.evictions
            held = {x for x in rank if cache.holds(x)}
            assert held <= before | {b}
            for out in (before | {b}) - held:
                assert all(rank[out] <= rank[x] for x in held), (out, held)


@given(streams)
def test_rates_and_counts_are_the_streams_own(requests: list[list[int]]) -> None:
    uses_of: dict[int, list[int]] = {}
    for i, blocks in enumerate(requests):
        for b in blocks:
            uses_of.setdefault(b, []).append(i)
    rates, counts = lifetime_rates(requests), use_counts(requests)
    assert set(rates) == set(counts) == set(uses_of)
    for b, seen in uses_of.items():
        want = (len(seen) - 1) / (seen[-1] - seen[0]) if len(seen) > 1 else 0.0
        assert rates[b] == pytest.approx(want)
        assert counts[b] == len(seen)


def test_what_the_last_use_is_worth_to_the_rate_oracle() -> None:
    """Block 1 is used three times running, then never; block 2 every other request after.
    Told the last use, the oracle drops 1 for 2 and hits 2's reuses too; not told, 1's higher
    rate keeps it, dead, and 2 is never stored. The count oracle keeps the most used."""
    requests = [[1], [1], [1], [2], [3], [2], [4], [2]]
    rates, uses = lifetime_rates(requests), next_uses(requests)
    assert replay(RateOracle(1, rates), requests, uses).hit_blocks == 4
    assert replay(RateOracle(1, rates, last_use=False), requests, uses).hit_blocks == 2
    assert replay(Lru(1), requests, uses).hit_blocks == 2  # 3 and 4 push 2 out
    popular = [[1], [2], [1], [3], [1], [2]]
    assert replay(CountOracle(1, use_counts(popular)), popular).hit_blocks == 2
    assert replay(Lru(1), popular).hit_blocks == 0


def test_the_bounds_benchmark_prints_every_row_per_capacity(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"hash_ids": r}) + "\n"
                             for r in ([1, 2, 3], [1, 2, 4], [5], [1, 2, 3])))
    out = subprocess.run([sys.executable, "benchmarks/bench_trace_bounds.py", str(trace),
                          "--capacity", "2,4", "--json"], cwd=REPO, capture_output=True,
                         text=True, check=True, timeout=60).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["capacity"] for r in rows] == ["2", "4"]
    for r in rows:
        assert set(r) == {"capacity", "blocks", "lru", "reuse", "count_oracle",
                          "rate_no_last_use", "rate_oracle", "belady", "goal"}
        assert r["belady"] >= max(r["lru"], r["reuse"], r["count_oracle"], r["rate_oracle"])
        assert r["goal"] == pytest.approx(r["lru"] + (r["belady"] - r["lru"]) / 3)


@given(streams, st.integers(1, 12))
def test_the_offline_optimum_hits_at_least_as_many_blocks_as_lru(
        requests: list[list[int]], capacity: int) -> None:
    """Belady is optimal for block hits (every access that finds its block): no online
    policy finds more."""
    def block_hits(cache: Lru | Belady) -> int:
        hits = 0
        for blocks, nexts in zip(requests, next_uses(requests), strict=True):
            for b, n in zip(blocks, nexts, strict=True):
                hits += cache.holds(b)
                cache.access(b, n)
        return hits

    assert block_hits(Belady(capacity)) >= block_hits(Lru(capacity))


def test_next_uses_name_the_next_request_and_place() -> None:
    uses = next_uses([[1, 2], [3], [2, 1], [1]])
    at = 1 << 20
    assert uses[0] == [2 * at + 1, 2 * at]  # block 1 is request 2's second, block 2 its first
    assert uses[2] == [NEVER, 3 * at] and uses[3] == [NEVER]


def test_a_prefix_hit_stops_at_the_first_missing_block() -> None:
    cache = Lru(10)
    got = replay(cache, [[1, 2, 3], [1, 9, 3], [1, 9, 3]])
    # request 2: block 1 held, 9 missing (3 is held, after the gap: no use); request 3: all
    assert (got.hit_blocks, got.prompt_blocks) == (0 + 1 + 3, 9)
    assert got.stores == 4 and got.evictions == 0


def test_bad_traces_are_refused_naming_the_line(tmp_path: Path) -> None:
    good = json.dumps({"timestamp": 0, "hash_ids": [1, 2]})
    for bad in ('{"hash_ids": [1, -2]}', '{"input_length": 5}', "not json",
                '{"hash_ids": "12"}', '{"hash_ids": [true]}',
                json.dumps({"hash_ids": list(range(5000))})):
        path = tmp_path / "t.jsonl"
        path.write_text(f"{good}\n\n{bad}\n")
        with pytest.raises(SpecInvalid) as err:
            read_trace(str(path))
        assert err.value.metadata["line"] == "3" and len(str(err.value)) < 400
    path.write_text("")
    with pytest.raises(SpecInvalid):
        read_trace(str(path))
    path.write_text(f"{good}\n{good}\n{good}\n")
    assert len(read_trace(str(path), limit=2)) == 2


def test_capacities_are_shares_or_block_counts() -> None:
    assert capacities("1%,50%, 7", 1000) == [("1%", 10), ("50%", 500), ("7", 7)]
    for bad in ("0.01%", "x", "0", "-5", "1e12"):
        with pytest.raises(SpecInvalid):
            capacities(bad, 1000)


def _conversations(n: int, seed: int) -> list[dict[str, object]]:
    """Requests that share system prompts and grow turn by turn (chained ids)."""
    rng = random.Random(seed)
    ids = iter(range(1, 1 << 30))
    systems = [[next(ids) for _ in range(6)] for _ in range(3)]
    open_: list[list[int]] = []
    out: list[dict[str, object]] = []
    while len(out) < n:
        if len(open_) < 5 or rng.random() < 0.2:
            open_.append(list(rng.choice(systems)))
        conv = rng.choice(open_)
        conv += [next(ids) for _ in range(rng.randint(1, 4))]
        out.append({"timestamp": len(out), "hash_ids": list(conv)})
        if len(conv) > 60:
            open_.remove(conv)
    return out


@pytest.mark.parametrize("eviction", ["lru", "reuse"])
def test_the_daemon_hits_exactly_what_its_policy_hits(tmp_path: Path, eviction: str) -> None:
    """A real daemon started by the command, at three capacities: on the same stream its
    pools hit what the in-process reference of their eviction policy hits (``lru``: the LRU
    reference; ``reuse``, the default: ``Reuse``, the same policy driven through the calls a
    pool makes), block for block, and store what it stores. (Each capacity holds the longest
    request: a request longer than the pool is stored as far as it fits, the first pages of
    it, where the reference keeps its last ones.)"""
    trace = tmp_path / "conv.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in _conversations(300, 7)))
    run = subprocess.run([sys.executable, "-m", "hicache_bench", "trace", str(trace),
                          "--capacity", "10%,30%,100", "--json", "--eviction", eviction],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["capacity"] for r in rows] == ["10%", "30%", "100"]
    requests = [r["hash_ids"] for r in map(json.loads, trace.read_text().splitlines())]
    assert min(r["blocks"] for r in rows) >= max(map(len, requests))
    for r in rows:
        assert set(r) >= {"capacity", "daemon", "lru", "arc", "s3fifo", "reuse", "belady",
                          "rate_oracle"}
        assert r["daemon"] == pytest.approx(r[eviction], abs=1e-12), r
        ref = replay(POLICIES[eviction](r["blocks"]), requests)
        assert r["stores"] == ref.stores and r["evictions"] == ref.evictions
        assert 0 < r["lru"] <= r["belady"] < 1 and 0 < r["rate_oracle"] < 1
        assert r["reuse"] >= r["lru"], r  # this stream's conversations come back


def test_a_bad_trace_is_a_clear_error_not_a_traceback(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"hash_ids": [1]}\n{"hash_ids": [2, "x"]}\n')
    run = subprocess.run([sys.executable, "-m", "hicache_bench", "trace", str(trace),
                          "--no-daemon"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "bad.jsonl:2" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_disk_tier_below_keeps_every_promise_and_adds_hits(tmp_path: Path) -> None:
    """The command with a disk tier below a small pool, through a real daemon whose spiller
    runs beside the stores: back to back (the spill behind, evicting on disk while Lookups
    hold hits there; hits of up to 35 pages in a 38-page pool whose session may hold 9) and
    spaced, each Lookup holds its hit and the LoadKeys takes what it promised, and gets it
    every time (``disk_broken`` counts a load that could not); spaced, the disk adds hits host
    memory alone lacks, by the tier Lookup named."""
    trace = tmp_path / "conv.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in _conversations(300, 11)))
    for pace in ("0", "2"):
        run = subprocess.run([sys.executable, "-m", "hicache_bench", "trace", str(trace),
                              "--capacity", "5%", "--disk", "25%", "--pace-ms", pace,
                              "--json"], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        (row,) = [json.loads(line) for line in run.stdout.splitlines()]
        distinct = row["distinct_blocks"]
        assert abs(row["disk_blocks"] - distinct // 4) <= 1, row  # the disk sized as asked
        assert row["disk_host"] + row["disk_disk"] == pytest.approx(row["disk_daemon"])
        assert row["disk_broken"] == 0, row
        if pace != "0":
            assert row["disk_disk"] > 0 and row["disk_daemon"] > row["daemon"], row
