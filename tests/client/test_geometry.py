from __future__ import annotations

import dataclasses
import logging

import pytest

from hicache.codec import spec_from_proto, spec_to_proto
from hicache.errors import (
    CanarySourceInvalid,
    PageSizeInvalid,
    PoolSizeNotPageAligned,
    SpecInvalid,
)
from hicache.specs import (
    CanarySpec,
    DType,
    KeyFormat,
    KVGeometry,
    Layout,
    MemberSpec,
    PoolKind,
    PoolSpec,
    Role,
    check_canary_source,
    same_storage,
)
from tests.helpers import dsa, make_pool, mha, mla, opaque, spec


@pytest.mark.parametrize("page_size", [0, -1, -64])
def test_page_size_below_one_is_page_size_invalid(page_size: int) -> None:
    with pytest.raises(PageSizeInvalid) as exc:
        spec(mha(), page_size=page_size)
    assert exc.value.reason == "PAGE_SIZE_INVALID"
    assert exc.value.metadata["page_size"] == str(page_size)


def test_unaligned_pool_size_names_size_page_size_and_aligned_size() -> None:
    with pytest.raises(PoolSizeNotPageAligned) as exc:
        spec(mha(), page_size=64, size_tokens=1000)
    md = exc.value.metadata
    assert exc.value.reason == "POOL_SIZE_NOT_PAGE_ALIGNED"
    assert md["size"] == "1000" and md["page_size"] == "64"
    assert md["aligned_size"] == "960" and md["aligned_up"] == "1024"


def test_pool_smaller_than_a_page_suggests_one_page() -> None:
    with pytest.raises(PoolSizeNotPageAligned) as exc:
        spec(mha(), page_size=64, size_tokens=10)
    assert exc.value.metadata["aligned_size"] == "64"


def test_byte_budget_rounds_down_to_whole_pages_and_logs(caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    s = PoolSpec("b", mha(), 4, size_bytes=10_000)
    page_bytes = 2 * 3 * 4 * 2 * 8 * 2  # K+V * layers * tokens * heads * dim * bf16
    assert s.page_bytes == page_bytes
    with caplog.at_level(logging.INFO):
        tokens = s.resolved_size_tokens()
    assert tokens == 10_000 // page_bytes * 4
    assert "rounded down" in caplog.text


def test_budget_below_one_page_is_rejected() -> None:
    with pytest.raises(SpecInvalid):
        PoolSpec("b", mha(), 4, size_bytes=10)


def test_exactly_one_size() -> None:
    with pytest.raises(SpecInvalid):
        PoolSpec("b", mha(), 4)
    with pytest.raises(SpecInvalid):
        PoolSpec("b", mha(), 4, size_tokens=8, size_bytes=4096)


@pytest.mark.parametrize("bad", [
    dict(layer_num=0), dict(head_num=0), dict(head_dim=-1),
])
def test_mha_dimensions_must_be_positive(bad: dict[str, int]) -> None:
    fields = dict(layer_num=2, head_num=2, head_dim=8) | bad
    with pytest.raises(SpecInvalid):
        KVGeometry(PoolKind.MHA, DType.BFLOAT16, **fields)


def test_dsa_requires_uint8_and_block_multiple() -> None:
    with pytest.raises(SpecInvalid):
        KVGeometry(PoolKind.DSA_INDEXER, DType.BFLOAT16, 2, index_head_dim=16,
                   quant_block_size=8)
    with pytest.raises(SpecInvalid):
        KVGeometry(PoolKind.DSA_INDEXER, DType.UINT8, 2, index_head_dim=20, quant_block_size=8)


def test_opaque_rows_are_positive_bytes() -> None:
    with pytest.raises(SpecInvalid):
        KVGeometry(PoolKind.OPAQUE, DType.UINT8, 2)
    with pytest.raises(SpecInvalid):
        KVGeometry(PoolKind.OPAQUE, DType.UINT8, 2, row_bytes=-8)
    with pytest.raises(SpecInvalid):
        KVGeometry(PoolKind.OPAQUE, DType.BFLOAT16, 2, row_bytes=8)
    g = KVGeometry(PoolKind.OPAQUE, DType.UINT8, 3, row_bytes=40)
    assert g.page_bytes(4) == 3 * 4 * 40
    assert [(c.role, c.dtype, c.unit_shape) for c in g.components(4)] == [
        (Role.KV, DType.UINT8, (1, 40))]


def _legacy_rows(layers: int = 3, row: int = 40) -> KVGeometry:
    """How vLLM's rows were described before OPAQUE: MLA uint8, the row as the latent."""
    return KVGeometry(PoolKind.MLA, DType.UINT8, layers, kv_lora_rank=row)


@pytest.mark.parametrize("other,same", [
    (_legacy_rows(), True),
    (KVGeometry(PoolKind.MLA, DType.UINT8, 3, kv_lora_rank=32, qk_rope_head_dim=8), True),
    (_legacy_rows(row=48), False),
    (_legacy_rows(layers=4), False),
    (KVGeometry(PoolKind.MLA, DType.FLOAT8_E4M3, 3, kv_lora_rank=40), False),
    (KVGeometry(PoolKind.MHA, DType.UINT8, 3, 1, 40), False),  # K and V: two buffers
    (KVGeometry(PoolKind.DSA_INDEXER, DType.UINT8, 3, index_head_dim=32,
                quant_block_size=32), False),
])
def test_same_storage_is_equal_components_and_layers(other: KVGeometry, same: bool) -> None:
    rows = spec(opaque(), name="rows")
    assert same_storage(rows, spec(other, name="rows")) is same
    assert same_storage(spec(other, name="rows"), rows) is same
    # and never across anything else of the spec
    assert not same_storage(rows, spec(other, name="rows", size_tokens=128))
    assert not same_storage(rows, spec(other, name="rows", page_size=8))
    assert not same_storage(rows, spec(other, name="other"))
    assert not same_storage(rows, spec(other, name="rows", layout=Layout.PAGE_FIRST))
    assert not same_storage(spec(opaque(), name="rows", side_pools=(MemberSpec("i", dsa()),)),
                            spec(other, name="rows"))
    # what the keys are is not storage: a pool made before key_format serves the vLLM spec
    vllm = dataclasses.replace(spec(other, name="rows"), key_format=KeyFormat.VLLM)
    assert same_storage(rows, vllm) is same and same_storage(vllm, rows) is same


def test_a_geometrys_repr_names_row_bytes_only_where_set() -> None:
    """Engines name pools by a digest of the geometry's repr: a field added later must not
    change the repr (and every pool's name) of geometries that do not use it."""
    assert repr(mha()) == (
        "KVGeometry(kind=<PoolKind.MHA: 'MHA'>, dtype=<DType.BFLOAT16: 'BFLOAT16'>, "
        "layer_num=3, head_num=2, head_dim=8, v_head_dim=0, kv_lora_rank=0, "
        "qk_rope_head_dim=0, index_head_dim=0, quant_block_size=0)")
    assert repr(opaque(row=40)).endswith("quant_block_size=0, row_bytes=40)")


def test_an_opaque_spec_crosses_the_wire_whole() -> None:
    s = spec(opaque(row=72), name="rows", layout=Layout.PAGE_FIRST_DIRECT)
    assert spec_from_proto(spec_to_proto(s)) == s
    msg = spec_to_proto(s)
    msg.dtype = 0  # type: ignore[assignment]  # unspecified: rows are bytes
    assert spec_from_proto(msg) == s
    msg.row_bytes = 0
    with pytest.raises(SpecInvalid):
        spec_from_proto(msg)


def test_a_key_format_crosses_the_wire_and_an_unknown_one_is_refused() -> None:
    for fmt in KeyFormat:
        s = dataclasses.replace(spec(opaque(row=8), name="rows"), key_format=fmt)
        assert spec_from_proto(spec_to_proto(s)).key_format is fmt
    msg = spec_to_proto(spec(mha()))
    assert msg.key_format == 0  # DIGEST: what a client from before the field sends
    msg.key_format = 7  # type: ignore[assignment]  # a later build's
    with pytest.raises(SpecInvalid) as err:
        spec_from_proto(msg)
    assert err.value.metadata["key_format"] == "7"
    with pytest.raises(SpecInvalid):
        dataclasses.replace(spec(mha()), key_format="vllm")  # type: ignore[arg-type]


def test_pool_and_side_names_are_checked() -> None:
    with pytest.raises(SpecInvalid):
        spec(mha(), name="bad name/")
    with pytest.raises(SpecInvalid):
        MemberSpec("kv", dsa())
    with pytest.raises(SpecInvalid):
        spec(mla(), side_pools=(MemberSpec("a", dsa()), MemberSpec("a", dsa())))


# SGLang's host buffer shapes, per kind and layout (MHA without the stacked leading 2).
@pytest.mark.parametrize("layout,expected", [
    (Layout.LAYER_FIRST, (3, 64, 2, 8)),
    (Layout.PAGE_FIRST, (64, 3, 2, 8)),
    (Layout.PAGE_FIRST_DIRECT, (16, 3, 4, 2, 8)),
])
def test_mha_host_shapes_match_sglang(layout: Layout, expected: tuple[int, ...]) -> None:
    pool = make_pool(spec(mha(), layout=layout))
    try:
        assert tuple(pool.buffer("kv", Role.K).shape) == expected
        assert tuple(pool.buffer("kv", Role.V).shape) == expected
        # symmetric K/V are laid out back to back: SGLang's (2, ...) buffer
        k, v = pool.components
        assert v.offset == k.offset + k.nbytes
    finally:
        pool.close()


@pytest.mark.parametrize("layout,expected", [
    (Layout.LAYER_FIRST, (3, 64, 1, 24)),
    (Layout.PAGE_FIRST, (64, 3, 1, 24)),
    (Layout.PAGE_FIRST_DIRECT, (16, 3, 4, 1, 24)),
])
def test_mla_host_shapes_match_sglang(layout: Layout, expected: tuple[int, ...]) -> None:
    pool = make_pool(spec(mla(), layout=layout))
    try:
        assert tuple(pool.buffer("kv", Role.KV).shape) == expected
    finally:
        pool.close()


@pytest.mark.parametrize("layout,expected", [
    (Layout.LAYER_FIRST, (3, 16, 4 * 24)),
    (Layout.PAGE_FIRST, (16, 3, 1, 4 * 24)),
    (Layout.PAGE_FIRST_DIRECT, (16, 3, 1, 4 * 24)),
])
def test_dsa_indexer_host_shapes_match_sglang(layout: Layout, expected: tuple[int, ...]) -> None:
    # index_head_dim 16 + 16/8 fp32 scales = 24 bytes per token, 4 tokens a page
    pool = make_pool(spec(mla(), layout=layout, side_pools=(MemberSpec("indexer", dsa()),)))
    try:
        assert tuple(pool.buffer("indexer", Role.INDEX).shape) == expected
    finally:
        pool.close()


def test_asymmetric_v_head_dim() -> None:
    pool = make_pool(spec(mha(v_dim=4)))
    try:
        assert pool.buffer("kv", Role.V).shape[-1] == 4
        assert pool.buffer("kv", Role.K).shape[-1] == 8
    finally:
        pool.close()


def test_logical_pool_holds_no_bytes_but_allocates_pages() -> None:
    pool = make_pool(spec(KVGeometry(PoolKind.LOGICAL), page_size=16, size_tokens=256))
    try:
        assert pool.nbytes == 0 and pool.components == []
        idx = pool.alloc(32)
        assert idx.tolist() == list(range(32))
    finally:
        pool.close()


@pytest.mark.parametrize("dtype", list(DType))
def test_dtype_round_trips_through_torch(dtype: DType) -> None:
    assert DType.from_torch(dtype.torch_dtype) is dtype


@pytest.mark.parametrize("bpt,read", [(0, 16), (24, 16), (32, 0), (32, 8), (32, 48), (-16, 16)])
def test_canary_source_rules(bpt: int, read: int) -> None:
    with pytest.raises(CanarySourceInvalid) as exc:
        check_canary_source(bpt, read)
    assert exc.value.metadata == {"bytes_per_token": str(bpt), "read_bytes": str(read)}


def test_canary_rules_are_applied_to_pool_spec() -> None:
    # MHA with head_dim 3 fp16: 6 bytes per head, 12 per token: not a multiple of 16
    with pytest.raises(CanarySourceInvalid):
        spec(KVGeometry(PoolKind.MHA, DType.FLOAT16, 1, 2, 3), canary=CanarySpec(16))
    spec(mha(), canary=CanarySpec(32))
