"""Worker geometry: region pages, SSM sub-parts, wire round trip, refusals."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvlink.layout.geometry import (
    WorkerGeometry,
    build_worker_geometry,
    packed_base_addrs,
    remote_sub_part_slice,
)
from kvlink.layout.presets import (
    DEEPSEEK_MLA,
    LLAMA3_8B,
    PRESETS,
    TINY_HYBRID,
    TINY_HYBRID_SD,
    preset,
)
from kvlink.layout.spec import GDN, FullAttention, Mamba2, ModelSpec


def geometry(model=LLAMA3_8B, tp=1, rank=0, bs=16, kbs=16, blocks=10):  # type: ignore[no-untyped-def]
    return build_worker_geometry(model, tp, rank, bs, kbs, blocks,
                                 packed_base_addrs(model, tp, bs, kbs, blocks, 1 << 20))


def test_llama_attention_pages() -> None:
    g = geometry(tp=2, bs=32, kbs=16)
    assert len(g.regions) == 32 and g.physical_per_logical == 2
    region = g.regions[0]
    # [kernel_blocks, 4 heads, 16 tokens, 2*128] bf16
    assert (region.kind, region.units, region.token_bytes) == ("attention", 4, 512)
    assert region.page_len == region.page_stride == 4 * 16 * 512
    assert region.unit_bytes == 16 * 512 and region.num_pages == 20


def test_mla_pages_are_whole_latent_rows() -> None:
    g = geometry(DEEPSEEK_MLA, tp=4, rank=3)
    region = g.regions[0]
    assert (region.kind, region.units, region.page_len) == ("mla", 1, 16 * 576 * 2)


def test_ssm_sub_parts_are_conv_then_state() -> None:
    g = geometry(TINY_HYBRID, tp=2, bs=16, kbs=8)
    ssm = g.ssm_regions[0]
    assert ssm.num_pages == 10  # logical blocks
    names = [p.name for p in ssm.sub_parts]
    assert names == ["conv_x", "conv_B", "conv_C", "ssm_state"]
    # per rank, float32: x = 4 heads*16*3 rows, B = C = 1 group*16*3, state = 4 heads*16*16
    lengths = [p.length for p in ssm.sub_parts]
    assert lengths == [4 * 16 * 3 * 4, 16 * 3 * 4, 16 * 3 * 4, 4 * 16 * 16 * 4]
    offsets = [p.offset for p in ssm.sub_parts]
    assert offsets == [0, lengths[0], lengths[0] + lengths[1], sum(lengths[:3])]
    assert ssm.page_len == sum(lengths)


def test_remote_sub_part_slice_finds_a_head_slice_on_a_wider_peer() -> None:
    wide = geometry(TINY_HYBRID, tp=1).ssm_regions[0]
    conv_b = wide.sub_parts[1]
    # a TP-2 rank 1 wants group 1 of conv_B: the second half of P's conv_B
    assert remote_sub_part_slice(conv_b, 1, 1) == (conv_b.offset + conv_b.length // 2, conv_b.length // 2)
    with pytest.raises(ValueError, match="outside part"):
        remote_sub_part_slice(conv_b, 2, 1)


def test_wire_round_trip_rebuilds_an_equal_geometry() -> None:
    for model in PRESETS.values():
        tp = 3 if model.num_kv_heads == 3 else 2
        g = geometry(model, tp=tp, rank=1, bs=32, kbs=16, blocks=7)
        assert WorkerGeometry.from_wire(g.to_wire()) == g


def test_wire_rejects_tampering() -> None:
    wire = geometry().to_wire()
    with pytest.raises(ValueError, match="must be integers"):
        WorkerGeometry.from_wire({**wire, "num_blocks": "10"})
    with pytest.raises(ValueError, match="compat_hash"):
        WorkerGeometry.from_wire({**wire, "compat_hash": "0" * 16})
    with pytest.raises(ValueError, match="version"):
        WorkerGeometry.from_wire({**wire, "version": 99})
    with pytest.raises(ValueError, match="missing or bad field"):
        WorkerGeometry.from_wire({k: v for k, v in wire.items() if k != "base_addrs"})


def test_overlapping_tensors_are_refused() -> None:
    bases = packed_base_addrs(LLAMA3_8B, 1, 16, 16, 10, 0)
    bases[1] = bases[0] + 16
    with pytest.raises(ValueError, match="overlaps"):
        build_worker_geometry(LLAMA3_8B, 1, 0, 16, 16, 10, bases)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="base addresses"):
        build_worker_geometry(LLAMA3_8B, 1, 0, 16, 16, 10, [0])
    with pytest.raises(ValueError, match="not a multiple"):
        geometry(bs=16, kbs=32)
    with pytest.raises(ValueError, match="tp_rank"):
        geometry(tp=2, rank=2)
    with pytest.raises(ValueError, match="unknown preset"):
        preset("nope")


@pytest.mark.parametrize("tp", [1, 2])
def test_sd_conv_parts_address_vllms_row_first_state(tp: int) -> None:
    """SD: a rank's conv state is `[rows, x_r | B_r | C_r]`; every part unit is found where that array puts it."""
    model = TINY_HYBRID_SD
    mamba = model.groups[1]
    assert isinstance(mamba, Mamba2)
    rows, dt = mamba.conv_kernel - 1, 4
    x_ch, bc_ch = mamba.num_heads * mamba.head_dim, mamba.n_groups * mamba.d_state
    # The logical state, global channels x | B | C, value = row * 1000 + global channel.
    logical = np.arange(rows)[:, None] * 1000 + np.arange(x_ch + 2 * bc_ch)[None, :]
    for rank in range(tp):
        xs = slice(rank * x_ch // tp, (rank + 1) * x_ch // tp)
        bs = slice(x_ch + rank * bc_ch // tp, x_ch + (rank + 1) * bc_ch // tp)
        cs = slice(x_ch + bc_ch + rank * bc_ch // tp, x_ch + bc_ch + (rank + 1) * bc_ch // tp)
        rank_state = np.concatenate([logical[:, xs], logical[:, bs], logical[:, cs]], axis=1)  # vLLM's SD array
        page = rank_state.astype(np.float32).tobytes()
        ssm = geometry(model, tp=tp, rank=rank).ssm_regions[0]
        assert [p.name for p in ssm.sub_parts[:4]] == ["conv_x.0", "conv_B.0", "conv_C.0", "conv_x.1"]
        assert ssm.sub_parts[-1].offset == len(page)  # the SSM state follows the conv rows
        for sub in ssm.sub_parts[:-1]:
            name, row = sub.name.rsplit(".", 1)
            base = {"conv_x": 0, "conv_B": x_ch, "conv_C": x_ch + bc_ch}[name]
            per_unit = sub.unit_bytes // dt
            first = sub.part.first_unit(rank, tp)
            for slot in range(sub.length // sub.unit_bytes):
                offset, length = remote_sub_part_slice(sub, slot, 1)
                got = np.frombuffer(page[offset : offset + length], dtype=np.float32)
                channels = base + (first + slot) * per_unit + np.arange(per_unit)
                np.testing.assert_array_equal(got, int(row) * 1000 + channels)


def test_sd_and_ds_specs_differ_and_round_trip() -> None:
    sd = TINY_HYBRID_SD
    assert sd.compat_hash() != TINY_HYBRID.compat_hash()
    assert ModelSpec.from_dict(sd.to_dict()) == sd
    with pytest.raises(ValueError, match="conv_layout must be one of"):
        ModelSpec.from_dict({**sd.to_dict(), "groups": [{"kind": "full"}, {**sd.to_dict()["groups"][1],
                                                                            "conv_layout": "XY"}]})
    with pytest.raises(ValueError, match="SD conv layout: at most"):
        Mamba2(num_heads=2, head_dim=2, n_groups=1, d_state=2, conv_kernel=1000, conv_layout="SD")


def test_an_fp32_state_next_to_a_bf16_conv_state_is_counted_in_its_own_bytes() -> None:
    """vLLM's `--mamba-ssm-cache-dtype float32` on a bf16 model: conv parts 2 bytes an element, state 4."""
    gdn = GDN(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8, conv_kernel=4, conv_layout="SD",
              state_dtype="float32")
    model = ModelSpec("q", 2, 8, "bfloat16", (FullAttention(), gdn), (0, 1))
    for tp in (1, 2):
        ssm = geometry(model, tp=tp).ssm_regions[0]
        conv = [p for p in ssm.sub_parts if p.name != "ssm_state"]
        state = ssm.sub_parts[-1]
        conv_channels = (2 * 2 * 8 + 4 * 8) // tp
        assert sum(p.length for p in conv) == 3 * conv_channels * 2
        assert (state.offset, state.length, state.unit_bytes) == (3 * conv_channels * 2, 4 // tp * 64 * 4, 64 * 4)
        assert ssm.page_len == state.offset + state.length
    with pytest.raises(ValueError, match="state_dtype must be"):
        replace(gdn, state_dtype="fp8_e4m3")
