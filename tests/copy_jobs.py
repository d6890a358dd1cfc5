"""One random copy job for the native kernel, checked against zeroed destinations: what the
kernel's concurrency tests run in threads and in a child process.

Primitives: ``LAYERS``, ``PAGES``, ``PAGE_BYTES`` (the buffers' shape: layers x pages x bytes),
``one_copy(rng, src, dst)`` (48 random pages on a random number of helper threads; True when
exact).
"""

from __future__ import annotations

import random

import numpy as np

from hicached.copy import native

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
