"""Both engine integrations' settings share one base (``hicache_client.engine_config``): the
same fields are checked the same way in SGLang's ``linker_extra_config`` and vLLM's
``kv_connector_extra_config``, each error naming the field in its own object, bounded in size
whatever the object holds."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from hicache.errors import SpecInvalid
from hicache_client.engine_config import EngineConfig
from hicache_sglang.config import LinkerConfig
from hicache_vllm.config import SpecConfig

CONFIGS = [LinkerConfig, SpecConfig]

BAD: list[tuple[str, Any]] = [
    ("target", ""), ("target", 5), ("lookup_timeout_s", 0), ("lookup_timeout_s", float("nan")),
    ("rpc_timeout_s", 601), ("reconnect_interval_s", True), ("down_after_s", "1"),
    ("lookup_hold_ms", -1), ("pool_size_tokens", 1.5), ("pool_size_bytes", -2),
    ("pool_size_ratio", 0), ("pool_size_ratio", float("inf")), ("lease_ms", None),
    ("poll_us", 100_001), ("pool_prefix", ""), ("pool_prefix", "-x"),
    ("pool_prefix", "a" * 33), ("pool_prefix", "sgl/../x"), ("namespace", 3),
    ("shm_dir", None), ("worker_id", ["w"]),
]


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_both_integrations_have_every_shared_field(cls: type[EngineConfig]) -> None:
    shared = {f.name for f in dataclasses.fields(EngineConfig)}
    assert shared <= {f.name for f in dataclasses.fields(cls)}
    assert issubclass(cls, EngineConfig)


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name,value", BAD, ids=lambda x: repr(x)[:20])
def test_a_bad_shared_field_is_refused_alike_naming_it_in_its_object(
        cls: type[EngineConfig], name: str, value: Any) -> None:
    with pytest.raises(SpecInvalid) as e:
        cls.from_extra({name: value})
    assert e.value.metadata["field"] == name
    assert f": {cls.SECTION}.{name} must be " in str(e.value)


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_both_sizes_at_once_are_refused(cls: type[EngineConfig]) -> None:
    with pytest.raises(SpecInvalid) as e:
        cls.from_extra({"pool_size_tokens": 64, "pool_size_bytes": 1 << 20})
    assert e.value.metadata["field"] == "pool_size_bytes"


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_a_flood_of_unknown_keys_or_a_huge_value_gets_a_bounded_error(
        cls: type[EngineConfig]) -> None:
    with pytest.raises(SpecInvalid) as e:
        cls.from_extra({f"k{i}" * 50: i for i in range(10_000)})
    assert len(str(e.value)) < 4096 and e.value.metadata["count"] == "10000"
    with pytest.raises(SpecInvalid) as e:
        cls.from_extra({"target": "", "namespace": "x" * 1_000_000})
    with pytest.raises(SpecInvalid) as e:
        cls.from_extra({"namespace": ["x" * 1_000_000]})
    assert len(str(e.value)) < 1024 and len(e.value.metadata["value"]) <= 200
    with pytest.raises(SpecInvalid):
        cls.from_extra(["not", "an", "object"])


def test_each_keeps_its_own_defaults_and_fields() -> None:
    assert LinkerConfig().pool_prefix == "sgl" and SpecConfig().pool_prefix == "vllm"
    assert LinkerConfig().lookup_hold_ms == 5000 and SpecConfig().lookup_hold_ms == 30000
    assert LinkerConfig.from_extra({"layer_events": 4}).layer_events == 4
    with pytest.raises(SpecInvalid):
        SpecConfig.from_extra({"layer_events": 4})  # the linker's, not the spec's
    with pytest.raises(SpecInvalid):
        LinkerConfig.from_extra({"staging_blocks": 4})
    assert SpecConfig.from_extra({"block_size": 64, "spec_name": "x"}) == SpecConfig()
    with pytest.raises(SpecInvalid):
        LinkerConfig.from_extra({"block_size": 64})  # vLLM's key means nothing to SGLang


def test_pool_names_are_what_they_were() -> None:
    """Names persist in the daemon's state: a restarted engine finds its pool by name, so one
    naming rule (``hicache_client.pool_names``) gives both integrations exactly the names they
    had before they shared it (SGLang's here)."""
    from hicache.specs import DType, KVGeometry, PoolKind
    from hicache_sglang.namespace import Shard, pool_name

    g = KVGeometry(PoolKind.MHA, DType.BFLOAT16, layer_num=32, head_num=8, head_dim=128)
    assert pool_name("sgl", "meta-llama/Meta-Llama-3-8B", g, 64, Shard(1, 2)) == (
        "sgl-Meta-Llama-3-8B-88c33d80fee5-tp1of2-cp0-pp0")
    assert pool_name("sgl", "/models/x//", g, 16, Shard(0, 8, replicated=True),
                     revision="r1", namespace="ns", format_tag="ft") == (
        "sgl-x-2b98b3a64760-tpall-cp0-pp0")
    assert pool_name("sgl", "///", g, 16, Shard()) == "sgl-model-a45dbb480a88-tp0of1-cp0-pp0"
    # (vLLM's: tests/integrations/vllm/test_vllm_config.py, where its engine config is made)
