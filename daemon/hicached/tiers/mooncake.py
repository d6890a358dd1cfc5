"""The daemon's one client of a Mooncake Store cluster: up or down, every call bounded in time.

Mooncake's Python API (``mooncake.store.MooncakeDistributedStore``) blocks in C++: a setup
against an absent master takes seconds, and a call to a master behind a dead route could
take longer. So every call runs on a small executor and is waited for at most
``timeout_seconds``; a call that times out, raises, or answers ``RPC_FAIL`` (the -900s)
marks the tier down (logged once). While it is down, calls return at once without touching
the network (Lookup and LoadKeys go on serving host and disk). A background thread probes
the master every ``retry_seconds`` (connecting first, if it never connected): a master gone
is noticed without traffic, and once it answers again the tier is up by itself. Pool memory
is registered once per pool, and again after a reconnect; pages move between it and the
store with no copy of ours, through a transfer engine of the daemon's (given to the store at
set-up), which also reads a replica directly when the one Mooncake chose cannot be read.

Primitives:

- ``MooncakeStore(config, on_state, observe)``: ``start()``, ``close()``; ``up``;
  ``on_state(up, why)`` on every change; ``observe(op, seconds)`` per call.
- ``register(address, nbytes)`` / ``unregister(address)``: a pool's memory.
- ``exists(keys)`` -> one bool per key, or None (down, or no answer in time).
- ``put(keys, runs)`` -> one bool per key (stored, or already there); returns once Mooncake
  no longer reads the runs, however long that takes (it runs on background threads).
- ``get(keys, runs)`` -> (one bool per key: its exact size landed in its runs; the call, if it
  outlived the timeout: it may still write into the runs until it completes). A key whose
  chosen replica cannot be read is read from another within the same deadline
  (``mooncake_replicas.ReplicaReader``, ``replicas``).
- ``remove(keys)`` -> per key removed / absent / not known; ``remove_prefix(prefix)`` -> a
  count; ``on_up``: tasks run each time the tier comes up (removals it missed).
- ``stats``: counters for metrics.

``runs`` are, per key, the (address, length) pieces of its page in registered memory.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hicache.locks import lock
from hicached.tiers.mooncake_config import MooncakeTierConfig
from hicached.tiers.mooncake_replicas import OBJECT_NOT_FOUND, ReplicaReader, Runs, master_failed

log = logging.getLogger(__name__)

PROBE_KEY = "hicache-probe"
"""Probed with a fresh suffix each time: Mooncake's client answers a key it was just asked
about from a cache of its own, without the master."""


def _master_failed(codes: Sequence[int]) -> bool:
    return any(master_failed(c) for c in codes)



@dataclass
class ClusterStats:
    puts: int = 0
    put_bytes: int = 0
    put_failures: int = 0
    gets: int = 0
    get_bytes: int = 0
    get_misses: int = 0
    """Keys a get did not bring back whole (gone from the store, or a peer unreachable)."""
    removed: int = 0
    down_transitions: int = 0
    timeouts: int = 0


def _load_wheel() -> tuple[Any, Any, Any]:
    """The store class, its ReplicateConfig and the transfer engine's class (the wheel is
    imported only when used)."""
    from mooncake.engine import TransferEngine
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    return MooncakeDistributedStore, ReplicateConfig, TransferEngine


class MooncakeStore:
    def __init__(self, config: MooncakeTierConfig,
                 on_state: Callable[[bool, str], None] = lambda up, why: None,
                 observe: Callable[[str, float], None] = lambda op, s: None) -> None:
        self.config = config
        self.stats = ClusterStats()
        self._on_state = on_state
        self.on_up: list[Callable[[], object]] = []
        """Called (on the watch thread) each time the tier comes up."""
        self._observe = observe
        self._store_class, replicate, self._engine_class = _load_wheel()
        self._replicate = replicate()
        self._replicate.replica_num = config.replicas
        self._store: Any = None
        self._engine: Any = None
        self.replicas = ReplicaReader()
        """Reads a key from another replica when Mooncake's choice fails."""
        self._up = False
        self._why = "not connected yet"
        self._registered: dict[int, int] = {}
        self._lock = lock("tier.mooncake")
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._pool = cf.ThreadPoolExecutor(4, thread_name_prefix="mooncake")
        self._busy = 0
        self._thread = threading.Thread(target=self._watch, name="mooncake-watch", daemon=True)

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(self.config.timeout_seconds + 30)
        store, self._store = self._store, None
        self._pool.shutdown(wait=False, cancel_futures=True)
        if store is not None:
            try:
                for address in list(self._registered):
                    store.unregister_buffer(address)
                store.close()
            except Exception:  # the master may be gone; the process ends anyway
                log.debug("closing the Mooncake client failed", exc_info=True)

    @property
    def up(self) -> bool:
        return self._up

    @property
    def why(self) -> str:
        """Why the tier is down ('' while up)."""
        return "" if self._up else self._why

    def _set(self, up: bool, why: str) -> None:
        with self._lock:
            if up == self._up:
                return
            self._up, self._why = up, why
            if not up:
                self.stats.down_transitions += 1
                self._wake.set()
        if up:
            log.info("Mooncake tier is up (master %s)", self.config.master)
        else:
            log.warning("Mooncake tier is down: %s; serving host and disk, retrying every "
                        "%.1f s", why, self.config.retry_seconds)
        self._on_state(up, why)
        for cb in list(self.on_up) if up else ():
            try:
                cb()
            except Exception:
                log.exception("a task for the tier coming up failed")

    def _watch(self) -> None:
        """Connect, then probe the master every ``retry_seconds``: a master gone is noticed
        without traffic (the alert fires on an idle node too), a master back brings the tier
        up."""
        while not self._stop.is_set():
            if self._store is None:
                self._connect()
            else:
                self._probe()
            self._wake.wait(self.config.retry_seconds)
            self._wake.clear()

    def _probe(self) -> None:
        key = [f"{PROBE_KEY}-{time.monotonic_ns()}"]
        got = self._call("probe", lambda s: s.batch_is_exist(key), probe=True)
        if got in ([0], [1]):  # an answer from the master, not an error code
            self._set(True, "")

    def _connect(self) -> None:
        c = self.config
        store = self._store_class()
        engine = self._engine if self._engine is not None else self._engine_class()
        t0 = time.perf_counter()
        try:
            if self._engine is None:  # once per process: it owns this node's endpoint
                rc = engine.initialize(c.local_hostname, c.metadata_server, c.protocol,
                                       c.rdma_devices)
                if rc != 0:
                    raise RuntimeError(f"the transfer engine's initialize returned {rc}")
                self._engine = engine
            rc = store.setup(c.local_hostname, c.metadata_server, c.segment_bytes,
                             c.local_buffer_bytes, c.protocol, c.rdma_devices, c.master,
                             engine.get_engine())
        except Exception as exc:  # a bad address raises rather than returning a code
            rc, why = -1, f"setup raised {exc}"
        else:
            why = f"setup returned {rc} (master {c.master} unreachable?)"
        self._observe("setup", time.perf_counter() - t0)
        if rc != 0:
            if self._why != why:
                log.warning("Mooncake tier cannot connect: %s; retrying every %.1f s", why,
                            c.retry_seconds)
            self._why = why
            return
        with self._lock:
            self._store = store
            for address, nbytes in self._registered.items():
                store.register_buffer(address, nbytes)
        self._set(True, "")

    # -- memory -------------------------------------------------------------------------

    def register(self, address: int, nbytes: int) -> None:
        with self._lock:
            self._registered[address] = nbytes
            if self._store is not None:
                self._store.register_buffer(address, nbytes)

    def unregister(self, address: int) -> None:
        with self._lock:
            if self._registered.pop(address, None) is not None and self._store is not None:
                self._store.unregister_buffer(address)

    # -- calls --------------------------------------------------------------------------

    def _submit(self, op: str, fn: Callable[[Any], list[int]], probe: bool = False,
                nbytes: int = 0) -> tuple[list[int] | None, cf.Future[list[int]] | None]:
        """``fn(store)`` on the executor, waited for at most ``timeout_seconds`` (plus
        ``nbytes`` at ``floor_bytes_per_second`` for a call moving pages). Returns
        (its answer, None); (None, the call) when it outlived the timeout and still runs;
        (None, None) when the tier is down, every worker is stuck, or the call failed."""
        store = self._store
        if store is None or not (self._up or probe):
            return None, None
        with self._lock:
            if self._busy >= 4:  # every worker is stuck on the network: do not queue more
                return None, None
            self._busy += 1
        t0 = time.perf_counter()

        def run() -> list[int]:
            try:
                return fn(store)
            finally:
                with self._lock:
                    self._busy -= 1
                self._observe(op, time.perf_counter() - t0)

        call = self._pool.submit(run)
        limit = self._limit(nbytes)
        try:
            got = call.result(limit)
        except cf.TimeoutError:
            self.stats.timeouts += 1
            self._set(False, f"{op} got no answer in {limit:.3g} s")
            return None, call
        except Exception as exc:
            self._set(False, f"{op} failed: {exc}")
            return None, None
        if _master_failed(got):
            self._set(False, f"{op}: master {self.config.master} unreachable (error "
                             f"{min(got)})")
        return got, None

    def _limit(self, nbytes: int) -> float:
        """How long a call moving ``nbytes`` may take before it counts as stalled."""
        return self.config.timeout_seconds + nbytes / self.config.floor_bytes_per_second

    def _call(self, op: str, fn: Callable[[Any], list[int]], probe: bool = False
              ) -> list[int] | None:
        """A call that touches no memory of ours: a late answer is simply dropped."""
        got, _late = self._submit(op, fn, probe)
        return got

    def exists(self, keys: Sequence[str]) -> list[bool] | None:
        if not keys:
            return []
        got = self._call("exists", lambda s: s.batch_is_exist(list(keys)))
        return None if got is None or _master_failed(got) else [g == 1 for g in got]

    def put(self, keys: Sequence[str], runs: Sequence[Runs]) -> list[bool]:
        """Put pages from registered memory; returns only once Mooncake no longer reads it
        (a call that outlives the timeout marks the tier down and is waited for)."""
        if not keys:
            return []
        nbytes = sum(n for r in runs for _, n in r)
        got, late = self._submit("put", lambda s: self._put(s, keys, runs), nbytes=nbytes)
        if late is not None:
            try:
                got = late.result()
            except Exception:
                got = None
        ok = [g == 0 for g in got] if got is not None else [False] * len(keys)
        n = sum(ok)
        self.stats.puts += n
        self.stats.put_failures += len(keys) - n
        self.stats.put_bytes += sum(sum(size for _a, size in r)
                                    for r, k in zip(runs, ok, strict=True) if k)
        return ok

    def _put(self, store: Any, keys: Sequence[str], runs: Sequence[Runs]) -> list[int]:
        rc = self._replicate
        if all(len(r) == 1 for r in runs):
            return list(store.batch_put_from(list(keys), [r[0][0] for r in runs],
                                             [r[0][1] for r in runs], rc))
        return list(store.batch_put_from_multi_buffers(
            list(keys), [[a for a, _ in r] for r in runs], [[n for _, n in r] for r in runs],
            rc))

    def get(self, keys: Sequence[str], runs: Sequence[Runs]
            ) -> tuple[list[bool], cf.Future[list[int]] | None]:
        """Get pages into registered memory: one bool per key (its exact size landed), and,
        when the call outlived the timeout (all False then), the call itself: it may still
        write into ``runs`` until it completes, so the memory must stay the caller's until
        then."""
        if not keys:
            return [], None
        sizes = [sum(n for _, n in r) for r in runs]
        limit = self._limit(sum(sizes))
        # the fallback stops with a tenth of the call's time left: a get it prolonged past
        # the limit would take the tier down for every key
        deadline = time.monotonic() + 0.9 * limit

        def fn(s: Any) -> list[int]:
            if all(len(r) == 1 for r in runs):
                got = list(s.batch_get_into(list(keys), [r[0][0] for r in runs], sizes))
            else:
                got = list(s.batch_get_into_multi_buffers(
                    list(keys), [[a for a, _ in r] for r in runs],
                    [[n for _, n in r] for r in runs]))
            return self.replicas.retry(s, self._engine, keys, runs, sizes, got, deadline)

        got, late = self._submit("get", fn, nbytes=sum(sizes))
        ok = ([g == size for g, size in zip(got, sizes, strict=True)] if got is not None
              else [False] * len(keys))
        n = sum(ok)
        self.stats.gets += n
        self.stats.get_misses += len(keys) - n
        self.stats.get_bytes += sum(size for size, k in zip(sizes, ok, strict=True) if k)
        return ok, late

    def remove(self, keys: Sequence[str]) -> list[bool | None]:
        """Per key: True removed, False it was not there, None not known (the store is down
        or the call failed)."""
        if not keys:
            return []
        got = self._call("remove", lambda s: list(s.batch_remove(list(keys), True)))
        if got is None or _master_failed(got):
            return [None] * len(keys)
        out: list[bool | None] = [True if g == 0 else False if g == OBJECT_NOT_FOUND else None
                                  for g in got]
        self.stats.removed += out.count(True)
        return out

    def remove_prefix(self, prefix: str) -> int:
        got = self._call("remove",
                         lambda s: [s.remove_by_regex("^" + re.escape(prefix), True)])
        n = max(got[0], 0) if got is not None else 0
        self.stats.removed += n
        return n
