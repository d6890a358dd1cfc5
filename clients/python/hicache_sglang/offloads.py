"""The linker's write-through: ``Store`` calls that never make SGLang's scheduler wait.

On CPU workers the device indices are host tensors already: the store goes out at once
(``store_async``: on the client's store threads). On GPU workers the indices live
on the GPU and the KV being stored is still being written by the forward: a side stream waits
for the forward (what it enqueued and SGLang's offload-ready events), records the session's
ready event (the daemon's copy waits on it), and copies the indices to pinned host memory; a
worker thread waits for that copy, then stores. The scheduler's thread only enqueues: nothing
it does synchronizes with the GPU (checked on a GPU under ``set_sync_debug_mode("error")``,
tests/integrations/sglang/test_sglang_gpu.py).

Primitives: ``Offloads(limit, gpu)`` (``gpu``: the device, the ``ReadyEvent`` and SGLang's
``record_offload_ready``, or None on CPU): ``submit(session, keys, indices, origin)`` (the
pages' tokens and parent where known: ``hicache_sglang.origins``), ``skip(n)`` (a rank that
stores nothing: an at-once success), ``full``, ``completed()`` (leading results in), ``pop()``
(the next result, or its error), ``drain(seconds)``, ``close()``.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from hicache_client.results import StoreResult
from hicache_sglang.origins import Origin

GpuSide = tuple[torch.device, Any, Callable[[], list[Any]]]


class Offloads:
    def __init__(self, limit: int, gpu: GpuSide | None) -> None:
        self.limit = limit
        self._futures: collections.deque[Future[StoreResult]] = collections.deque()
        self._gpu = gpu
        self._pool: ThreadPoolExecutor | None = None
        self._side: Any = None
        if gpu is not None:
            self._pool = ThreadPoolExecutor(4, thread_name_prefix="hicache-offload")
            self._side = torch.cuda.Stream(device=gpu[0])  # type: ignore[no-untyped-call]

    @property
    def full(self) -> bool:
        return len(self._futures) >= self.limit

    def skip(self, keys: int) -> bool:
        done: Future[StoreResult] = Future()
        done.set_result(StoreResult(0, keys, 0, b"", 0, 0.0))
        self._futures.append(done)
        return True

    def submit(self, session: Any, keys: list[Any], indices: torch.Tensor,
               origin: Origin | None = None) -> None:
        """Store ``keys`` from the device pages of ``indices``, told with ``origin``'s tokens
        and parent where known; raises what ``store_async`` raises at once
        (``HiCacheError``, ``ValueError``)."""
        told: dict[str, Any] = {} if origin is None else {
            "token_ids": origin.tokens, "parent_key": origin.parent_key,
            "cache_salt": origin.cache_salt, "lora_name": origin.lora_name}
        if self._gpu is None:
            self._futures.append(session.store_async(keys, indices.to(torch.int64), **told))
            return
        _, ready, record_offload_ready = self._gpu
        side, forward = self._side, torch.cuda.current_stream()
        events = record_offload_ready()
        with torch.cuda.stream(side):
            side.wait_stream(forward)
            for event in events:
                side.wait_event(event)
            ready.record(side)
            on_host = indices.to(torch.int64).to("cpu", non_blocking=True)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record(side)
        indices.record_stream(side)
        assert self._pool is not None

        def store() -> StoreResult:
            copied.synchronize()
            result: StoreResult = session.store(keys, on_host, **told)
            return result

        self._futures.append(self._pool.submit(store))

    def completed(self) -> int:
        n = 0
        for future in self._futures:
            if not future.done():
                break
            n += 1
        return n

    def pop(self) -> StoreResult:
        """The oldest offload's result (SGLang asks only for completed ones)."""
        return self._futures.popleft().result(timeout=0)

    def drain(self, seconds: float) -> None:
        """Wait for what is in flight, ``seconds`` at most in all; forget it."""
        deadline = time.monotonic() + seconds
        while self._futures:
            try:
                self._futures.popleft().result(timeout=max(deadline - time.monotonic(), 0))
            except BaseException:  # a failed or late store leaves nothing behind
                pass

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
