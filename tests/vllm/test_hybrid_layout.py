"""vLLM's Mamba2 groups in kvlink's terms: conv-state layout and TP sharding read off one rank's shapes."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from kvlink.integrations.vllm.layout import GroupInfo, UnsupportedVllmLayout, model_spec
from kvlink.layout.spec import GDN, Mamba2
from kvlink.layout.tensors import ssm_page_elems

# The tiny GraniteMoeHybrid: 4 Mamba2 heads of 64, B/C groups of state 16, conv kernel 4.
HEADS, HEAD_DIM, D_STATE, ROWS = 4, 64, 16, 3


def mamba(tp: int, groups_on_rank: int, layout: str = "DS") -> GroupInfo:
    conv_dim = HEADS // tp * HEAD_DIM + 2 * groups_on_rank * D_STATE
    page = (conv_dim * ROWS + HEADS // tp * HEAD_DIM * D_STATE) * 4
    return GroupInfo("mamba2", ("model.layers.0.mixer",), "float32",
                     conv_shape=(conv_dim, ROWS) if layout == "DS" else (ROWS, conv_dim),
                     state_shape=(HEADS // tp, HEAD_DIM, D_STATE), page_bytes=page, page_stride=65536,
                     conv_layout=layout)


def attention(tp: int) -> GroupInfo:
    return GroupInfo("attention", ("model.layers.1.self_attn.attn",), "float32", num_kv_heads=2 // tp,
                     head_dim=32, block_size=128)


def mamba_of(tp: int, groups_on_rank: int, layout: str = "DS", config_groups: int | None = None) -> Mamba2:
    spec = model_spec("m", [mamba(tp, groups_on_rank, layout), attention(tp)], 2, tp_size=tp,
                      mamba_n_groups=config_groups).groups[0]
    assert isinstance(spec, Mamba2)
    return spec


@pytest.mark.parametrize("layout", ["DS", "SD"])
def test_both_conv_layouts_give_the_same_model_but_the_layout(layout: str) -> None:
    spec = mamba_of(1, 2, layout)
    assert (spec.num_heads, spec.head_dim, spec.n_groups, spec.d_state, spec.conv_kernel) == (4, 64, 2, 16, 4)
    assert spec.conv_layout == layout


@pytest.mark.parametrize("layout", ["DS", "SD"])
def test_tp2_shapes_give_the_whole_model(layout: str) -> None:
    """What each TP 2 rank holds describes the same model as TP 1 does, so the two can pair."""
    assert mamba_of(2, 1, layout, config_groups=2) == mamba_of(1, 2, layout)
    assert mamba_of(2, 1, layout, config_groups=1) == replace(mamba_of(1, 1, layout), n_groups=1)


def test_groups_split_over_ranks_are_found_without_the_config() -> None:
    assert mamba_of(2, 2, config_groups=None).n_groups == 4  # 2 per rank is unambiguous


def test_one_group_per_rank_needs_the_config_to_tell_split_from_replicated() -> None:
    with pytest.raises(UnsupportedVllmLayout, match="names neither"):
        mamba_of(2, 1, config_groups=None)


def test_a_config_that_disagrees_with_the_shapes_is_refused() -> None:
    with pytest.raises(UnsupportedVllmLayout, match="but the model has 4"):
        mamba_of(2, 1, config_groups=4)


def test_a_page_of_another_size_is_refused() -> None:
    group = replace(mamba(2, 1), page_bytes=mamba(2, 1).page_bytes + 4)
    with pytest.raises(UnsupportedVllmLayout, match="holds"):
        model_spec("m", [group, attention(2)], 2, tp_size=2, mamba_n_groups=2)
    good = mamba_of(2, 1, config_groups=2)
    assert ssm_page_elems(good, 2) * 4 == mamba(2, 1).page_bytes


def test_an_unknown_conv_layout_is_refused() -> None:
    with pytest.raises(UnsupportedVllmLayout, match="conv state layout 'XY'"):
        model_spec("m", [replace(mamba(1, 2), conv_layout="XY"), attention(1)], 2)


def gdn(tp: int, layout: str = "SD", dtype: str = "bfloat16") -> GroupInfo:
    """The tiny Qwen3-Next's GDN group: 1 key head, 2 value heads, head dims 128, conv kernel 4."""
    k_heads, v_heads, dim = 2 // tp if tp <= 2 else 1, 4 // tp, 128
    conv_dim = 2 * k_heads * dim + v_heads * dim
    page = (conv_dim * ROWS + v_heads * dim * dim) * 2
    return GroupInfo("gdn", ("model.layers.0.linear_attn",), dtype,
                     conv_shape=(conv_dim, ROWS) if layout == "DS" else (ROWS, conv_dim),
                     state_shape=(v_heads, dim, dim), page_bytes=page, page_stride=page, conv_layout=layout)


def bf16_attention(tp: int) -> GroupInfo:
    return replace(attention(tp), dtype="bfloat16")


@pytest.mark.parametrize("layout", ["DS", "SD"])
@pytest.mark.parametrize("tp", [1, 2])
def test_gdn_dims_are_read_off_the_conv_and_state_shapes(layout: str, tp: int) -> None:
    spec = model_spec("q", [gdn(tp, layout), bf16_attention(tp)], 2, tp_size=tp).groups[0]
    assert spec == GDN(num_k_heads=2, num_v_heads=4, head_k_dim=128, head_v_dim=128, conv_kernel=4,
                       conv_layout=layout)


def test_a_gdn_page_with_an_fp32_state_next_to_a_bf16_conv_state() -> None:
    """vLLM's default for Qwen3-Next: the conv state in the model's bf16, the recurrent state fp32."""
    group = gdn(1)
    conv_bytes = ROWS * (2 * 2 * 128 + 4 * 128) * 2
    mixed = replace(group, state_dtype="float32", page_bytes=conv_bytes + 4 * 128 * 128 * 4)
    spec = model_spec("q", [mixed, bf16_attention(1)], 2).groups[0]
    assert isinstance(spec, GDN) and spec.state_dtype == "float32"
    with pytest.raises(UnsupportedVllmLayout, match=r"page of .* holds"):  # the fp32 state not counted
        model_spec("q", [replace(mixed, page_bytes=group.page_bytes), bf16_attention(1)], 2)
    with pytest.raises(UnsupportedVllmLayout, match="SSM state dtype int8"):
        model_spec("q", [replace(mixed, state_dtype="int8"), bf16_attention(1)], 2)


def test_a_gdn_conv_state_that_does_not_split_is_refused() -> None:
    odd = replace(gdn(1), conv_shape=(ROWS, 2 * 2 * 128 + 4 * 128 + 64))
    with pytest.raises(UnsupportedVllmLayout, match=re.escape("does not split into Q | K")):
        model_spec("q", [odd, bf16_attention(1)], 2)
