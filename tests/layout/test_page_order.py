"""Page orders: segments tile a head's unit exactly and agree with `element_index`; refusals;
the geometry carries its order over the wire."""

from __future__ import annotations

import numpy as np
import pytest

from kvlink.layout.geometry import WorkerGeometry, build_worker_geometry, packed_base_addrs
from kvlink.layout.page_order import (
    PAGE_ORDERS,
    Segment,
    check_page_order,
    element_index,
    min_chunk_tokens,
    unit_segments,
)
from kvlink.layout.presets import DEEPSEEK_MLA, TINY_HYBRID
from kvlink.layout.spec import FullAttention, ModelSpec

SHAPES = [("token_major", n, d, e) for n in (1, 3, 32) for d in (1, 5, 32) for e in (2, 4)]
SHAPES += [("vllm_cpu_vec", n, d, e) for n in (1, 3, 32, 64) for d in (1, 5, 32) for e in (2, 4)]
SHAPES += [("vllm_cpu_amx", n, d, 2) for n in (32, 64, 128) for d in (32, 64, 96)]
# vLLM's vec16 kernel (vec order; head sizes and blocks that are not multiples of 32) and fp8
# caches (1-byte elements in the vec and amx orders)
SHAPES += [("vllm_cpu_vec", n, d, e) for n in (16, 48) for d in (80, 112) for e in (1, 4)]
SHAPES += [("vllm_cpu_vec", 32, 64, 1), ("vllm_cpu_amx", 32, 64, 1), ("vllm_cpu_amx", 128, 32, 1)]


def _element_bytes(order: str, n_tokens: int, head_dim: int, e: int) -> np.ndarray:
    """Byte offset in the unit of every (token, logical row byte), row = K then V."""
    row = np.arange(2 * head_dim * e)
    elem = row // e
    index = element_index(order, n_tokens, head_dim, (elem // head_dim)[None, :],
                          np.arange(n_tokens)[:, None], (elem % head_dim)[None, :])
    return index * e + (row % e)[None, :]


@pytest.mark.parametrize(("order", "n_tokens", "head_dim", "e"), SHAPES)
def test_segments_tile_the_unit_and_agree_with_element_index(order: str, n_tokens: int, head_dim: int,
                                                             e: int) -> None:
    unit = n_tokens * 2 * head_dim * e
    by_index = _element_bytes(order, n_tokens, head_dim, e)
    # element_index is a bijection onto the unit
    assert sorted(by_index.reshape(-1).tolist()) == list(range(unit))
    owner = np.full(unit, -1)  # token stored at each byte, according to the segments
    for seg in unit_segments(order, n_tokens, head_dim, e):
        assert n_tokens % seg.granule_tokens == 0
        for k in range(n_tokens // seg.granule_tokens):
            lo = seg.offset_bytes + k * seg.granule_bytes
            assert (owner[lo:lo + seg.granule_bytes] == -1).all(), "segments overlap"
            owner[lo:lo + seg.granule_bytes] = -2 - k  # granule k of this segment
            granule_tokens = range(k * seg.granule_tokens, (k + 1) * seg.granule_tokens)
            # every byte of the granule belongs to one of its tokens by element_index
            tokens_at = np.nonzero(np.isin(by_index, np.arange(lo, lo + seg.granule_bytes)))[0]
            assert set(tokens_at.tolist()) <= set(granule_tokens)
    assert (owner != -1).all(), "segments leave a gap"
    assert min_chunk_tokens(order) % max(s.granule_tokens for s in unit_segments(order, n_tokens, head_dim, e)) == 0


def test_segments_of_each_order() -> None:
    assert unit_segments("token_major", 16, 8, 2) == (Segment(0, 1, 32),)
    vec = unit_segments("vllm_cpu_vec", 16, 8, 2)
    assert vec[:2] == (Segment(0, 1, 2), Segment(32, 1, 2)) and vec[-1] == Segment(256, 1, 16)
    assert len(vec) == 9
    assert unit_segments("vllm_cpu_amx", 32, 32, 2) == (
        Segment(0, 16, 1024), Segment(2048, 2, 64), Segment(2048 + 1024, 2, 64))
    assert [min_chunk_tokens(o) for o in PAGE_ORDERS] == [1, 1, 16]


def test_check_page_order_refusals() -> None:
    for order in PAGE_ORDERS:
        check_page_order(order, 32, 64, "bfloat16")
        check_page_order(order, 32, 64, "fp8_e4m3")
    check_page_order("vllm_cpu_vec", 16, 80, "float32")  # vLLM's vec16 shapes
    with pytest.raises(ValueError, match="unknown page order 'nhd'; known orders: token_major, vllm_cpu_vec"):
        check_page_order("nhd", 16, 64, "bfloat16")
    with pytest.raises(ValueError, match="must be a string"):
        check_page_order(3, 16, 64, "bfloat16")
    with pytest.raises(ValueError, match="2-byte dtype"):
        check_page_order("vllm_cpu_amx", 32, 64, "float32")
    with pytest.raises(ValueError, match="multiples of 32"):
        check_page_order("vllm_cpu_amx", 32, 80, "fp8_e4m3")
    with pytest.raises(ValueError, match="multiples of 32"):
        check_page_order("vllm_cpu_amx", 16, 64, "bfloat16")
    with pytest.raises(ValueError, match="multiples of 32"):
        check_page_order("vllm_cpu_amx", 32, 48, "bfloat16")


MODEL = ModelSpec("m", 4, 32, "bfloat16", (FullAttention(),), (0, 0))


def _geometry(model: ModelSpec, order: str, kbs: int = 32) -> WorkerGeometry:
    return build_worker_geometry(model, 2, 1, 2 * kbs, kbs, 5, packed_base_addrs(model, 2, 2 * kbs, kbs, 5, 0),
                                 page_order=order)


@pytest.mark.parametrize("order", PAGE_ORDERS)
def test_wire_carries_the_page_order(order: str) -> None:
    g = _geometry(MODEL, order)
    wire = g.to_wire()
    assert wire["page_order"] == order
    assert WorkerGeometry.from_wire(wire) == g


def test_wire_without_page_order_is_token_major_and_bad_values_are_refused() -> None:
    wire = _geometry(MODEL, "vllm_cpu_vec").to_wire()
    old = {k: v for k, v in wire.items() if k != "page_order"}
    assert WorkerGeometry.from_wire(old).page_order == "token_major"
    with pytest.raises(ValueError, match="page_order must be a string"):
        WorkerGeometry.from_wire({**wire, "page_order": 1})
    with pytest.raises(ValueError, match="unknown page order"):
        WorkerGeometry.from_wire({**wire, "page_order": "hnd"})


def test_geometry_refuses_orders_it_cannot_hold() -> None:
    with pytest.raises(ValueError, match="MLA latent pages are only supported in 'token_major'"):
        _geometry(DEEPSEEK_MLA, "vllm_cpu_vec")
    with pytest.raises(ValueError, match="multiples of 32"):
        _geometry(MODEL, "vllm_cpu_amx", kbs=16)
    fp32 = ModelSpec("m", 4, 32, "float32", (FullAttention(),), (0, 0))
    with pytest.raises(ValueError, match="2-byte dtype"):
        _geometry(fp32, "vllm_cpu_amx")
    # hybrid models: SSM pages keep their layout, attention pages take the order
    hybrid = build_worker_geometry(TINY_HYBRID, 1, 0, 16, 16, 4, packed_base_addrs(TINY_HYBRID, 1, 16, 16, 4, 0),
                                   page_order="vllm_cpu_vec")
    assert hybrid.page_order == "vllm_cpu_vec"
    assert len(hybrid.token_segments(hybrid.attention_regions[0])) == TINY_HYBRID.head_dim + 1
