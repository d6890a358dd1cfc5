"""One pool's part of the cluster tier: its keys in the store, its pages moved with no copy.

Keys are namespaced as ``<key_prefix>/<pool name>.<geometry digest>/<key hex>``: pools of
the same name and page geometry on every node share keys; another geometry, layout or page
size never reads them. A page moves straight between the pool's registered memory and the
store, as the runs ``HostPool.page_segments`` names (one run per page, or one per layer in
the layer-first layout).

Primitives:

- ``namespace(spec, prefix)``: the pool's namespace in the store.
- ``ClusterTier(pool, store, prefix)``: ``tier`` (3); ``exists(keys)`` -> a tier byte per
  key (3 or 0; all 0 while the store is down); ``put_pages`` / ``get_pages`` (keys, pages)
  -> one bool per key (each a copy of the pool while the store touches its memory;
  ``get_pages`` hands its pages back through a callback once it is done). Every object
  carries the xxh3-64 digest of its page (``OBJECT_FORMAT``), checked on every get: a page
  that does not match is not served, counted (``checksum_failures``) and removed from the
  store, so one bad node cannot poison the others; ``written(key)``:
  whether this daemon put (or got) it recently;
  ``contains`` / ``write_many`` (what a ``Spiller`` needs, for the ``evict`` policy);
  ``remove(keys)`` -> those dropped (a removal the store did not confirm, or that raced a
  put, leaves a tombstone: the key is never found, and is removed again after the put or
  when the tier is back: ``retry_removals``); ``revive(keys)`` (stored again); ``clear()``;
  ``close()`` (unregisters the memory); ``snapshot()``: the keys this daemon put or got and
  still remembers. ``events``: the pool's event log, told of every key this daemon put
  (STORED) and removed from the store (REMOVED: by RemoveKeys, ClearPool, a failed
  checksum); what other nodes put or the store evicts is theirs to tell, or unknown.
- ``cluster_writer.ClusterWriter``: the ``through`` policy (its own module).
- ``promote_cluster(cache, tier, keys)``: LoadKeys' way up: keys host memory lacks are got
  from the store into fresh host pages in one batch call; returns how many landed. A get that
  outlives the timeout keeps its pages held (the keys stay "being written") until it really
  ends, so a late write never lands in a page given to another key.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from hicache import seams
from hicache.locks import lock
from hicache.specs import PoolSpec
from hicached.cache.events import CLUSTER, EventKind, EventLog
from hicached.cache.pool_cache import PoolCache
from hicached.core.pool import HostPool
from hicached.core.state_file import spec_to_dict
from hicached.tiers.mooncake import MooncakeStore
from hicached.tiers.mooncake_replicas import Runs

log = logging.getLogger(__name__)

OBJECT_FORMAT = 2
"""An object is the page's runs, then the xxh3-64 digest of those bytes (8 bytes, little
endian); format 1 (no digest) lives in another namespace and is never read."""


def namespace(spec: PoolSpec, prefix: str) -> str:
    """``<prefix>/<name>.<digest of the page geometry>/``: what makes two pools' pages
    interchangeable (not their sizes)."""
    d = spec_to_dict(spec)
    shape = {k: d[k] for k in ("geometry", "page_size", "layout", "side_pools")}
    g = shape["geometry"]
    if g["kind"] == "OPAQUE":  # digested as before the kind existed (MLA uint8 rows): the
        # pages of a vLLM pool stay one namespace across daemons of either version
        shape["geometry"] = {**{k: v for k, v in g.items() if k != "row_bytes"},
                             "kind": "MLA", "kv_lora_rank": g["row_bytes"]}
    shape["object_format"] = OBJECT_FORMAT
    digest = hashlib.blake2b(json.dumps(shape, sort_keys=True).encode(),
                             digest_size=6).hexdigest()
    return f"{prefix}/{spec.name}.{digest}/"


class ClusterTier:
    tier = CLUSTER

    def __init__(self, pool: HostPool, store: MooncakeStore, prefix: str,
                 remember: int = 1 << 16) -> None:
        self.pool, self.store = pool, store
        self.prefix = namespace(pool.spec, prefix)
        self._written: OrderedDict[bytes, None] = OrderedDict()
        self._remember = remember
        self._tombstones: OrderedDict[bytes, None] = OrderedDict()
        """Keys removed whose removal has not reached the store for sure (it was down, or a
        put of the key was in flight): never reported or promoted, removed again later."""
        self._in_flight: Counter[bytes] = Counter()
        self._lock = lock("tier.cluster")
        self._digests = np.zeros(max(pool.page_num, 1), dtype="<u8")
        """One digest slot per page, registered beside the pool: a put sends the page's
        digest from its slot, a get brings the object's into it (a page is never put and got
        at once: gets land in fresh pages)."""
        self.checksum_failures = 0
        self.errors = 0
        """Pages a put did not store (what a ``Spiller`` backs off on)."""
        self.last_error = ""
        self.events = EventLog()
        store.register(pool.address, pool.nbytes)
        store.register(self._digests.ctypes.data, self._digests.nbytes)
        store.on_up.append(self.retry_removals)

    def close(self) -> None:
        if self.retry_removals in self.store.on_up:
            self.store.on_up.remove(self.retry_removals)
        self.store.unregister(self.pool.address)
        self.store.unregister(self._digests.ctypes.data)

    def _digest(self, page: int) -> int:
        h = xxhash.xxh3_64()
        for view in self.pool.page_views(page):
            h.update(view)
        return int(h.intdigest())

    def _object_runs(self, page: int) -> Runs:
        """The page's runs and its digest slot: what one object holds."""
        return [*self.runs(page), (self._digests.ctypes.data + 8 * page, 8)]

    def name(self, key: bytes) -> str:
        return self.prefix + key.hex()

    def runs(self, page: int) -> Runs:
        base = self.pool.address
        return [(base + o, n) for o, n in self.pool.page_segments(page)]

    # -- what this daemon knows it put ---------------------------------------------------

    def written(self, key: bytes) -> bool:
        with self._lock:
            return key in self._written

    contains = written

    def snapshot(self) -> list[bytes]:
        with self._lock:
            return list(self._written)

    def _remember_keys(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._written[k] = None
                self._written.move_to_end(k)
            while len(self._written) > self._remember:
                self._written.popitem(last=False)

    # -- the store ------------------------------------------------------------------------

    def exists(self, keys: Sequence[bytes]) -> list[int]:
        got = self.store.exists([self.name(k) for k in keys])
        if got is None:
            return [0] * len(keys)
        with self._lock:
            dead = self._tombstones
            return [CLUSTER if g and k not in dead else 0
                    for k, g in zip(keys, got, strict=True)]

    def put_pages(self, keys: Sequence[bytes], pages: np.ndarray,
                  still_wanted: Callable[[bytes], bool] | None = None) -> list[bool]:
        """Put pages (read-held by the caller), each with its digest."""
        for p in pages.tolist():
            self._digests[p] = self._digest(p)
        return self._put(keys, [self._object_runs(p) for p in pages.tolist()], still_wanted)

    def write_many(self, items: Sequence[tuple[bytes, Sequence[memoryview]]],
                   still_wanted: Callable[[bytes], bool] | None = None,
                   pages: Sequence[int] = ()) -> list[bool]:
        """A ``Spiller``'s batch: ``pages`` name the pages the views are of."""
        assert len(pages) == len(items), "the cluster tier puts pages by number"
        return self.put_pages([k for k, _ in items], np.asarray(pages, dtype=np.int64),
                              still_wanted)

    def _put(self, keys: Sequence[bytes], runs: Sequence[Runs],
             still_wanted: Callable[[bytes], bool] | None = None) -> list[bool]:
        """Returns once the store no longer reads the pool's memory (counted as a copy, so
        the pool is never unmapped under it). A key for which ``still_wanted`` says no (it
        was removed after its page was lent) is not put, or, if that happened during the put,
        removed from the store again at once."""
        seams.reached("cluster.borrowed")
        wanted = still_wanted or (lambda k: True)
        todo = [i for i, k in enumerate(keys) if wanted(k)]
        ok = [False] * len(keys)
        if not todo:
            return ok
        keys_now, runs_now = [keys[i] for i in todo], [runs[i] for i in todo]
        try:
            self.pool.begin_copy()
        except Exception:  # the pool is closing
            return ok
        with self._lock:
            self._in_flight.update(keys_now)
        try:
            got = self.store.put([self.name(k) for k in keys_now], runs_now)
        finally:
            self.pool.end_copy()
            with self._lock:
                self._in_flight.subtract(keys_now)
                self._in_flight += Counter()
        seams.reached("cluster.put")
        with self._lock:
            removed = [k for k, done in zip(keys_now, got, strict=True)
                       if k in self._tombstones or (done and not wanted(k))]
        for i, done in zip(todo, got, strict=True):
            ok[i] = done and keys[i] not in removed
        put = [k for k, done in zip(keys_now, got, strict=True) if done and k not in removed]
        self._remember_keys(put)
        self.events.append(EventKind.STORED, put, CLUSTER, chain=False)
        if removed:  # removed while the put ran: it must not stay in the store
            self._remove_from_store(removed)
        refused = got.count(False)
        if refused:
            self.errors += refused
            self.last_error = (f"the cluster store took {len(got) - refused} of {len(got)} "
                               "page(s)" + ("" if self.store.up else
                                            f" (down: {self.store.why})"))
        return ok

    def get_pages(self, keys: Sequence[bytes], pages: np.ndarray,
                  release: Callable[[list[bool]], None]) -> list[bool]:
        """Get ``keys`` into ``pages``; one bool per key. ``release(ok)`` is called exactly
        once, when the store no longer writes into the pages: at once, or, for a call that
        outlived the timeout (every key failed then), when that call ends, however late; the
        pages must stay held until then."""
        try:
            self.pool.begin_copy()
        except Exception:  # the pool is closing
            release([False] * len(keys))
            return [False] * len(keys)
        ok, late = self.store.get([self.name(k) for k in keys],
                                  [self._object_runs(p) for p in pages.tolist()])
        if late is None:
            ok = self._checked(keys, pages, ok)
            self.pool.end_copy()
            self._remember_keys([k for k, done in zip(keys, ok, strict=True) if done])
            release(ok)
            return ok
        log.warning("pool %s: a get of %d page(s) outlived its timeout; they stay held until "
                    "it ends", self.pool.spec.name, len(keys))

        def ended(_call: object) -> None:
            self.pool.end_copy()
            release([False] * len(keys))  # whatever it wrote is not trusted

        late.add_done_callback(ended)
        return ok

    def _checked(self, keys: Sequence[bytes], pages: np.ndarray, ok: list[bool]
                 ) -> list[bool]:
        """A landed page whose digest is not the object's is not served: the object is
        corrupt (objects are never written twice), so it is removed from the store too."""
        bad = [k for k, p, done in zip(keys, pages.tolist(), ok, strict=True)
               if done and self._digest(p) != int(self._digests[p])]
        if not bad:
            return ok
        self.checksum_failures += len(bad)
        log.error("pool %s: %d page(s) got from the cluster store failed their checksum; not "
                  "served, removed from the store (first key %s)", self.pool.spec.name,
                  len(bad), bad[0].hex())
        self.events.append(EventKind.REMOVED, self._remove_from_store(bad), CLUSTER)
        gone = set(bad)
        return [done and k not in gone for k, done in zip(keys, ok, strict=True)]

    def remove(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys the store held and dropped. Until the store confirms each removal (it
        is down, or a put of the key is in flight) the key is a tombstone here: never found,
        never promoted, removed again once a put ends or the tier comes back up."""
        with self._lock:
            known = [k for k in keys if k in self._written]
            for k in keys:
                self._written.pop(k, None)
                self._tombstones[k] = None
            while len(self._tombstones) > self._remember:
                self._tombstones.popitem(last=False)
        dropped = self._remove_from_store(keys)
        self.events.append(EventKind.REMOVED, list(dict.fromkeys(known + dropped)), CLUSTER)
        return dropped

    def _remove_from_store(self, keys: Sequence[bytes]) -> list[bytes]:
        got = self.store.remove([self.name(k) for k in keys])
        with self._lock:
            for k, done in zip(keys, got, strict=True):
                if done is not None and not self._in_flight[k]:
                    self._tombstones.pop(k, None)
        return [k for k, done in zip(keys, got, strict=True) if done]

    def retry_removals(self) -> int:
        """Remove again every tombstone no put holds (the tier came back up)."""
        with self._lock:
            keys = [k for k in self._tombstones if not self._in_flight[k]]
        return len(self._remove_from_store(keys)) if keys else 0

    def revive(self, keys: Sequence[bytes]) -> None:
        """``keys`` were stored again: they are no longer removed."""
        with self._lock:
            for k in keys:
                self._tombstones.pop(k, None)

    def clear(self) -> int:
        with self._lock:
            known = list(self._written)
            self._written.clear()
            self._tombstones.clear()
        n = self.store.remove_prefix(self.prefix)
        self.events.append(EventKind.REMOVED, known, CLUSTER)
        return n


def promote_cluster(cache: PoolCache, tier: ClusterTier, keys: Sequence[bytes]) -> int:
    """Get the keys host memory lacks from the store into fresh pages (one batch call);
    those that land become ready. Only when the store has every one of them (asked first, one
    metadata call): a load that must fail anyway takes no host pages from other keys. A key
    that vanishes between the two calls is simply not promoted (the load that follows fails
    whole with ``KEY_NOT_FOUND``)."""
    missing = cache.lending.not_ready(keys)
    if not missing or not tier.store.up:
        return 0
    if not all(tier.exists(missing)):  # the load fails whole: evict nothing for it
        return 0
    ticket = cache.begin_store(missing, "promotion")  # present or written elsewhere: left alone
    ticket.chain = False
    if not ticket.pages.size:
        return 0
    ok = tier.get_pages([ticket.keys[i] for i in ticket.positions.tolist()], ticket.pages,
                        lambda landed: cache.finish_store(ticket, landed))
    return sum(ok)
