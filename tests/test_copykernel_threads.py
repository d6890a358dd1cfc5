"""The native copy kernel's worker pool under concurrency: many callers, mixed thread counts.

One caller at a time dispatches to the persistent workers (others copy on their own thread);
consecutive dispatches ask for different numbers of helpers, and a helper that is slow to wake
must neither run a later dispatch's job twice nor miss it. Every copy is checked against
zeroed destinations, and the calls run from several Python threads at once (the kernel
releases the GIL), so a job that ran twice, early or on a dead caller's plan shows as wrong
bytes or a crash.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from hicached.copy import native

pytestmark = pytest.mark.skipif(native.KERNEL is None, reason="native kernel not built")

LAYERS, PAGES, PAGE_BYTES = 4, 64, 512


def one_copy(rng: random.Random, src: np.ndarray, dst: np.ndarray) -> bool:
    kernel = native.KERNEL
    assert kernel is not None
    dst[...] = 0
    src_pages = np.array(rng.sample(range(PAGES), 48), dtype=np.int64)
    dst_pages = np.array(rng.sample(range(PAGES), 48), dtype=np.int64)
    src_base = np.array([src[layer].ctypes.data for layer in range(LAYERS)], dtype=np.int64)
    dst_base = np.array([dst[layer].ctypes.data for layer in range(LAYERS)], dtype=np.int64)
    threads = rng.choice([2, 3, 4, 5, 8, 13])
    moved = kernel.copy_pages(dst_base, src_base, dst_pages, src_pages, 64, PAGE_BYTES // 64,
                              PAGE_BYTES, PAGE_BYTES, 64, 64, threads, 0, 0, False)
    assert moved == LAYERS * len(src_pages) * PAGE_BYTES
    want = np.zeros_like(dst)
    want[:, dst_pages] = src[:, src_pages]
    return bool(np.array_equal(dst, want))


def test_many_callers_with_mixed_thread_counts_copy_exactly() -> None:
    callers, rounds = 6, 200
    bad: list[str] = []

    def caller(seed: int) -> None:
        rng = random.Random(seed)
        src = np.frombuffer(rng.randbytes(LAYERS * PAGES * PAGE_BYTES), dtype=np.uint8
                            ).reshape(LAYERS, PAGES, PAGE_BYTES).copy()
        dst = np.empty_like(src)
        for r in range(rounds):
            if not one_copy(rng, src, dst):
                bad.append(f"caller {seed} round {r}")
                return

    threads = [threading.Thread(target=caller, args=(s,)) for s in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad, bad[:5]


def test_one_caller_alternating_thread_counts() -> None:
    rng = random.Random(7)
    src = np.frombuffer(rng.randbytes(LAYERS * PAGES * PAGE_BYTES), dtype=np.uint8
                        ).reshape(LAYERS, PAGES, PAGE_BYTES).copy()
    dst = np.empty_like(src)
    for _ in range(2500):
        assert one_copy(rng, src, dst)
