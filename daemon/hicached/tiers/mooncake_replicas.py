"""Gets that fall back across replicas: a key whose chosen copy cannot be read is read from
another.

Mooncake's get reads one replica per key, the one its client prefers (a replica on this node,
else the first the master lists), and never another: while a dead node's segment is still
registered (until the master's ``client_ttl`` expires, 10 s by default) every get of a key
with a copy there may fail with ``TRANSFER_FAIL`` although a second copy is alive. So after a
batch get, the keys that failed for any reason but "not in the store" are looked up again
(``batch_get_replica_desc``: each replica's endpoint, address and size; the query grants the
object a lease, as a get's own does) and read straight from a replica's memory with the
daemon's transfer engine (``batch_transfer_sync_read``, one call per endpoint, into the same
registered runs), every complete in-memory replica in the master's order, until one answers
or the call's deadline passes. An endpoint that failed a read is avoided by later fallbacks
for ``forget_seconds``, so a dead node costs one refused connection per get at most.

Primitives:

- ``ReplicaReader(forget_seconds, clock)``: ``retry(store, engine, keys, runs, sizes, got,
  deadline)`` -> the codes of ``got`` with every key another replica served set to its size;
  ``served`` (pages served by another replica), ``failed_reads`` (reads of an endpoint that
  failed), ``avoided()`` (endpoints avoided now).
- ``memory_replicas(descriptors, size)``: the (endpoint, address) of each complete in-memory
  replica of an object of ``size`` bytes.
- Mooncake's codes the cluster tier acts on: ``RPC_FAIL`` / ``master_failed(code)``,
  ``OBJECT_NOT_FOUND``; ``Runs``, a page's (address, length) pieces.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from hicache import seams
from hicache.locks import lock
from hicache.log_limit import LimitedLog

log = logging.getLogger(__name__)
_limited = LimitedLog(log, 30.0)

RPC_FAIL = -900
"""Mooncake's error code for a master it cannot reach; -901 and the other codes of the
-900s are the master's RPC failing too (a timeout, a broken connection)."""
OBJECT_NOT_FOUND = -704
FORGET_SECONDS = 30.0
"""How long an endpoint that failed a read is avoided: about three of Mooncake's default
``client_ttl`` (10 s), after which the master has dropped a dead node's segment anyway."""
Runs = Sequence[tuple[int, int]]


def memory_replicas(descriptors: Sequence[Any], size: int) -> list[tuple[str, int]]:
    out = []
    for d in descriptors:
        if not d.is_memory_replica() or d.status.name != "COMPLETE":
            continue
        buf = d.get_memory_descriptor().buffer_descriptor
        if buf.size == size:  # an object of another size is not this page's
            out.append((buf.transport_endpoint, buf.buffer_address))
    return out


def master_failed(code: int) -> bool:
    """One of the -900s: the master's RPC failed, not the object or a replica."""
    return -1000 < code <= RPC_FAIL


def _retryable(code: int, size: int) -> bool:
    """A key a get did not bring back for a reason another replica may not share: anything
    but success, "not in the store", or the master itself failing."""
    return code != size and code != OBJECT_NOT_FOUND and not master_failed(code)


class ReplicaReader:
    def __init__(self, forget_seconds: float = FORGET_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.forget_seconds = forget_seconds
        self._clock = clock
        self._failed_at: dict[str, float] = {}
        self._lock = lock("tier.mooncake_replicas")
        self.served = 0
        self.failed_reads = 0

    def avoided(self) -> list[str]:
        now = self._clock()
        with self._lock:
            for e in [e for e, t in self._failed_at.items() if now - t >= self.forget_seconds]:
                del self._failed_at[e]
            return sorted(self._failed_at)

    def _failed(self, endpoint: str) -> None:
        with self._lock:
            self._failed_at[endpoint] = self._clock()
        self.failed_reads += 1

    def retry(self, store: Any, engine: Any, keys: Sequence[str], runs: Sequence[Runs],
              sizes: Sequence[int], got: list[int], deadline: float) -> list[int]:
        todo = [i for i, (g, n) in enumerate(zip(got, sizes, strict=True)) if _retryable(g, n)]
        if not todo or engine is None or self._clock() >= deadline:
            return got
        seams.reached("mooncake.fallback")
        descs = store.batch_get_replica_desc([keys[i] for i in todo])
        avoid = set(self.avoided())
        left = {i: [r for r in memory_replicas(descs.get(keys[i], ()), sizes[i])
                    if r[0] not in avoid] for i in todo}
        out = list(got)
        while left and self._clock() < deadline:
            by_endpoint: dict[str, list[tuple[int, int]]] = {}
            for i, replicas in list(left.items()):
                if not replicas:
                    del left[i]
                    continue
                endpoint, address = replicas.pop(0)
                by_endpoint.setdefault(endpoint, []).append((i, address))
            for endpoint, items in by_endpoint.items():
                if self._clock() >= deadline:
                    break
                if self._read(engine, endpoint, items, runs):
                    for i, _ in items:
                        out[i] = sizes[i]
                        left.pop(i, None)
                    self.served += len(items)
                else:  # this endpoint is gone: no other key tries it either
                    for replicas in left.values():
                        replicas[:] = [r for r in replicas if r[0] != endpoint]
        missed = sum(1 for i in todo if out[i] != sizes[i])
        if missed < len(todo):
            _limited.warning("%d page(s) the chosen replica could not serve were read from "
                             "another (%d not); avoiding %s", len(todo) - missed, missed,
                             ", ".join(self.avoided()) or "no endpoint", key="fallback")
        return out

    def _read(self, engine: Any, endpoint: str, items: Sequence[tuple[int, int]],
              runs: Sequence[Runs]) -> bool:
        """Every item's object read from ``endpoint`` into its key's runs, in one call."""
        mine, theirs, lengths = [], [], []
        for i, address in items:
            offset = 0
            for a, n in runs[i]:
                mine.append(a)
                theirs.append(address + offset)
                lengths.append(n)
                offset += n
        try:
            rc = int(engine.batch_transfer_sync_read(endpoint, mine, theirs, lengths))
        except Exception:  # the binding raising is the endpoint failing, to the caller
            log.debug("a read from %s raised", endpoint, exc_info=True)
            rc = -1
        if rc != 0:
            self._failed(endpoint)
        return rc == 0
