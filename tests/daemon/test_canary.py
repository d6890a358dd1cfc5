from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.errors import CanaryMismatch, HiCacheError
from hicache.specs import CanarySpec, DType, Layout, MemberSpec, Role
from hicached.copy.engine import TransferEngine
from hicached.core.worker_buffers import WorkerBuffers
from tests.helpers import device_bytes, dsa, make_pool, mha, mla, random_device, spec

ENGINE = TransferEngine(threads=2)


def page_idx(pages: list[int], ps: int) -> torch.Tensor:
    p = torch.tensor(pages)
    return (p[:, None] * ps + torch.arange(ps)).reshape(-1)


@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.value)
@pytest.mark.parametrize("read_bytes", [16, 32])
def test_clean_round_trip_verifies(layout: Layout, read_bytes: int) -> None:
    s = spec(mla(DType.BFLOAT16), layout=layout, canary=CanarySpec(read_bytes),
             side_pools=(MemberSpec("indexer", dsa()),))
    pool = make_pool(s)
    try:
        src = random_device(s, 32)
        host = pool.alloc(12)
        ENGINE.backup(pool, src, host, page_idx([1, 2, 3], 4))
        ENGINE.load(pool, WorkerBuffers.allocate(s, 32), host, page_idx([0, 1, 2], 4))
        assert pool.canary is not None
        assert pool.canary.verified_pages == 3 and pool.canary.mismatched_pages == 0
    finally:
        pool.close()


@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.value)
@pytest.mark.parametrize("where", ["K", "V"])
def test_corrupted_host_page_is_named_and_nothing_is_loaded(layout: Layout, where: str) -> None:
    s = spec(mha(), layout=layout, canary=CanarySpec(16))
    pool = make_pool(s)
    try:
        src = random_device(s, 32)
        host = pool.alloc(12)  # pages 0, 1, 2
        ENGINE.backup(pool, src, host, page_idx([4, 5, 6], 4))
        # flip one byte of page 1 (token 5), layer 2, in the first 16 bytes of the row
        buf = pool.buffer("kv", Role[where]).view(torch.uint8)
        if layout is Layout.LAYER_FIRST:
            buf[2, 5].view(-1)[3] ^= 0xFF
        elif layout is Layout.PAGE_FIRST:
            buf[5, 2].view(-1)[3] ^= 0xFF
        else:
            buf[1, 2, 1].view(-1)[3] ^= 0xFF
        dst = random_device(s, 32, seed=9)
        before = device_bytes(dst)
        with pytest.raises(CanaryMismatch) as exc:
            ENGINE.load(pool, dst, host, page_idx([0, 1, 2], 4))
        assert exc.value.reason == "CANARY_MISMATCH"
        assert exc.value.metadata["pages"] == "1"
        assert exc.value.metadata["first_layer"] == "2"
        assert all(torch.equal(a, b) for a, b in zip(before, device_bytes(dst), strict=True))
        assert pool.canary is not None and pool.canary.mismatched_pages == 1
        # a layer range that avoids the damaged layer still loads
        ENGINE.load(pool, dst, host, page_idx([0, 1, 2], 4), layer_begin=0, layer_end=2)
    finally:
        pool.close()


def test_swapped_tokens_change_the_fingerprint() -> None:
    s = spec(mha(dim=16), page_size=2, canary=CanarySpec(16))
    pool = make_pool(s)
    try:
        src = random_device(s, 8)
        host = pool.alloc(2)
        ENGINE.backup(pool, src, host, torch.arange(2))
        k = pool.buffer("kv", Role.K)
        k[0, [0, 1]] = k[0, [1, 0]].clone()
        with pytest.raises(CanaryMismatch):
            ENGINE.load(pool, WorkerBuffers.allocate(s, 8), host, torch.arange(2))
    finally:
        pool.close()


def test_freed_page_forgets_its_fingerprint() -> None:
    s = spec(mha(), canary=CanarySpec(16))
    pool = make_pool(s)
    try:
        src = random_device(s, 32)
        host = pool.alloc(4)
        ENGINE.backup(pool, src, host, torch.arange(4))
        assert pool.canary is not None
        page, layers = host[::4].numpy() // 4, range(0, 3)
        wrong = np.zeros((1, 3), dtype=np.uint64)
        with pytest.raises(CanaryMismatch):
            pool.canary.verify(page, layers, wrong)  # recorded: a wrong print mismatches
        pool.free(host)
        pool.canary.verify(page, layers, wrong)  # forgotten: nothing left to compare
        assert pool.canary.mismatched_pages == 1
        again = pool.alloc(pool.size_tokens)  # the page comes back unwritten
        with pytest.raises(HiCacheError) as exc:
            ENGINE.load(pool, WorkerBuffers.allocate(s, 32), again[-4:], torch.arange(4))
        assert exc.value.reason == "PAGE_NOT_WRITTEN"
    finally:
        pool.close()


def test_fingerprint_is_position_salted() -> None:
    from hicached.core.canary import fingerprints

    words = np.arange(64, dtype=np.uint64)
    a = fingerprints(words, np.array([[0, 4]]), 2, salt=0)
    b = fingerprints(words, np.array([[4, 0]]), 2, salt=0)
    c = fingerprints(words, np.array([[0, 4]]), 2, salt=1)
    assert a[0] != b[0] and a[0] != c[0]
