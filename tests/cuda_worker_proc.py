"""A GPU worker process: CUDA IPC device buffers, a session, backup / load / verify rounds.

Usage: python -m tests.cuda_worker_proc TARGET POOL WORKER_ID SEED ROUNDS TOKENS [--forever]
       [--layer-events] [--fake] [--keyed] [--keep] [--vmm]

``--keyed`` moves the pages as cache keys (Store / LoadKeys) instead of raw host pages;
``--keep`` leaves each round's keys in the pool (it fills, and evicts or grows). ``--vmm`` puts
the buffers in VMM memory (``cuMemCreate`` chunks mapped back to back, a layer across two: as
vLLM 0.34 allocates) handed over as ``cuda_vmm``: the chunks' fds go with the session's
identity request and are closed once it is open (the daemon's imports hold the memory).

With ``--fake`` the buffers live in the fake driver's memory (``$HICACHED_CUDA_DRIVER``) and are
checked through host views; otherwise they are torch CUDA tensors and loads with layer events
are checked layer group by layer group on a side stream that waits only for that group's event
(a group read before its event fires would see the zeroed pages). Prints one JSON line; exits 1
on any mismatch.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch

from hicache.buffers import layer_shapes
from hicache.cuda_driver import load_driver
from hicache.specs import PoolSpec, Role
from hicache_client import HiCacheClient
from hicache_client.cuda import CudaDeviceBuffers, LayerEvents, ReadyEvent


def real_buffers(spec: PoolSpec, tokens: int
                 ) -> tuple[CudaDeviceBuffers, dict[tuple[str, Role, int], torch.Tensor]]:
    tensors: dict[str, dict[Role, list[torch.Tensor]]] = {}
    views: dict[tuple[str, Role, int], torch.Tensor] = {}
    for name, geometry, comp, shape in layer_shapes(spec, tokens):
        layers = [torch.empty(shape, dtype=comp.dtype.torch_dtype, device="cuda")
                  for _ in range(geometry.layer_num)]
        tensors.setdefault(name, {})[comp.role] = layers
        for i, t in enumerate(layers):
            views[(name, comp.role, i)] = t.view(torch.uint8).view(-1, comp.unit_bytes)
    return CudaDeviceBuffers.from_tensors(tensors), views


def fake_buffers(spec: PoolSpec, tokens: int
                 ) -> tuple[CudaDeviceBuffers, dict[tuple[str, Role, int], torch.Tensor]]:
    from tests.cuda_fixtures import make_gpu_kv

    driver = load_driver()
    assert driver is not None, "HICACHED_CUDA_DRIVER must name the fake driver"
    kv = make_gpu_kv(driver, spec, tokens)
    units = {(n, c.role): c.unit_bytes for n, _g, c, _s in layer_shapes(spec, tokens)}
    views = {k: v.view(-1, units[(k[0], k[1])]) for k, v in kv.views.items()}
    return kv.descriptors, views


def vmm_buffers(spec: PoolSpec, tokens: int, fake: bool
                ) -> tuple[CudaDeviceBuffers, dict[tuple[str, Role, int], torch.Tensor]]:
    from tests.cuda_fixtures import make_vmm_kv

    driver = load_driver()
    assert driver is not None, "no CUDA driver"
    if not fake:
        torch.cuda.init()  # the primary context torch uses, which the driver's calls share
    kv = make_vmm_kv(driver, spec, tokens, real=not fake)
    assert kv.descriptors.transport == "cuda_vmm"
    units = {(n, c.role): c.unit_bytes for n, _g, c, _s in layer_shapes(spec, tokens)}
    views = {k: v.view(-1, units[(k[0], k[1])]) for k, v in kv.views.items()}
    return kv.descriptors, views


def main() -> int:
    target, pool, worker, seed, rounds, tokens = sys.argv[1:7]
    forever, fake = "--forever" in sys.argv, "--fake" in sys.argv
    use_events, keyed = "--layer-events" in sys.argv, "--keyed" in sys.argv
    keep, vmm = "--keep" in sys.argv, "--vmm" in sys.argv
    client = HiCacheClient(target)
    spec = client.get_pool(pool).spec
    ps = spec.page_size
    gen = torch.Generator().manual_seed(int(seed))
    if vmm:
        bufs, views = vmm_buffers(spec, int(tokens), fake)
    else:
        bufs, views = (fake_buffers if fake else real_buffers)(spec, int(tokens))
    layer_num = spec.max_layers
    events = LayerEvents(layer_num) if use_events and not fake else None
    ready = ReadyEvent() if not fake else None
    handles: list[bytes] = events.handles if events else []
    ready_handle = ready.handle if ready else b""
    drv = None
    fake_events: list[int] = []
    if fake:  # the fake driver's own interprocess events stand in for torch's
        drv = load_driver()
        assert drv is not None
        with drv.context(0):
            fake_events = [drv.event_create(interprocess=True)
                           for _ in range(layer_num if use_events else 0)]
            fake_ready = drv.event_create(interprocess=True)
            handles = [drv.ipc_get_event_handle(e) for e in fake_events]
            ready_handle = drv.ipc_get_event_handle(fake_ready)
    granular = {(n, c.role): c.page_granular for n, _g, c, _s in layer_shapes(spec, int(tokens))}
    device_pages = int(tokens) // ps
    verified = mismatches = 0
    session = client.open_session(pool, worker, bufs.descriptors,  # the daemon's lease
                                  layer_events=handles, ready_event=ready_handle, fds=bufs.fds)
    bufs.close()  # the session has them (VMM chunks: the daemon's imports hold the memory)
    print(json.dumps({"session": session.session_id, "device_uuid": session.device_uuid}),
          flush=True)

    def index(key: tuple[str, Role, int], pages: np.ndarray) -> torch.Tensor:
        if granular[(key[0], key[1])]:
            idx = torch.from_numpy(pages)
        else:
            idx = torch.from_numpy((pages[:, None] * ps + np.arange(ps)).reshape(-1))
        return idx.to(views[key].device)

    def rows(key: tuple[str, Role, int], pages: np.ndarray) -> torch.Tensor:
        return views[key][index(key, pages)]

    with session:
        i = 0
        while forever or i < int(rounds):
            i += 1
            pages = np.random.default_rng(int(seed) * 1000 + i).permutation(device_pages)[:4]
            expect: dict[tuple[str, Role, int], torch.Tensor] = {}
            for k, v in views.items():  # fresh bytes in the pages of this round only
                idx = index(k, pages)
                vals = torch.randint(0, 256, (idx.numel(), v.shape[1]), dtype=torch.uint8,
                                     generator=gen)
                v[idx] = vals.to(v.device)
                expect[k] = vals
            dev = torch.from_numpy((pages[:, None] * ps + np.arange(ps)).reshape(-1))
            keys = [f"{worker}/{seed}/{i}/{j}".encode() for j in range(4)]
            host = None if keyed else client.alloc(pool, 4 * ps)
            if ready is not None:
                ready.record()
            if host is None:
                assert session.store(keys, dev).stored == 4
            else:
                session.backup(host, dev)
            for k, v in views.items():
                v[index(k, pages)] = 0
            if ready is not None:
                ready.record()
            if host is None:
                r = session.load_keys(keys, dev, layer_events=use_events)
            else:
                r = session.load(host, dev, layer_events=use_events)
            assert r.pending == use_events
            got: dict[tuple[str, Role, int], torch.Tensor] = {}
            if events is not None:
                side = torch.cuda.Stream()
                for g in range(layer_num):  # one event per layer
                    events.wait(g, side)
                    with torch.cuda.stream(side):
                        for k in views:
                            if k[2] == g:
                                got[k] = rows(k, pages).clone()
                side.synchronize()
            elif fake and use_events:  # wait as a GPU stream would, group by group
                assert drv is not None
                with drv.context(0):
                    for e in fake_events:
                        drv.event_synchronize(e)
            elif not fake:
                torch.cuda.synchronize()
            for k in views:
                seen = got.get(k)
                if torch.equal((seen if seen is not None else rows(k, pages)).cpu(), expect[k]):
                    verified += 1
                else:
                    mismatches += 1
            if host is None:
                if not keep:
                    client.remove_keys(pool, keys)
            else:
                client.free(pool, host)
            if forever:
                time.sleep(0.01)
    print(json.dumps({"worker": worker, "rounds": i, "buffers": len(views),
                      "verified_buffers": verified, "mismatches": mismatches}), flush=True)
    client.close()
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
