"""The client's data calls (Backup, Load, Store, LoadKeys, Lookup), over the fast path or gRPC.

``DataCalls`` is the half of ``HiCacheClient`` that moves pages. On a Unix target it asks
``GetInfo`` once whether the daemon offers its fast path (``GetInfo.fast_path``, the socket
``<socket>.fast``) and, when it does, sends every data call there as page ids: the same
results, the same domain errors. A call goes over gRPC instead when the fast path is not
offered, its connection fails (then the fast path is asked for again after
``FAST_RETRY_SECONDS``), the daemon is draining (gRPC's retry waits for a successor), the
indices are not whole aligned pages (the daemon names the fault over gRPC) or a key does not
fit the framing. ``data_path`` says which path the calls take now; an OVERLOADED refusal is
retried on the path it came from, after the daemon's hint, as gRPC's calls are.

Primitives: ``DataCalls`` (``backup``, ``load``, ``lookup`` (holding the hit for a session
when asked), ``release_holds``, ``store``, ``store_async``, ``load_keys``, ``beat`` (a
session's heartbeat, on the same path), ``data_path``), ``FAST_RETRY_SECONDS``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import numpy as np

from hicache import fast_wire as w
from hicache.error_mapping import from_rpc_error
from hicache.errors import Draining, Overloaded
from hicache.indices import IndexArray, indices_to_bytes
from hicache.keys import encode_keys
from hicache.v1 import hicache_pb2 as pb
from hicache_client import fast_path as fp
from hicache_client.results import LookupResult, StoreResult, TransferStats

log = logging.getLogger(__name__)

T = TypeVar("T")

FAST_RETRY_SECONDS = 2.0
"""After the fast path failed (or was not offered), how long calls stay on gRPC before the
client asks the daemon again."""


class DataCalls:
    target: str
    timeout: float
    reconnect_seconds: float
    _stub: Any
    _trusted: frozenset[int]

    def _init_data_calls(self, fast_path: bool, spin_us: int) -> None:
        self._want_fast = fast_path and self.target.startswith("unix:")
        self._spin_us = spin_us
        self._fast: fp.FastPath | None = None
        self._fast_flags = 0
        self._fast_asked_at = -FAST_RETRY_SECONDS
        self._page_sizes: dict[str, int] = {}
        self._async: ThreadPoolExecutor | None = None
        self._fast_lock = threading.Lock()

    def _call(self, method: Callable[..., T], request: Any, *, retry: bool,
              timeout: float | None = None, pool: str | None = None) -> T:
        raise NotImplementedError

    def _credentials(self, pool: str) -> list[tuple[str, str]]:
        raise NotImplementedError

    def _close_data_calls(self) -> None:
        self._want_fast = False
        if self._fast is not None:
            self._fast.close()
        if self._async is not None:
            self._async.shutdown(wait=False)

    # -- choosing the path -------------------------------------------------------------------

    @property
    def data_path(self) -> str:
        """``fast`` while the data calls go over the daemon's fast path, else ``grpc``."""
        return "fast" if self._fast_path() is not None else "grpc"

    def _fast_path(self, timeout: float | None = None) -> fp.FastPath | None:
        """The fast path, asking the daemon for it first if need be, within ``timeout``
        (the call's): a caller never waits past its own deadline for another thread's
        GetInfo, nor for its own (it goes over gRPC instead)."""
        if self._fast is not None or not self._want_fast:
            return self._fast
        wait = min(timeout or self.timeout, 5.0)
        if not self._fast_lock.acquire(timeout=wait):  # one thread asks; others wait, briefly
            return None
        try:
            return self._ask_fast_path(wait)
        finally:
            self._fast_lock.release()

    def _ask_fast_path(self, timeout: float) -> fp.FastPath | None:
        if self._fast is not None or not self._want_fast:
            return self._fast
        now = time.monotonic()
        if now - self._fast_asked_at < FAST_RETRY_SECONDS:
            return None
        self._fast_asked_at = now
        try:
            info = self._stub.GetInfo(pb.GetInfoRequest(), timeout=timeout)
        except grpc.RpcError:
            return None
        if not info.fast_path or info.fast_path_version != w.VERSION:
            return None
        # a daemon that does not say understands the flags the framing had before FLAG_CHAIN
        self._fast_flags = (info.fast_path_flags
                            or w.KNOWN_FLAGS & ~(w.FLAG_CHAIN | w.STORE_DEADLINE))
        # the socket beside ours (the daemon may see its sockets at another path), else its
        mine = self.target[len("unix:"):].removeprefix("//") + ".fast"
        path = mine if os.path.exists(mine) else info.fast_path
        self._fast = fp.FastPath(path, self.timeout, self._spin_us, self._trusted)
        log.info("data calls to %s over the fast path %s", self.target, path)
        return self._fast

    def _fast_call(self, method: w.Method, build: Callable[[], list[bytes]], flags: int = 0,
                   timeout: float | None = None) -> bytes | None:
        """The reply body over the fast path, or None: send it over gRPC. Everything it
        does (asking for the fast path, connecting, retrying an OVERLOADED) stays within
        ``timeout`` (the call's; the client's when None)."""
        start = time.monotonic()
        fast = self._fast_path(timeout)
        if fast is None or flags & ~self._fast_flags:
            return None  # (a flag this daemon's fast path does not know: gRPC)
        try:
            parts = build()
        except ValueError:
            return None  # a key the framing cannot carry: gRPC names it
        budget = timeout or self.timeout
        deadline = start + min(self.reconnect_seconds, budget)
        while True:
            left = start + budget - time.monotonic()
            if left <= 0:
                raise fp.deadline_exceeded("before the call could be sent")
            try:  # the whole budget while little of it is spent (the socket's timeout is
                # set only when it changes: a syscall saved per call)
                return fast.call(method, parts, flags, budget if budget - left < 0.01 else left)
            except fp.FastPathLost as exc:
                log.info("fast path lost (%s); data calls over gRPC", exc)
                self._fast = None
                self._fast_asked_at = time.monotonic()
                fast.close()
                return None
            except Draining:
                return None  # gRPC's retry waits for the successor
            except Overloaded as exc:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise
                delay = max(int(exc.metadata.get("retry_after_ms", "10")) / 1000, 0.001)
                time.sleep(min(delay, remaining))

    def _pages(self, session_id: str, indices: object) -> IndexArray | None:
        page_size = self._page_sizes.get(session_id, 0)
        return fp.page_ids(indices, page_size) if page_size else None

    def beat(self, session_id: str) -> None:
        """A heartbeat of ``session_id``: over the fast path where it is offered (an idle
        worker's only call; over gRPC it costs the daemon about a millisecond of CPU)."""
        got = self._fast_call(w.Method.HEARTBEAT, lambda: fp.session_body(session_id))
        if got is None:
            self._call(self._stub.Heartbeat, pb.HeartbeatRequest(session_id=session_id),
                       retry=True)

    # -- raw pages ---------------------------------------------------------------------------

    def backup(self, session_id: str, host_indices: object, device_indices: object,
               layer_begin: int = 0, layer_end: int = 0) -> TransferStats:
        return self._transfer(w.Method.BACKUP, session_id, host_indices, device_indices,
                              layer_begin, layer_end)

    def load(self, session_id: str, host_indices: object, device_indices: object,
             layer_begin: int = 0, layer_end: int = 0, *, layer_events: bool = False
             ) -> TransferStats:
        """Copy host pages to the device. ``layer_events=True`` (CUDA sessions opened with
        layer events) returns once the copies are enqueued: wait on the session's events
        before reading each layer."""
        return self._transfer(w.Method.LOAD, session_id, host_indices, device_indices,
                              layer_begin, layer_end, layer_events)

    def _transfer(self, method: w.Method, session_id: str, host: object, dev: object,
                  begin: int, end: int, layer_events: bool = False) -> TransferStats:
        hp, dp = self._pages(session_id, host), self._pages(session_id, dev)
        loading = method is w.Method.LOAD
        deadline = self._deadline_ns(None) if loading else 0
        if hp is not None and dp is not None:
            got = self._fast_call(
                method, lambda: fp.raw_body(session_id, hp, dp, (begin, end), deadline),
                _flags(layer_events, deadline))
            if got is not None:
                return fp.decode_transfer(got)
        stub = self._stub.Load if loading else self._stub.Backup
        resp = self._call(stub, pb.TransferRequest(
            session_id=session_id, host_indices=indices_to_bytes(host),
            device_indices=indices_to_bytes(dev), layer_begin=begin, layer_end=end,
            completion=_completion(layer_events), deadline_unix_ns=deadline), retry=True)
        return TransferStats.from_proto(resp)

    def _deadline_ns(self, timeout: float | None) -> int:
        """A copy's deadline on this node's clock: no copy into or out of the caller's
        memory begins after the caller has given up on it (``DEADLINE_PASSED``)."""
        return time.time_ns() + int((timeout or self.timeout) * 1e9)

    # -- the cache ---------------------------------------------------------------------------

    def lookup(self, pool: str, keys: Sequence[bytes | str], *, timeout: float | None = None,
               session_id: str = "", hold_ms: int = 0) -> LookupResult:
        """Which keys are cached (no copy): the hit prefix and a tier per key. With
        ``session_id`` (a session of ``pool``) and ``hold_ms`` the hit is held for that
        session until its ``load_keys`` consumes it, ``release_holds``, its end or
        ``hold_ms`` (``held`` says how many leading keys). ``timeout`` overrides the client's
        deadline for this call."""
        enc = encode_keys(keys)
        hold = bool(session_id and hold_ms > 0)
        cred = session_id if hold else (self._credentials(pool) or [("", "")])[0][1]
        start = time.monotonic()
        got = self._fast_call(w.Method.LOOKUP, lambda: fp.lookup_body(
            pool, cred, enc, hold_ms if hold else 0), w.FLAG_HOLD if hold else 0,
            timeout=timeout)
        if got is not None:
            return fp.decode_lookup(got, hold)
        r = self._call(self._stub.Lookup, pb.LookupRequest(
            pool=pool, keys=enc, session_id=session_id if hold else "",
            hold_ms=hold_ms if hold else 0), retry=True, timeout=_left(start, timeout),
            pool=pool)
        return LookupResult(r.hit_prefix, bytes(r.tiers), r.hits, r.held)

    def release_holds(self, session_id: str, keys: Sequence[bytes | str] = (), *,
                      timeout: float | None = None) -> int:
        """End the session's holds of ``keys`` (none: all of them); returns how many."""
        enc = encode_keys(keys)
        start = time.monotonic()
        got = self._fast_call(w.Method.RELEASE_HOLDS, lambda: fp.release_body(session_id, enc),
                              timeout=timeout)
        if got is not None:
            return int(fp.U32.unpack(got)[0])
        r = self._call(self._stub.ReleaseHolds, pb.ReleaseHoldsRequest(
            session_id=session_id, keys=enc), retry=True, timeout=_left(start, timeout))
        return int(r.released)

    def _store_request(self, session_id: str, keys: Sequence[bytes], device_indices: object,
                       chain: tuple[bytes, np.ndarray] | None, deadline: int
                       ) -> pb.StoreRequest:
        parent, tokens = chain or (b"", None)
        return pb.StoreRequest(session_id=session_id, keys=keys,
                               device_indices=indices_to_bytes(device_indices),
                               token_ids=tokens.tolist() if tokens is not None else (),
                               parent_key=parent, deadline_unix_ns=deadline)

    def store(self, session_id: str, keys: Sequence[bytes | str], device_indices: object,
              *, token_ids: Sequence[int] | np.ndarray | None = None,
              parent_key: bytes | str = b"", timeout: float | None = None) -> StoreResult:
        """The device pages of ``device_indices`` cached under ``keys``. Once ``timeout``
        (the client's when None) has passed the caller may reuse those pages: the daemon
        then begins no copy, and keeps nothing of a copy that ends later
        (``DEADLINE_PASSED``)."""
        enc = encode_keys(keys)
        chain = _chain(token_ids, parent_key)
        dp = self._pages(session_id, device_indices)
        deadline = self._deadline_ns(timeout)
        start = time.monotonic()
        if dp is not None and self._fast_path(timeout) is not None:
            # a daemon from before Store deadlines refuses a Store frame that carries one: it
            # gets none (and could not honour it over gRPC either)
            fast_deadline = deadline if self._fast_flags & w.STORE_DEADLINE else 0
            got = self._fast_call(
                w.Method.STORE,
                lambda: fp.keyed_body(session_id, enc, dp, deadline_ns=fast_deadline,
                                      chain=chain),
                (w.FLAG_CHAIN if chain is not None else 0)
                | (w.FLAG_DEADLINE if fast_deadline else 0), timeout)
            if got is not None:
                return fp.decode_store(got)
        return StoreResult.from_proto(self._call(
            self._stub.Store,
            self._store_request(session_id, enc, device_indices, chain, deadline),
            retry=True, timeout=_left(start, timeout)))

    def store_async(self, session_id: str, keys: Sequence[bytes | str],
                    device_indices: object, *,
                    token_ids: Sequence[int] | np.ndarray | None = None,
                    parent_key: bytes | str = b"") -> Future[StoreResult]:
        """``store`` without blocking the caller: a future of its result (or domain error)."""
        if self._fast_path() is not None and self._pages(session_id, device_indices) is not None:
            if self._async is None:
                self._async = ThreadPoolExecutor(4, thread_name_prefix="hicache-store")
            return self._async.submit(self.store, session_id, keys, device_indices,
                                      token_ids=token_ids, parent_key=parent_key)
        out: Future[StoreResult] = Future()
        call = self._stub.Store.future(
            self._store_request(session_id, encode_keys(keys), device_indices,
                                _chain(token_ids, parent_key), self._deadline_ns(None)),
            timeout=self.timeout)

        def done(f: Any) -> None:
            try:
                out.set_result(StoreResult.from_proto(f.result()))
            except grpc.RpcError as err:
                out.set_exception(from_rpc_error(err))
            except Exception as exc:  # cancelled, or the channel closed
                out.set_exception(exc)

        call.add_done_callback(done)
        return out

    def load_keys(self, session_id: str, keys: Sequence[bytes | str], device_indices: object,
                  layer_begin: int = 0, layer_end: int = 0, *, layer_events: bool = False,
                  timeout: float | None = None) -> TransferStats:
        """The pages of ``keys`` into one device page each (see ``WorkerSession``). No copy
        begins once ``timeout`` (the client's when None) has passed."""
        enc = encode_keys(keys)
        dp = self._pages(session_id, device_indices)
        deadline = self._deadline_ns(timeout)
        start = time.monotonic()
        if dp is not None:
            got = self._fast_call(
                w.Method.LOAD_KEYS,
                lambda: fp.keyed_body(session_id, enc, dp, (layer_begin, layer_end), deadline),
                _flags(layer_events, deadline), timeout)
            if got is not None:
                return fp.decode_transfer(got)
        resp = self._call(self._stub.LoadKeys, pb.LoadKeysRequest(
            session_id=session_id, keys=enc,
            device_indices=indices_to_bytes(device_indices), layer_begin=layer_begin,
            layer_end=layer_end, completion=_completion(layer_events),
            deadline_unix_ns=deadline), retry=True, timeout=_left(start, timeout))
        return TransferStats.from_proto(resp)


def _left(start: float, timeout: float | None) -> float | None:
    """What is left of a call's ``timeout`` once the fast path gave up on it (None: none)."""
    return None if timeout is None else max(timeout - (time.monotonic() - start), 0.001)


def _flags(layer_events: bool, deadline_ns: int) -> int:
    return ((w.FLAG_LAYER_EVENTS if layer_events else 0)
            | (w.FLAG_DEADLINE if deadline_ns else 0))


def _completion(layer_events: bool) -> Any:
    return pb.COMPLETION_LAYER_EVENTS if layer_events else pb.COMPLETION_WAIT


def _chain(token_ids: Sequence[int] | np.ndarray | None, parent_key: bytes | str
           ) -> tuple[bytes, np.ndarray] | None:
    """What a Store says of its keys' chain (the daemon checks it): None when nothing."""
    if (token_ids is None or len(token_ids) == 0) and not parent_key:
        return None
    parent = encode_keys([parent_key], "parent_key")[0] if parent_key else b""
    tokens = np.asarray(token_ids if token_ids is not None else (), dtype=np.int64).ravel()
    return parent, tokens
