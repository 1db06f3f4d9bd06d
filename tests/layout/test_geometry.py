"""Worker geometry: region pages, SSM sub-parts, wire round trip, refusals."""

from __future__ import annotations

import pytest

from kvlink.layout.geometry import (
    WorkerGeometry,
    build_worker_geometry,
    packed_base_addrs,
    remote_sub_part_slice,
)
from kvlink.layout.presets import DEEPSEEK_MLA, LLAMA3_8B, PRESETS, TINY_HYBRID, preset


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
