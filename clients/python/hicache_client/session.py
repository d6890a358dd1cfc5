"""``WorkerSession``: an open session on a pool, heartbeating in a background thread.

A session attaches a worker's device buffers; transfers name it. ``backup`` / ``load`` move raw
pages by host index, ``store`` / ``store_async`` / ``load_keys`` move pages named by content
keys, ``lookup`` (with ``hold_ms``) holds a hit for this session's coming ``load_keys``,
``alloc`` hands out raw pages the session owns. Its client is any ``SessionCalls`` (a
``HiCacheClient``): this module does not import the client that imports it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from hicache.errors import HiCacheError
from hicache.v1 import hicache_pb2 as pb
from hicache_client.results import LookupResult, StoreResult, TransferStats

if TYPE_CHECKING:
    import numpy as np
    import torch


class SessionCalls(Protocol):
    """The calls a session makes on its client (``HiCacheClient`` has them), each named by
    the session's id: what a session needs of a client, and no more."""

    def beat(self, session_id: str) -> None: ...

    def backup(self, *args: Any, **kwargs: Any) -> TransferStats: ...

    def load(self, *args: Any, **kwargs: Any) -> TransferStats: ...

    def alloc(self, *args: Any, **kwargs: Any) -> torch.Tensor: ...

    def store(self, *args: Any, **kwargs: Any) -> StoreResult: ...

    def store_async(self, *args: Any, **kwargs: Any) -> Future[StoreResult]: ...

    def lookup(self, *args: Any, **kwargs: Any) -> LookupResult: ...

    def release_holds(self, *args: Any, **kwargs: Any) -> int: ...

    def load_keys(self, *args: Any, **kwargs: Any) -> TransferStats: ...

    def close_session(self, session_id: str) -> None: ...

    def forget_session(self, session_id: str) -> None: ...


class WorkerSession:
    """An open session; heartbeats in a background thread at a third of the lease."""

    def __init__(self, client: SessionCalls, msg: pb.Session, heartbeat: bool) -> None:
        self.client = client
        self.session_id: str = msg.session_id
        self.pool: str = msg.pool
        self.lease_ms: int = msg.lease_ms
        self.lease_clamped: bool = msg.lease_clamped
        """The daemon cut the lease asked for down to its maximum (``lease_ms`` is that)."""
        self.public_id: str = msg.public_id
        """The name others see (``ListSessions``, ``hicachectl sessions``); ``session_id`` is
        the capability: keep it to this worker."""
        self.peer_uid: int | None = msg.peer_uid if msg.peer_known else None
        """The uid the daemon bound the session to (identity socket), if it knows it."""
        self.closed = False
        self.device_tokens: int = msg.device_tokens
        self.device_uuid: str = msg.device_uuid
        self.layer_events: int = msg.layer_events
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.heartbeat_error: HiCacheError | None = None
        if heartbeat:
            self._thread = threading.Thread(target=self._beat, daemon=True,
                                            name=f"heartbeat-{self.session_id[:8]}")
            self._thread.start()

    def _beat(self) -> None:
        period = max(self.lease_ms / 3000.0, 0.05)
        while not self._stop.wait(period):
            try:
                self.client.beat(self.session_id)
                self.heartbeat_error = None
            except HiCacheError as exc:  # kept for the caller; the next transfer will raise
                self.heartbeat_error = exc
            except ValueError:  # the client's channel was closed under us
                return

    def backup(self, host_indices: object, device_indices: object, layer_begin: int = 0,
               layer_end: int = 0) -> TransferStats:
        return self.client.backup(self.session_id, host_indices, device_indices, layer_begin,
                                  layer_end)

    def load(self, host_indices: object, device_indices: object, layer_begin: int = 0,
             layer_end: int = 0, *, layer_events: bool = False) -> TransferStats:
        return self.client.load(self.session_id, host_indices, device_indices, layer_begin,
                                layer_end, layer_events=layer_events)

    def alloc(self, num_tokens: int) -> torch.Tensor:
        """Raw pages this session owns: freed when it closes or its lease runs out."""
        return self.client.alloc(self.pool, num_tokens, session_id=self.session_id)

    def store(self, keys: Sequence[bytes | str], device_indices: object, *,
              token_ids: Sequence[int] | np.ndarray | None = None,
              parent_key: bytes | str = b"", lora_name: str = "", cache_salt: str = "",
              lookahead_token_ids: Sequence[Sequence[int]] | np.ndarray | None = None,
              timeout: float | None = None) -> StoreResult:
        """Copy one device page per key into the cache (all layers). Keys already there, or
        being written by another request, are not written again. The keys are one chain in
        order; ``token_ids`` (``page_size`` per key), ``parent_key`` (the key before the
        first), ``lora_name`` (the LoRA adapter whose KV they are), ``cache_salt`` (the
        request's) and ``lookahead_token_ids`` (with ``token_ids``: one row per key of the
        tokens after its page that its key's hash covers, every row as long: vLLM's
        lookahead block hashes) are what routers are told of them (KV events,
        ``watch_events``). Once ``timeout`` (the client's when None) has passed the pages may
        be reused: the daemon keeps nothing of a copy it had not finished by then."""
        return self.client.store(self.session_id, keys, device_indices, token_ids=token_ids,
                                 parent_key=parent_key, lora_name=lora_name,
                                 cache_salt=cache_salt,
                                 lookahead_token_ids=lookahead_token_ids, timeout=timeout)

    def store_async(self, keys: Sequence[bytes | str], device_indices: object, *,
                    token_ids: Sequence[int] | np.ndarray | None = None,
                    parent_key: bytes | str = b"", lora_name: str = "",
                    cache_salt: str = "",
                    lookahead_token_ids: Sequence[Sequence[int]] | np.ndarray | None = None
                    ) -> Future[StoreResult]:
        """``store`` without waiting (an inference scheduler must not block on it); the
        future raises the call's domain error. Not retried when the daemon is away."""
        return self.client.store_async(self.session_id, keys, device_indices,
                                       token_ids=token_ids, parent_key=parent_key,
                                       lora_name=lora_name, cache_salt=cache_salt,
                                       lookahead_token_ids=lookahead_token_ids)

    def lookup(self, keys: Sequence[bytes | str], hold_ms: int = 0, *,
               timeout: float | None = None, touch: bool = False) -> LookupResult:
        """Look the keys up in this session's pool; with ``hold_ms`` the hit is held for this
        session (``held``) until its ``load_keys`` consumes it, ``release_holds``, its end or
        ``hold_ms`` (capped by the daemon's ``max_hold_ms``); ``touch``: the hit's host pages
        count as used now."""
        return self.client.lookup(self.pool, keys, timeout=timeout, session_id=self.session_id,
                                  hold_ms=hold_ms, touch=touch)

    def release_holds(self, keys: Sequence[bytes | str] = (), *,
                      timeout: float | None = None) -> int:
        """End this session's holds of ``keys`` (none: all); returns how many."""
        return self.client.release_holds(self.session_id, keys, timeout=timeout)

    def load_keys(self, keys: Sequence[bytes | str], device_indices: object,
                  layer_begin: int = 0, layer_end: int = 0, *, layer_events: bool = False,
                  timeout: float | None = None) -> TransferStats:
        """Copy the pages of ``keys`` into one device page each; every key must be in the
        cache or held by this session, else ``KEY_NOT_FOUND`` and nothing moves. The holds
        of the keys loaded end when the copy does."""
        return self.client.load_keys(self.session_id, keys, device_indices, layer_begin,
                                     layer_end, layer_events=layer_events, timeout=timeout)

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def retire(self) -> None:
        """Stop using it without a call to the daemon (which ended it, or cannot be reached):
        its heartbeat stops and the client forgets what it kept for it."""
        self.stop_heartbeat()
        self.client.forget_session(self.session_id)

    def close(self) -> None:
        self.stop_heartbeat()
        self.closed = True
        self.client.close_session(self.session_id)

    def __enter__(self) -> WorkerSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
