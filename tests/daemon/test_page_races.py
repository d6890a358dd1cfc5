"""One writer per page: a raw Backup or Load whose pages are freed, and handed to another
tenant's Store, between its checks and its copy never touches them.

Deterministic: the raw copy is stopped at the seam ``raw.checked`` (validated, not yet held)
while the test frees its page and another session's Store takes that very page for a key
(the allocator hands out the page freed last first). Then the raw copy goes on: it must fail
``PAGE_NOT_ALLOCATED`` and the keyed page must hold the Store's bytes, checked by loading it
into device rows zeroed first. Both page forms (token indices over gRPC, page ids over the fast
path) and both directions. The stress version with real processes is in
tests/reliability/test_page_writer.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from hicache import seams
from hicache.errors import PageNotAllocated
from hicache.indices import PageIds
from hicached.cache.pool_cache import PoolCache
from hicached.copy.engine import Op, TransferEngine
from hicached.core.pool import HostPool
from hicached.core.worker_buffers import WorkerBuffers
from tests.helpers import make_pool, mha, random_device, spec

PS = 4


@pytest.fixture
def pool() -> Iterator[HostPool]:
    p = make_pool(spec(mha(), page_size=PS, size_tokens=PS * 4))
    yield p
    p.close()


def rows(page: int) -> np.ndarray:
    return np.arange(page * PS, (page + 1) * PS, dtype=np.int64)


def page_of(dev: WorkerBuffers, page: int) -> list[torch.Tensor]:
    return [t.view(torch.uint8)[page * PS:(page + 1) * PS].clone() for t in dev.all_tensors()]


def run_raw(engine: TransferEngine, op: Op, pool: HostPool, dev: WorkerBuffers,
            host: np.ndarray, device: np.ndarray, page_ids: bool
            ) -> tuple[threading.Thread, list[BaseException]]:
    """The raw copy in a thread of its own: (the thread, what it raised)."""
    errors: list[BaseException] = []

    def go() -> None:
        try:
            args = ((PageIds((host // PS)[::PS]), PageIds((device // PS)[::PS])) if page_ids
                    else (host, device))
            call = engine.backup if op is Op.BACKUP else engine.load
            call(pool, dev, *args)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=go)
    t.start()
    return t, errors


@pytest.mark.parametrize("page_ids", [False, True], ids=["indices", "page_ids"])
@pytest.mark.parametrize("op", [Op.BACKUP, Op.LOAD], ids=lambda o: o.value)
def test_a_raw_copy_never_touches_a_page_freed_and_reused_under_it(
        pool: HostPool, op: Op, page_ids: bool) -> None:
    engine = TransferEngine(1)
    cache = PoolCache(pool)
    raw_dev = random_device(pool.spec, PS * 8, seed=1)  # the raw client's buffers
    tenant = random_device(pool.spec, PS * 8, seed=2)  # another tenant's
    host = pool.allocator.alloc(PS)
    raw_page = int(host[0]) // PS
    engine.backup(pool, raw_dev, host, rows(0))  # written, so that a raw Load is valid too
    with seams.Pause("raw.checked") as stop:
        t, errors = run_raw(engine, op, pool, raw_dev, host, rows(1), page_ids)
        assert stop.wait_reached(), "the raw copy did not reach its check"
        pool.allocator.free(host)  # a buggy or racing client frees it
        ticket = cache.begin_store([b"tenant-key"])  # another session's Store reuses it
        assert ticket.pages.tolist() == [raw_page], "the freed page was not reused"
        engine.transfer_pages(Op.BACKUP, pool, tenant, ticket.pages, np.asarray([3]),
                              range(pool.spec.max_layers))
        cache.finish_store(ticket, True)
        before = page_of(raw_dev, 1)
        stop.release()
        t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], PageNotAllocated), errors
    assert errors[0].reason == "PAGE_NOT_ALLOCATED"
    if op is Op.LOAD:  # nothing of the tenant's page reached the raw client's rows
        assert all(torch.equal(a, b) for a, b in zip(page_of(raw_dev, 1), before, strict=True))
    # the tenant's page holds the tenant's bytes: load it into zeroed rows and compare
    reader = random_device(pool.spec, PS * 8, seed=3)
    for t_ in reader.all_tensors():
        t_.zero_()
    held = cache.begin_load([b"tenant-key"])
    try:
        engine.transfer_pages(Op.LOAD, pool, reader, held, np.asarray([5]),
                              range(pool.spec.max_layers))
    finally:
        cache.finish_load(held)
    assert all(torch.equal(a, b) for a, b in zip(page_of(reader, 5), page_of(tenant, 3),
                                                 strict=True)), "another tenant's page changed"
    pool.allocator.memcheck()


def test_a_raw_copy_of_pages_freed_and_reallocated_raw_is_refused(pool: HostPool) -> None:
    """Reuse by another raw client (same kind, another generation) is refused as well."""
    engine = TransferEngine(1)
    dev = random_device(pool.spec, PS * 8, seed=4)
    host = pool.allocator.alloc(PS)
    with seams.Pause("raw.checked") as stop:
        t, errors = run_raw(engine, Op.BACKUP, pool, dev, host, rows(2), False)
        assert stop.wait_reached()
        pool.allocator.free(host)
        again = pool.allocator.alloc(PS)
        assert again.tolist() == host.tolist()
        stop.release()
        t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], PageNotAllocated), errors
    written = pool.allocator.raw_state(again[::PS] // PS, range(0, 1))[1]
    assert written is not None and not written.any(), \
        "the refused backup marked the other client's page written"
