"""SGLang's own cache classes on CPU with the hicached linker, as a scheduler drives them.

``SGLangCache`` builds SGLang 0.5.23's real ``MHATokenToKVPool`` / ``MLATokenToKVPool``,
``PagedTokenToKVPoolAllocator``, ``ReqToTokenPool`` and — through SGLang's own factory
(``registry.default_radix_cache_factory``) with ``--enable-unified-cache-external-linker``
and the ``dynamic`` backend — a ``UnifiedRadixCache`` whose linker SGLang imports by dotted
path. Its methods are the scheduler's steps: ``prefill`` (write KV, insert -> write-through
offload), ``poll_offloads`` (``check_hicache_events``), ``evict_all``, ``hit_and_load``
(match_prefix -> init_load_back -> ready_to_load_host_cache -> the forward's per-layer waits
-> finish_external_linker_loads).

KV is a deterministic function of the token prefix (``expected_kv``), so another process can
check bytes it never wrote. Used in-process by tests/integrations/sglang/test_sglang_linker.py
and as a worker process by tests/sglang_worker_proc.py.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import time
import types
from array import array
from collections.abc import Sequence
from typing import Any

import torch

PAGE = 4
SIZE = 256
LAYERS = 3


class _InertType(type):
    """Placeholder classes: any attribute is another placeholder (``scalar_types.uint4b8``)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(f"{cls.__qualname__}.{name}", cls.__dict__.get("_raises", False))
        setattr(cls, name, value)
        return value


def _placeholder(name: str, raises: bool) -> type:
    def refuse(cls: type, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{name} is a stand-in (its package is not installed here)")

    body: dict[str, Any] = {"_raises": raises}
    if raises:
        body["__new__"] = refuse
    return _InertType(name.rsplit(".", 1)[-1], (), body)


class _Inert(types.ModuleType):
    """A module whose every attribute is a placeholder class: SGLang's imports of a package
    that is not here succeed; ``calls_raise`` makes using one an error instead of a no-op."""

    calls_raise = False

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(f"{self.__name__}.{name}", self.calls_raise)
        setattr(self, name, value)
        return value


class _InertFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of ``package`` and its submodules yield ``_Inert`` modules."""

    def __init__(self, package: str, calls_raise: bool) -> None:
        self.package, self.calls_raise = package, calls_raise

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.package and not name.startswith(self.package + "."):
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _Inert(spec.name)
        module.calls_raise = self.calls_raise
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _importable(package: str) -> bool:
    try:
        if importlib.util.find_spec(package) is None:
            return False
    except ImportError:  # a finder that refuses it
        return False
    try:
        __import__(package)
        return True
    except Exception:  # e.g. a torchvision built for another torch
        for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
            del sys.modules[name]
        return False


def install_stand_ins() -> None:
    """Stand-ins for what SGLang's modules import at module level but the cache path never
    uses, where the real package is not installed (a real one is used as it is):

    - ``torchvision`` (SGLang's configs): the PyPI wheel is CUDA-linked, so CPU hosts have
      none; installed after transformers has probed for the real one.
    - ``sgl_kernel`` (SGLang's quantization and MoE layers import it when CUDA is available):
      its wheel is CUDA-built and large; calling anything of the stand-in raises.
    - ``IPython`` (``sglang.utils`` imports its notebook display helpers): calling anything
      of the stand-in raises.
    """
    if not _importable("torchvision"):
        from transformers.utils import is_torchvision_available  # type: ignore[attr-defined]

        is_torchvision_available()
        sys.meta_path.insert(0, _InertFinder("torchvision", calls_raise=False))
    for package in ("sgl_kernel", "IPython"):
        if not _importable(package):
            sys.meta_path.insert(0, _InertFinder(package, calls_raise=True))


def tokens_of(start: int, n: int) -> array[int]:
    return array("q", range(start, start + n))


def expected_kv(tokens: Sequence[int], layer: int, role: str, width: tuple[int, ...]
                ) -> torch.Tensor:
    """The KV bytes of ``tokens`` for one layer and role, shape (len, *width): each token's
    row is a function of its prefix, as real KV is."""
    rows = []
    for i in range(len(tokens)):
        seed = hashlib.sha256(repr((list(tokens[: i + 1]), layer, role)).encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(seed[:8], "little") >> 1)
        rows.append(torch.randint(0, 256, width, generator=g, dtype=torch.uint8))
    return torch.stack(rows)


def tree_core_backend(device: str) -> str | None:
    """SGLang's tree core for a cache on ``device``: its default (None), save on CUDA under a
    torch other than the one SGLang pins. The Rust tree core SGLang ships is built against that
    torch's ABI: on the GPU image's torch 2.11 it panics on a CUDA value tensor ("Unsupported
    TypeMeta in ATen"), so there the Python tree core (SGLang's own, the same calls to the
    linker) runs instead."""
    if device != "cuda":
        return None
    from importlib.metadata import requires

    pinned = [r.split("==")[1] for r in requires("sglang") or ()
              if r.replace(" ", "").startswith("torch==")]
    ours = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if pinned and ".".join(pinned[0].split(".")[:2]) == ours:
        return None
    return "python"


class SGLangCache:
    def __init__(self, target: str, shm_dir: str, *, kind: str = "mha",
                 dtype: torch.dtype = torch.bfloat16, model: str = "org/tiny-model",
                 tp_group: Any = None, extra: dict[str, Any] | None = None,
                 page_size: int = PAGE, size: int = SIZE, layers: int = LAYERS,
                 heads: int = 2, head_dim: int = 8, v_head_dim: int | None = None,
                 device: str = "cpu", kv_events: bool = False) -> None:
        """``kv_events``: SGLang's own cache records its KV events (``cache.take_events()``).
        The tree core is SGLang's default, save where ``tree_core_backend`` says otherwise."""
        install_stand_ins()
        from sglang.srt import runtime_context as rc
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import (
            MHATokenToKVPool,
            MLATokenToKVPool,
            ReqToTokenPool,
        )
        from sglang.srt.mem_cache.registry import (
            TreeCacheBuildContext,
            default_radix_cache_factory,
        )

        config = {"linker": "HicachedLinker", "linker_module_path": "hicache_sglang.linker",
                  "linker_extra_config": {"target": target, "shm_dir": shm_dir,
                                          "reconnect_interval_s": 0.2, **(extra or {})}}
        self._override = rc._CONTEXT.override_server_args(
            device=device, page_size=page_size, model_path=model,
            enable_unified_cache_external_linker=True,
            unified_cache_external_linker_backend="dynamic",
            unified_cache_external_linker_config=config)
        server_args = self._override.install()
        self.kind, self.size, self.layers = kind, size, layers
        if kind == "mha":
            # by default K and V widths differ (as in MLA-derived MHA models), to test both
            v_dim = head_dim // 2 if v_head_dim is None else v_head_dim
            self.kv = MHATokenToKVPool(size=size, page_size=page_size, dtype=dtype,
                                       head_num=heads, head_dim=head_dim, v_head_dim=v_dim,
                                       layer_num=layers, device=device,
                                       enable_memory_saver=False)
            store = self.kv.store_dtype
            self.roles = {"k": ("k_buffer", (heads, head_dim * store.itemsize)),
                          "v": ("v_buffer", (heads, v_dim * store.itemsize))}
        else:
            self.kv = MLATokenToKVPool(size=size, page_size=page_size, dtype=dtype,
                                       kv_lora_rank=16, qk_rope_head_dim=8, layer_num=layers,
                                       device=device, enable_memory_saver=False)
            store = self.kv.store_dtype
            self.roles = {"kv": ("kv_buffer", (1, 24 * store.itemsize))}
        self.store_dtype = store
        self.allocator = PagedTokenToKVPoolAllocator(size=size, page_size=page_size, dtype=dtype,
                                                     device=device, kvcache=self.kv,
                                                     need_sort=False)
        req_pool = ReqToTokenPool(size=8, max_context_len=512, device=device,
                                  enable_memory_saver=False)
        params = CacheInitParams(disable=False, req_to_token_pool=req_pool,
                                 token_to_kv_pool_allocator=self.allocator,
                                 page_size=page_size,
                                 tp_cache_group=tp_group, enable_kv_cache_events=kv_events,
                                 tree_core_backend=tree_core_backend(device))
        self.counters: list[Any] = []
        self.device = device
        forward = torch.cuda.current_stream() if device == "cuda" else None
        worker = types.SimpleNamespace(
            model_runner=types.SimpleNamespace(forward_stream=forward),
            register_hicache_layer_transfer_counter=self.counters.append)
        ctx = TreeCacheBuildContext(
            server_args=server_args, params=params, is_hybrid_swa=False, is_hybrid_ssm=False,
            enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=worker,
            model_config=None, tp_size=1, tp_rank=0, tp_group=tp_group)
        self.cache = default_radix_cache_factory(ctx)
        self.linker = self.cache.linker.cache_linker  # the HicachedLinker SGLang built

    # -- KV ---------------------------------------------------------------------------------

    def layer_rows(self, role: str, layer: int, slots: torch.Tensor) -> torch.Tensor:
        attr, _ = self.roles[role]
        rows: torch.Tensor = getattr(self.kv, attr)[layer][slots.to(self.device)]
        return rows.view(torch.uint8).cpu()

    def expected(self, tokens: Sequence[int], role: str, layer: int) -> torch.Tensor:
        _, width = self.roles[role]
        return expected_kv(tokens, layer, role, width)

    def write_kv(self, tokens: Sequence[int], slots: torch.Tensor) -> None:
        for role, (attr, _) in self.roles.items():
            for layer in range(self.layers):
                buf = getattr(self.kv, attr)[layer]
                buf.view(torch.uint8)[slots] = self.expected(tokens, role, layer).to(self.device)

    def zero_kv(self) -> None:
        for attr, _ in self.roles.values():
            for buf in getattr(self.kv, attr):
                buf.zero_()

    # -- the scheduler's steps -------------------------------------------------------------

    def prefill(self, tokens: array[int]) -> torch.Tensor:
        """Compute (write) KV for ``tokens`` and insert it: write-through offloads it."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        slots: torch.Tensor | None = self.allocator.alloc(len(tokens))
        assert slots is not None, "device pool full"
        self.write_kv(tokens, slots)
        self.cache.insert(InsertParams(key=RadixKey(tokens), value=slots))
        return slots

    def poll_offloads(self, timeout: float = 10.0) -> None:
        """Run the scheduler's event poll until every offload is committed."""
        deadline = time.monotonic() + timeout
        while True:
            self.cache.check_hicache_events()
            if not self.cache.linker.pending_offloads:
                return
            assert time.monotonic() < deadline, "offloads did not complete"
            time.sleep(0.01)

    def offload_and_evict(self, tokens: array[int]) -> int:
        """Prefill ``tokens``, let the write-through land, then evict the device copy: what
        follows can only hit the daemon. Returns the tokens evicted."""
        self.prefill(tokens)
        self.poll_offloads()
        return self.evict_all()

    def evict_all(self) -> int:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        return int(self.cache.evict(EvictParams(num_tokens=self.size)).num_tokens_evicted)

    def hit_and_load_batch(self, requests: Sequence[tuple[str, array[int]]]
                           ) -> tuple[list[int], list[str], dict[str, torch.Tensor]]:
        """Admit several requests into one batch (each ``tokens`` + one new token), as the
        scheduler does: match each, load each hit back, one layer-wise load for the batch,
        the forward's layer waits, then SGLang's verdict. Returns (external hit tokens per
        request, the rids SGLang aborted, the device slots each hit was loaded into)."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.sampling.sampling_params import SamplingParams

        reqs, hits, slots = [], [], {}
        for rid, tokens in requests:
            key = array("q", [*tokens, 7])
            req = Req(rid, "", key, SamplingParams())
            match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(key), req=req))
            req.last_node = match.last_device_node
            loaded = 0
            if match.host_hit_length:
                loaded, _ = self.cache.init_load_back(InitLoadBackParams(
                    best_match_node=match.last_host_node,
                    host_hit_length=match.host_hit_length, req=req))
                got = self.cache.linker.private_load_indices.get(rid)
                if got is not None:
                    slots[rid] = got
            reqs.append(req)
            hits.append(int(loaded))
        index = self.cache.ready_to_load_host_cache()
        self.counters[0].set_consumer(index)
        for layer in range(self.layers):
            self.kv.get_key_buffer(layer)
        failed = self.cache.finish_external_linker_loads(reqs)
        if self.device == "cuda":
            torch.cuda.current_stream().synchronize()
        return hits, [r.rid for r in failed], slots

    def match(self, tokens: array[int], rid: str = "r") -> int:
        """One scheduler loop's match of a request for ``tokens`` + one new token that is not
        admitted (it waits for memory): the external hit tokens SGLang was told."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.sampling.sampling_params import SamplingParams

        key = array("q", [*tokens, 7])
        req = Req(rid, "", key, SamplingParams())
        match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(key), req=req))
        return int(match.host_hit_length)

    def flush(self) -> None:
        """SGLang's ``/flush_cache`` (``Scheduler.flush_cache``): the tree is reset (and
        with it the linker), the device pool's slots all freed."""
        self.cache.reset()
        self.allocator.clear()

    def hit_and_load(self, tokens: array[int], rid: str = "r") -> tuple[int, list[Any],
                                                                   torch.Tensor | None]:
        """Admit a request for ``tokens`` + one new token: returns (external hit tokens, the
        requests SGLang aborted, the device slots the hit was loaded into)."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.sampling.sampling_params import SamplingParams

        key = array("q", [*tokens, 7])
        req = Req(rid, "", key, SamplingParams())
        match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(key), req=req))
        req.last_node = match.last_device_node
        if match.host_hit_length == 0:
            return 0, [], None
        loaded, _ = self.cache.init_load_back(InitLoadBackParams(
            best_match_node=match.last_host_node, host_hit_length=match.host_hit_length,
            req=req))
        slots = self.cache.linker.private_load_indices.get(rid)
        index = self.cache.ready_to_load_host_cache()
        self.counters[0].set_consumer(index)
        for layer in range(self.layers):  # the forward reads each layer through the pool
            self.kv.get_key_buffer(layer)
        failed = self.cache.finish_external_linker_loads([req])
        if self.device == "cuda":
            torch.cuda.current_stream().synchronize()  # the forward's reads were queued on it
        return int(loaded), failed, slots

    def close(self) -> None:
        self.cache.linker.close()
        self._override.restore()


def sglang_config_from_argv(argv: list[str]) -> dict[str, Any]:
    """A ``sglang.launch_server`` command line parsed by SGLang's own parser, the linker it
    names loaded and its ``linker_extra_config`` checked: that object."""
    from tests.helpers import require_module

    require_module("sglang", "sglang==0.5.23 (scripts/setup.sh --test)")
    import argparse
    import importlib
    import inspect

    install_stand_ins()
    from sglang.srt.mem_cache.unified_cache.linker_config import UnifiedCacheLinkerConfig
    from sglang.srt.mem_cache.unified_cache.unified_cache_linker import UnifiedCacheLinker
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    assert args.enable_unified_cache_external_linker is True
    assert args.unified_cache_external_linker_backend == "dynamic"
    assert not args.enable_hierarchical_cache
    cfg = UnifiedCacheLinkerConfig.from_dict(args.unified_cache_external_linker_config)
    cls = getattr(importlib.import_module(cfg.linker_module_path), cfg.linker)
    assert issubclass(cls, UnifiedCacheLinker) and not inspect.isabstract(cls)
    from hicache_sglang.config import LinkerConfig

    LinkerConfig.from_extra(cfg.linker_extra_config)
    extra: dict[str, Any] = cfg.linker_extra_config
    return extra
