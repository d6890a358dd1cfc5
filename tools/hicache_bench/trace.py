"""``hicache-bench trace TRACE.jsonl``: a request trace's prefix hit rate through a real daemon,
beside LRU, ARC, S3-FIFO, the offline optimum and the rate oracle computed on the same stream.

The trace is one JSON object per line with ``hash_ids`` (the prompt's blocks as chained ids:
two requests share an id only where they share the whole prefix up to it); ``timestamp`` and
``input_length`` may be there and are not needed. For each capacity (a share of the trace's
distinct blocks, or a number of blocks), the daemon replay creates a pool of that many pages
(a small page standing for each block) on a ``hicached serve`` started here (or
``--target``) and does per request what an engine does: a ``Lookup`` of its blocks (touching
the hit, and holding it), a ``LoadKeys`` of the hit into this process's buffers, a ``Store``
of the rest. The
reference policies (``hicache_bench.trace_policies``) replay the same stream in-process. Printed per
capacity: each one's hit rate (hit blocks over prompt blocks) and the daemon's stores and
evictions; ``--json`` prints one object per capacity instead, with ``capacity``, ``daemon``,
``lru``, ``arc``, ``s3fifo``, ``reuse`` (the daemon's default policy replayed in-process: what a
daemon started with ``--eviction reuse``, the default, hits exactly), ``belady``,
``rate_oracle`` (hit rates, fractions) and
``blocks``, ``stores``, ``evictions`` (the daemon's). ``rate_oracle`` is what perfect
knowledge of each block's reuse rate, without the timing of its reuses, hits
(``trace_policies.RateOracle``): the ceiling of policies that predict how often a block comes
back.

With ``--disk CAP`` each capacity is replayed once more through a daemon with a disk tier of
``CAP`` blocks below host memory (``[tier.disk]``, its evictions spilled there as they are in
production, read back by the LoadKeys of a hit; each Lookup holds its hit and the LoadKeys
takes what it promised, as the engines do; ``disk_broken`` counts the loads that could not
take it, each then a miss): ``disk_daemon`` (the hit rate), ``disk_host``
and ``disk_disk`` (the shares of prompt blocks hit in each tier), ``disk_blocks`` (the
pool's disk capacity as the daemon sized it), ``disk_keys`` (what its disk held at the end),
and ``lru_total`` (LRU with host and disk capacity together: what a spill that never lags would
approach). Back to back, a replay stores faster than the spill writes to disk, and what host
memory evicts before it was written is lost to both tiers, as in production when stores
outrun the disk (``hicache_disk_spill_dropped_pages_total``); ``--pace-ms`` spaces the
requests.

Primitives: ``read_trace(path, limit)`` -> the requests' blocks (``SPEC_INVALID`` naming the
line of a bad one), ``capacities(spec, distinct)``, ``replay_daemon(target, requests,
capacity, name)`` -> ``Tally``, ``main(argv)``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from hicache.errors import KeyNotFound, SpecInvalid
from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec
from hicache_bench.daemon import start_daemon
from hicache_bench.trace_policies import (
    POLICIES,
    RateOracle,
    Tally,
    block_key,
    lifetime_rates,
    next_uses,
    replay,
)
from hicache_client.client import HiCacheClient
from hicache_client.shm import ShmDeviceBuffers
from hicached.cache.pool_cache import EVICTION
from hicached.core.pool import region_layout

PAGE = KVGeometry(PoolKind.MHA, DType.BFLOAT16, layer_num=1, head_num=1, head_dim=8)
"""A block's stand-in: one token of 32 bytes (the policy sees pages, not their size)."""
MAX_BLOCKS = 4096
"""The longest request, in blocks, the replay takes (longer ones are refused: a trace error)."""


def read_trace(path: str, limit: int = 0) -> list[list[int]]:
    """The requests' blocks, in order (``limit`` > 0: the first ``limit``)."""
    out: list[list[int]] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                blocks = json.loads(line)["hash_ids"]
                if not isinstance(blocks, list) or not all(
                        isinstance(b, int) and not isinstance(b, bool) and b >= 0
                        for b in blocks):
                    raise ValueError("hash_ids is not a list of ids >= 0")
                if len(blocks) > MAX_BLOCKS:
                    raise ValueError(f"{len(blocks)} blocks (at most {MAX_BLOCKS})")
            except (ValueError, KeyError, TypeError) as exc:
                raise SpecInvalid(f"{path}:{n}: not a request with hash_ids ({exc})"[:300],
                                   metadata={"line": n}) from None
            out.append(blocks)
            if limit and len(out) >= limit:
                break
    if not out:
        raise SpecInvalid(f"{path}: no requests", metadata={"line": 0})
    return out


def capacities(spec: str, distinct: int) -> list[tuple[str, int]]:
    """``1%,2%,5%`` (shares of the distinct blocks) or ``500,1000`` (blocks): (label,
    blocks), each at least one."""
    out = []
    for part in spec.split(","):
        part = part.strip()
        try:
            blocks = (int(distinct * float(part[:-1]) / 100) if part.endswith("%")
                      else int(part))
        except ValueError:
            raise SpecInvalid(f"--capacity {part!r} is not N% or a number of blocks",
                              metadata={"capacity": part}) from None
        if blocks < 1 or blocks > 1 << 26:
            raise SpecInvalid(f"--capacity {part!r} is {blocks} blocks (1 .. 2**26)",
                              metadata={"capacity": part})
        out.append((part, blocks))
    return out


HOLD_MS = 30_000
"""How long a replayed Lookup holds its hit for the LoadKeys right after it."""


def replay_daemon(target: str, requests: Sequence[Sequence[int]], capacity: int,
                  name: str, info: dict[str, int] | None = None, pace: float = 0.0,
                  hold: bool = False) -> Tally:
    """The stream through a real daemon's pool of ``capacity`` pages (created here, deleted
    after): per request a touching ``Lookup``, a ``LoadKeys`` of the hit, a ``Store`` of the
    rest. ``hold``: the Lookup holds its hit and the LoadKeys takes what it promised
    (``LookupResult.promised``), as the engines do where a spill or a promotion may act
    between the two (without, nothing else acts on the pool then, and the hit is the hit
    prefix). ``info`` gets the pool's ``disk_keys`` and ``disk_capacity_pages`` at the end;
    ``pace``: seconds between requests (none: as fast as the daemon answers)."""
    spec = PoolSpec(name, PAGE, 1, size_tokens=capacity)
    longest = max(len(r) for r in requests)
    tally = Tally()
    with HiCacheClient(target) as client:
        client.create_pool(spec)
        bufs = ShmDeviceBuffers.create(spec, longest, prefix="hicache-trace")
        session = None
        try:
            session = client.open_session(name, "trace", bufs.descriptors, fds=bufs.fds)
            slots = np.arange(longest, dtype=np.int64)
            for blocks in requests:
                keys = [block_key(b) for b in blocks]
                found = session.lookup(keys, HOLD_MS if hold else 0, touch=True)
                hit = int(found.promised if hold else found.hit_prefix)
                if hit:
                    try:
                        session.load_keys(keys[:hit], slots[:hit])
                    except KeyNotFound:
                        if not hold:
                            raise
                        tally.broken += 1  # counted, and computed as an engine would
                        session.release_holds()
                        hit = 0
                for tier in bytes(found.tiers[:hit]):
                    tally.tier_hits[tier] = tally.tier_hits.get(tier, 0) + 1
                if hit < len(keys):
                    tally.stores += int(session.store(keys[hit:], slots[:len(keys) - hit]).stored)
                tally.hit_blocks += hit
                tally.prompt_blocks += len(keys)
                if pace:
                    time.sleep(pace)
            pool = client.get_pool(name)
            tally.evictions = tally.stores - int(pool.keys)
            if info is not None:
                info.update(disk_keys=int(pool.disk_keys),
                            disk_capacity_pages=int(pool.disk_capacity_pages))
        finally:
            if session is not None:
                session.close()
            bufs.close()
            client.delete_pool(name)
    return tally


DISK_BUDGET = 256 << 20
"""The memory budget of a daemon a ``--disk`` replay starts (its disk capacity is sized from
it: a pool's disk share is its share of the budget)."""


def replay_with_disk(requests: Sequence[Sequence[int]], blocks: int, disk_blocks: int,
                     shm_dir: str, info: dict[str, int] | None = None,
                     pace: float = 0.0) -> Tally:
    """The stream through a daemon started here with a disk tier of ``disk_blocks`` pages
    below a pool of ``blocks``."""
    work = tempfile.mkdtemp(prefix="hicache-trace-disk-")
    spec = PoolSpec("x", PAGE, 1, size_tokens=blocks)
    _, pool_bytes = region_layout(spec, blocks)
    # the pool's share of the disk is capacity * (its bytes / the budget): sized to give it
    # disk_blocks pages (half a page more, against rounding)
    capacity = int((disk_blocks + 0.5) * spec.page_bytes * DISK_BUDGET / pool_bytes) + 1
    proc, target = start_daemon(work, shm_dir, str(DISK_BUDGET), "", "--disk-path",
                                f"{work}/disk", "--disk-capacity", str(capacity))
    try:
        return replay_daemon(target, requests, blocks, "trace-disk", info, pace, hold=True)
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    requests = read_trace(args.trace, args.limit)
    distinct = len({b for r in requests for b in r})
    caps = capacities(args.capacity, distinct)
    disk = capacities(args.disk, distinct)[0][1] if args.disk else 0
    uses = next_uses(requests)
    rates = lifetime_rates(requests)
    work = proc = None
    target = args.target
    try:
        if target is None and not args.no_daemon:
            work = tempfile.mkdtemp(prefix="hicache-trace-")
            proc, target = start_daemon(work, args.shm_dir, args.memory_budget, "",
                                        "--eviction", args.eviction)
        rows = []
        for i, (label, blocks) in enumerate(caps):
            row: dict[str, Any] = {"capacity": label, "blocks": blocks,
                                   "distinct_blocks": distinct, "requests": len(requests)}
            for pname, cls in POLICIES.items():
                row[pname] = replay(cls(blocks), requests, uses).rate
            row["rate_oracle"] = replay(RateOracle(blocks, rates), requests, uses).rate
            if not args.no_daemon:
                assert target is not None
                got = replay_daemon(target, requests, blocks, f"trace-{i}")
                row.update(daemon=got.rate, stores=got.stores, evictions=got.evictions)
                if disk > blocks:
                    info: dict[str, int] = {}
                    both = replay_with_disk(requests, blocks, disk, args.shm_dir, info,
                                            args.pace_ms / 1000)
                    row.update(disk_blocks=info["disk_capacity_pages"],
                               disk_keys=info["disk_keys"], disk_daemon=both.rate,
                               disk_broken=both.broken,
                               disk_host=both.tier_hits.get(1, 0) / both.prompt_blocks,
                               disk_disk=both.tier_hits.get(2, 0) / both.prompt_blocks,
                               lru_total=replay(POLICIES["lru"](blocks + disk), requests,
                                                uses).rate)
            rows.append(row)
        return rows
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


def _print(rows: list[dict[str, Any]]) -> None:
    r0 = rows[0]
    print(f"{r0['requests']} requests, {r0['distinct_blocks']} distinct blocks; prefix hit "
          "rate (hit blocks / prompt blocks):")
    names = [*(["daemon"] if "daemon" in r0 else []), *POLICIES, "rate_oracle"]
    width = [max(8, len(n)) for n in names]
    print(f"{'capacity':>10} {'blocks':>8} " + " ".join(f"{n:>{w}}" for n, w in
                                                        zip(names, width, strict=True))
          + (f" {'stores':>9} {'evictions':>9}" if "daemon" in r0 else ""))
    for r in rows:
        line = f"{r['capacity']:>10} {r['blocks']:>8} " + " ".join(
            f"{100 * r[n]:>{w - 1}.1f}%" for n, w in zip(names, width, strict=True))
        if "daemon" in r:
            line += f" {r['stores']:>9} {r['evictions']:>9}"
        print(line)
    disk = [r for r in rows if "disk_daemon" in r]
    if disk:
        print(f"With a disk tier of {disk[0]['disk_blocks']} blocks below host memory (hits "
              "by the tier Lookup found them in; LRU of host + disk together beside it):")
        print(f"{'capacity':>10} {'daemon':>8} {'host':>8} {'disk':>8} {'lru_total':>10} "
              f"{'broken':>7}")
        for r in disk:
            print(f"{r['capacity']:>10} {100 * r['disk_daemon']:>7.1f}% "
                  f"{100 * r['disk_host']:>7.1f}% {100 * r['disk_disk']:>7.1f}% "
                  f"{100 * r['lru_total']:>9.1f}% {r['disk_broken']:>7}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="hicache-bench trace",
                                 description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("trace", help="JSONL, one request per line with hash_ids")
    ap.add_argument("--capacity", default="1%,2%,5%,10%,20%",
                    help="comma-separated: N%% of the distinct blocks, or a number of blocks")
    ap.add_argument("--limit", type=int, default=0, help="replay the first N requests only")
    ap.add_argument("--target", help="replay through this daemon instead of starting one")
    ap.add_argument("--no-daemon", action="store_true",
                    help="the reference policies only (no daemon replay)")
    ap.add_argument("--disk", default="",
                    help="also replay each capacity with a disk tier of this many blocks "
                         "(N%% or a number) below it")
    ap.add_argument("--pace-ms", type=float, default=0.0,
                    help="with --disk: ms between requests (the spill to disk runs behind "
                         "the stores; back to back, evictions outrun it)")
    ap.add_argument("--shm-dir", default="/dev/shm", help="for a daemon started here")
    ap.add_argument("--eviction", default="reuse", choices=EVICTION,
                    help="for a daemon started here: its pools' eviction policy")
    ap.add_argument("--memory-budget", default="4GiB", help="for a daemon started here")
    ap.add_argument("--json", action="store_true", help="one JSON object per capacity")
    args = ap.parse_args(argv)
    try:
        rows = run(args)
    except (SpecInvalid, OSError) as exc:
        print(f"hicache-bench trace: {exc}", file=sys.stderr)
        return 2
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        _print(rows)
    return 0
