"""The vLLM spec's settings and pool names, without vLLM: ``kv_connector_extra_config`` checked
(vLLM's own keys passed over, anything else refused with a bounded ``SPEC_INVALID``), and the
pools a vLLM engine's blocks go to (which engines share them, which never do)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache.errors import SpecInvalid
from hicache.specs import PoolSpec
from hicache_sglang.namespace import Shard
from hicache_sglang.namespace import pool_name as sglang_pool_name
from hicache_vllm.config import VLLM_KEYS, SpecConfig
from hicache_vllm.namespace import FORMAT_TAG, Plan


def refused(extra: Any) -> SpecInvalid:
    with pytest.raises(SpecInvalid) as info:
        SpecConfig.from_extra(extra)
    err = info.value
    assert err.reason == "SPEC_INVALID"
    assert all(len(str(v)) <= 400 for v in err.metadata.values())
    assert len(str(err)) <= 2000
    return err


def test_defaults_and_vllms_own_keys_pass_over() -> None:
    extra = {"spec_name": "HicachedOffloadingSpec", "spec_module_path": "hicache_vllm.spec",
             "block_size": 64, "offload_prompt_only": True, "target": "unix:/run/h.sock"}
    c = SpecConfig.from_extra(extra)
    assert c.target == "unix:/run/h.sock"
    assert (c.lookup_timeout_s, c.lookup_hold_ms, c.pool_prefix) == (0.2, 30000, "vllm")
    assert SpecConfig.from_extra(None).target  # the default address every client uses
    assert "spec_module_path" in VLLM_KEYS


@pytest.mark.parametrize("extra, field", [
    ({"targte": "unix:/x"}, "targte"),
    ({"lookup_timeout_s": 0}, "lookup_timeout_s"),
    ({"lookup_timeout_s": float("nan")}, "lookup_timeout_s"),
    ({"rpc_timeout_s": "5"}, "rpc_timeout_s"),
    ({"down_after_s": 601}, "down_after_s"),
    ({"lookup_hold_ms": 50}, "lookup_hold_ms"),
    ({"lookup_hold_ms": True}, "lookup_hold_ms"),
    ({"staging_blocks": 0}, "staging_blocks"),
    ({"pool_size_tokens": -1}, "pool_size_tokens"),
    ({"pool_size_tokens": 1024, "pool_size_bytes": 1 << 20}, "pool_size_bytes"),
    ({"pool_size_ratio": 0}, "pool_size_ratio"),
    ({"pool_size_ratio": "4"}, "pool_size_ratio"),
    ({"poll_us": 10**6}, "poll_us"),
    ({"pool_prefix": "-x"}, "pool_prefix"),
    ({"pool_prefix": "vllm/../x"}, "pool_prefix"),
    ({"pool_prefix": "é"}, "pool_prefix"),
    ({"pool_prefix": "p" * 33}, "pool_prefix"),
    ({"namespace": 7}, "namespace"),
    ({"target": ""}, "target"),
    ({"canonical_layout": True}, "canonical_layout"),
    ({"cuda_sharing": "auto"}, "cuda_sharing"),
    ({"cuda_sharing": "ipc"}, "cuda_sharing"),
    ({"cuda_sharing": 1}, "cuda_sharing"),
])
def test_bad_or_unknown_settings_are_refused_naming_the_field(extra: dict[str, Any],
                                                              field: str) -> None:
    err = refused(extra)
    assert field in str(err)
    assert err.metadata.get("field", err.metadata.get("unknown")) == field


def test_a_non_object_and_a_flood_of_unknown_keys_get_bounded_errors() -> None:
    refused(["target", "unix:/x"])
    refused("target=unix:/x")
    err = refused({f"k{i}" * 50: i for i in range(10_000)})
    assert len(err.metadata["unknown"]) <= 400


# -- pools -------------------------------------------------------------------------------------


def offloading_config(model: str = "/models/Llama-3.1-8B", *, tp: int = 1, replicated: bool = False,
                      groups: int = 1, layers: int = 32, layer_bytes: int = 2 * 8 * 128 * 2 * 16,
                      block: int = 16, bpc: int = 1, pp: int = 1, dp_index: int = 0,
                      dtype: str = "bfloat16") -> SimpleNamespace:
    """What ``Plan.from_config`` reads of vLLM's ``OffloadingConfig`` (names as in 0.33 and
    0.34: a group's ``tokens_per_block`` is one KV block's, ``blocks_per_chunk`` of them make
    an offloaded block; ``worker_kv_bytes_per_block`` one KV block's bytes)."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    group = SimpleNamespace(layer_names=names, tokens_per_block=block)
    return SimpleNamespace(
        groups=[group] * groups, cache=SimpleNamespace(blocks_per_chunk=bpc),
        worker_kv_bytes_per_block=layer_bytes * layers, replicated_layout=replicated,
        model=SimpleNamespace(name=model, dtype=dtype), kv_cache_layout="NHD",
        parallel=SimpleNamespace(pp_size=pp, pcp_size=1, dcp_size=1, world_size=tp * pp,
                                 data_parallel_index=dp_index))


def plan(cfg: SimpleNamespace, **spec: Any) -> Plan:
    return Plan.from_config(cfg, SpecConfig(**spec))


def test_mha_ranks_get_a_pool_each_and_mla_one_for_all() -> None:
    mha = plan(offloading_config(tp=2))
    assert len(set(mha.pool_names)) == 2 and mha.writes(0) and mha.writes(1)
    assert [n.rsplit("-", 1)[1] for n in mha.pool_names] == ["rank0of2", "rank1of2"]
    mla = plan(offloading_config(tp=2, replicated=True, layer_bytes=576 * 2 * 16))
    assert len(mla.pool_names) == 1 and mla.pool_names[0].endswith("-rankall")
    assert mla.writes(0) and not mla.writes(1)
    for p in (mha, mla):
        for name in p.pool_names:
            assert name.startswith("vllm-Llama-3.1-8B-")
            PoolSpec(name, p.geometry(), p.page_tokens, size_tokens=p.page_tokens)  # valid


def test_pool_names_are_what_they_were() -> None:
    """Names persist in the daemon's state: the naming rule the integrations share
    (``hicache_client.pool_names``) gives the names vLLM engines had before it."""
    assert plan(offloading_config(tp=2)).pool_names == [
        "vllm-Llama-3.1-8B-a43e54c386c5-rank0of2", "vllm-Llama-3.1-8B-111b525b72c8-rank1of2"]
    assert plan(offloading_config(tp=2, replicated=True, layer_bytes=576 * 2 * 16)
                ).pool_names == ["vllm-Llama-3.1-8B-d1d44032fcca-rankall"]


def test_a_page_is_one_offloaded_block_of_every_layer() -> None:
    p = plan(offloading_config(layers=4, layer_bytes=4096, block=16, bpc=4))
    assert (p.page_tokens, p.block_tokens, p.row_bytes, p.layers) == (64, 16, 256, 4)
    spec = p.pool_spec(0, size_tokens=1000)
    assert spec.page_size == 64 and spec.size_tokens == 960  # whole pages
    assert spec.page_bytes == 4 * 4096 * 4  # a page: 4 blocks of 4 layers


@pytest.mark.parametrize("change", [
    {"model": "/models/Llama-3.1-70B"}, {"dtype": "float16"}, {"layers": 16},
    {"layer_bytes": 4096}, {"block": 32}, {"bpc": 2}, {"tp": 4},
])
def test_pools_differ_whenever_the_bytes_could(change: dict[str, Any]) -> None:
    assert set(plan(offloading_config(**change)).pool_names).isdisjoint(
        plan(offloading_config()).pool_names)


def test_engines_that_can_share_do_and_a_namespace_separates_them() -> None:
    base = plan(offloading_config()).pool_names
    assert plan(offloading_config(dp_index=3)).pool_names == base  # data-parallel engines share
    assert plan(offloading_config(), namespace="tenant-b").pool_names != base
    assert plan(offloading_config(), pool_prefix="vllm2").pool_names[0].startswith("vllm2-")


def test_never_the_pool_sglang_uses_for_the_same_model() -> None:
    p = plan(offloading_config(), pool_prefix="sgl")
    sgl = sglang_pool_name("sgl", p.model, p.geometry(), p.page_tokens, Shard())
    assert sgl not in p.pool_names
    assert FORMAT_TAG not in sgl


@pytest.mark.parametrize("change, what", [
    ({"groups": 2}, "groups"), ({"pp": 2}, "pp"), ({"layer_bytes": 4097}, "bytes_per_block"),
])
def test_what_is_not_served_is_refused_at_start(change: dict[str, Any], what: str) -> None:
    with pytest.raises(SpecInvalid) as info:
        plan(offloading_config(**change))
    assert what in info.value.metadata


@given(st.text(max_size=300))
def test_any_model_name_gives_valid_pool_names(model: str) -> None:
    p = plan(offloading_config(model=model, tp=3))
    for name in p.pool_names:
        PoolSpec(name, p.geometry(), p.page_tokens, size_tokens=p.page_tokens)
    assert len(set(p.pool_names)) == 3
