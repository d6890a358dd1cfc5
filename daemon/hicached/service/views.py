"""Read models: what the daemon's state looks like to a caller, for front ends to render.

A front end renders these and nothing below them: it never reads a pool's allocator, a cache's
index or a tier's counters itself.

Primitives:

- ``pool_view(daemon, name)`` / ``pool_views(daemon)``: a pool (ready, building or failed),
  its pages, keys, sessions and tiers, as the API package's ``PoolInfo``.
- ``SessionView`` and ``session_view(session)``: a session as its worker (or, without the
  capability, anyone) sees it.
- ``EventView`` and ``watch_events(daemon, pool, after_seq, all_tiers, active)``: the events of
  a pool's log after ``after_seq``, until the caller goes, the pool is deleted or the daemon
  drains (``TOO_MANY_WATCHERS`` past ``max_watchers``).
- ``InfoView`` and ``info_view(daemon)``: the daemon itself (version, transports, memory,
  its fast path and event streams, the cluster store's state).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

import hicache
from hicache import fast_wire
from hicache.errors import PoolNotFound
from hicache.pools import PoolInfo
from hicached.cache.events import HOST, MEDIUM
from hicached.cache.index_types import KEY_INDEX_BYTES
from hicached.cache.pool_cache import PoolCache
from hicached.core.pool import HostPool
from hicached.core.system import available_bytes
from hicached.cuda.runner import CudaRunner
from hicached.service.daemon import Daemon
from hicached.service.pool_build import PoolBuild
from hicached.service.sessions import Session
from hicached.tiers.stack import TierStack

WATCH_POLL_SECONDS = 0.5
"""How often an idle event stream checks that its caller, its pool and the daemon are there."""




def _ready(pool: HostPool, cache: PoolCache, sessions: int, tiers: TierStack | None
           ) -> PoolInfo:
    counts = pool.allocator.counts()
    used = counts["used"]
    disk = tiers.disk if tiers is not None else None
    cluster = tiers.cluster if tiers is not None else None
    writer = tiers.writer if tiers is not None else None
    spiller = tiers.cluster_spiller if tiers is not None else None
    return PoolInfo(
        spec=pool.spec, size_tokens=pool.size_tokens, page_bytes=pool.spec.page_bytes,
        page_num=pool.page_num, used_pages=used, free_pages=counts["free"],
        capacity_bytes=pool.nbytes, used_bytes=used * pool.spec.page_bytes,
        pinned_bytes=pool.pinned_bytes, sessions=sessions, keys=cache.key_count,
        keyed_pages=counts["keyed"], raw_pages=counts["raw"], busy_pages=counts["busy"],
        metadata_bytes=pool.metadata_bytes + pool.page_num * KEY_INDEX_BYTES,
        attach_outcome=pool.outcome.value if pool.outcome else "memory",
        generation=pool.state.generation if pool.state else 0,
        recovered_keys=cache.recovered_keys,
        disk_keys=disk.keys if disk is not None else 0,
        disk_capacity_pages=disk.capacity if disk is not None else 0,
        cluster_namespace=cluster.prefix if cluster is not None else "",
        # a writer or a cluster spiller exists only where the pool has a cluster tier
        cluster_puts=(writer.put if writer is not None
                      else spiller.spilled if spiller is not None else 0),
        cluster_pending=writer.waiting if writer is not None else 0)


def _building(b: PoolBuild) -> PoolInfo:
    return PoolInfo(spec=b.spec, size_tokens=b.spec.resolved_size_tokens(),
                    page_bytes=b.spec.page_bytes,
                    state=b.state, progress=b.progress,
                    error=b.error.message if b.error else "",
                    error_reason=b.error.reason if b.error else "")


def _streamed(d: Daemon, v: PoolInfo) -> PoolInfo:
    """``v`` with where its pool's own KV event stream is, and its share of an elastic
    budget."""
    budget = d.pools.budget
    share = budget.share(v.spec.name) if budget is not None else None
    if share is not None:
        v = dataclasses.replace(v, share_bytes=share.share_bytes, floor_bytes=share.floor_bytes,
                                ceiling_bytes=share.ceiling_bytes, tenant=share.tenant)
    endpoint, replay = d.pool_streams(v.spec.name)
    if not endpoint:
        return v
    return dataclasses.replace(v, kv_events_endpoint=endpoint,
                               kv_events_replay_endpoint=replay)


def pool_view(d: Daemon, name: str) -> PoolInfo:
    """``name`` as it is now (``POOL_NOT_FOUND`` when there is no such pool)."""
    build = d.pools.build(name)
    if build is not None:
        return _building(build)
    return _streamed(d, _ready(d.pools.get(name), d.pools.cache(name), d.sessions.count(name),
                               d.pools.stack(name)))


def pool_views(d: Daemon) -> list[PoolInfo]:
    """Every pool: the ready ones, then those being built (or whose build failed)."""
    stacks = dict(d.pools.stacks())
    return [*(_streamed(d, _ready(p, c, d.sessions.count(p.spec.name),
                                  stacks.get(p.spec.name)))
              for p, c in d.pools.entries()),
            *(_building(b) for b in d.pools.builds())]


@dataclass(frozen=True)
class SessionView:
    session_id: str
    """The capability; "" in a view for anyone but the worker holding it."""
    public_id: str
    pool: str
    worker_id: str
    lease_ms: int
    expires_in_ms: int
    attached_bytes: int
    device_tokens: int
    transfers: int
    device_uuid: str
    """The GPU of a CUDA session's buffers ("" on a CPU host)."""
    layer_events: int
    lease_clamped: bool
    peer_uid: int | None
    """Who opened it, where the worker identified itself."""
    peer_gid: int
    peer_pid: int
    page_size: int
    loads_in_flight: int


def session_view(s: Session, capability: bool = True) -> SessionView:
    runner = s.attachment.runner
    uuid, events = "", 0
    if isinstance(runner, CudaRunner):
        uuid, events = runner.driver.devices[runner.ordinal].uuid, len(runner.layer_events)
    return SessionView(
        session_id=s.session_id if capability else "", public_id=s.public_id,
        pool=s.pool_name, worker_id=s.worker_id, lease_ms=int(s.lease_seconds * 1000),
        expires_in_ms=int(s.expires_in(time.monotonic()) * 1000),
        attached_bytes=s.attachment.nbytes, device_tokens=s.device_tokens,
        transfers=s.transfers, device_uuid=uuid, layer_events=events,
        lease_clamped=s.lease_clamped, peer_uid=s.peer.uid if s.peer else None,
        peer_gid=s.peer.gid if s.peer else 0, peer_pid=s.peer.pid if s.peer else 0,
        page_size=s.pool.page_size, loads_in_flight=s.loads)


@dataclass(frozen=True)
class EventView:
    seq: int
    kind: int
    """``EventKind``'s value: 1 stored, 2 removed, 3 evicted (the wire's ``CacheEvent.Kind``)."""
    keys: list[bytes]
    pool: str
    tier: int
    medium: str
    """The tier as the engines' events name it (``CPU_PINNED``, ``DISK``, ``EXTERNAL``)."""
    parent_key: bytes
    token_ids: list[int]
    block_size: int
    lora_name: str = ""
    """STORED: the LoRA adapter the Store named ("" = the base model)."""
    cache_salt: str = ""
    """STORED: the cache salt the Store named ("" = none)."""
    lookahead_tokens: int = 0
    """STORED: lookahead tokens per key the Store gave (0: none)."""
    lookahead_token_ids: list[int] = field(default_factory=list)
    """STORED: those tokens, ``lookahead_tokens`` per key."""


def watch_events(d: Daemon, pool: str, after_seq: int, all_tiers: bool,
                 active: Callable[[], bool]) -> Iterator[EventView]:
    """The events of ``pool`` after ``after_seq`` (host memory's, or every tier's), while
    ``active()`` and the daemon is not draining; ``POOL_NOT_FOUND`` once the pool is deleted
    (or deleted and made again)."""
    cache = d.pools.cache(pool)
    seq = int(after_seq)
    with d.watch_slot():
        while active() and not d.draining.is_set():
            for ev in cache.events.wait(seq, WATCH_POLL_SECONDS):
                seq = ev.seq
                if ev.tier != HOST and not all_tiers:
                    continue
                yield EventView(
                    seq=ev.seq, kind=ev.kind.value, keys=list(ev.keys), pool=pool,
                    tier=ev.tier, medium=MEDIUM[ev.tier], parent_key=ev.parent,
                    token_ids=ev.token_ids.tolist() if ev.token_ids is not None else [],
                    block_size=cache.pool.page_size, lora_name=ev.namespace.lora_name,
                    cache_salt=ev.namespace.cache_salt, lookahead_tokens=ev.ahead,
                    lookahead_token_ids=np.frombuffer(ev.lookahead, "<i8").tolist()
                    if ev.lookahead is not None else [])
            if d.pools.cache(pool) is not cache:
                raise PoolNotFound(f"pool {pool} was deleted", metadata={"pool": pool})


@dataclass(frozen=True)
class CudaDeviceView:
    uuid: str
    ordinal: int
    name: str
    total_bytes: int


@dataclass(frozen=True)
class InfoView:
    version: str
    transports: list[str]
    """Of ``shm``, ``memfd``, ``cuda_ipc`` and ``cuda_vmm``: what sessions' buffers may use
    here."""
    memory_budget_bytes: int
    memory_used_bytes: int
    memory_available_bytes: int
    shm_dir: str
    cuda_available: bool
    serving: bool
    """False once a drain began."""
    pools: int
    sessions: int
    metrics_port: int
    cuda_devices: list[CudaDeviceView]
    cluster_tier: str
    """"" (none), ``up`` or ``down: <why>``."""
    fast_path: str
    """The fast path's socket ("" = none), its framing's version and the flags it reads."""
    fast_path_version: int
    fast_path_flags: int
    kv_events_endpoint: str
    kv_events_replay_endpoint: str
    kv_events_topic: str
    max_keys_per_call: int


def info_view(d: Daemon) -> InfoView:
    devices = d.cuda.driver.devices if d.cuda is not None else ()
    store = d.pools.cluster_store
    fast = bool(d.fast_paths)
    return InfoView(
        version=hicache.__version__,
        transports=[*(["shm"] if d.shm.accept_paths else []),
                    *(["memfd"] if d.identities else []),
                    *(["cuda_ipc"] if d.cuda is not None else []),
                    # VMM chunks travel as fds, over the identity socket
                    *(["cuda_vmm"] if d.cuda is not None and d.identities else [])],
        memory_budget_bytes=d.pools.budget_bytes, memory_used_bytes=d.pools.used_bytes,
        memory_available_bytes=available_bytes(), shm_dir=d.shm.shm_dir,
        cuda_available=d.cuda is not None, serving=not d.draining.is_set(),
        pools=len(d.pools.list()), sessions=d.sessions.count(), metrics_port=d.metrics_port,
        cuda_devices=[CudaDeviceView(x.uuid, x.ordinal, x.name, x.total_bytes)
                      for x in devices],
        cluster_tier="" if store is None else "up" if store.up else f"down: {store.why}",
        fast_path=d.fast_paths[0] if fast else "",
        fast_path_version=fast_wire.VERSION if fast else 0,
        fast_path_flags=fast_wire.KNOWN_FLAGS if fast else 0,
        kv_events_endpoint=d.kv_events[0], kv_events_replay_endpoint=d.kv_events[1],
        kv_events_topic=d.kv_events[2], max_keys_per_call=d.max_keys_per_call)
