"""TransferPlan on hand-checkable cases: the seed formula, merging, failure marking, errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvlink.layout.geometry import WorkerGeometry, build_worker_geometry, packed_base_addrs
from kvlink.layout.presets import LLAMA3_8B, TINY_HYBRID, TINY_HYBRID_SD
from kvlink.layout.spec import FullAttention, ModelSpec
from kvlink.plan import IncompatibleLayout, build_transfer_plan, count_merged, desc_ids_attention
from kvlink.plan.compat import check_compatible
from kvlink.plan.descriptors import locate


def worker(model: ModelSpec, tp: int, rank: int, bs: int, kbs: int, blocks: int, side: int) -> WorkerGeometry:
    start = (1 + side * 16 + rank) << 36
    return build_worker_geometry(model, tp, rank, bs, kbs, blocks,
                                 packed_base_addrs(model, tp, bs, kbs, blocks, start), device_id=rank)


def region_of(geometry: WorkerGeometry, descs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return locate(descs, [r.base for r in geometry.regions])


def engine(model: ModelSpec, tp: int, bs: int, kbs: int, blocks: int) -> dict[int, WorkerGeometry]:
    return {r: worker(model, tp, r, bs, kbs, blocks, 0) for r in range(tp)}


def test_plain_case_is_the_seed_formula() -> None:
    d = worker(LLAMA3_8B, 1, 0, 16, 16, 100, 1)
    plan = build_transfer_plan(d, engine(LLAMA3_8B, 1, 16, 16, 80))
    (spec,) = plan.request_ids([[4, 9, 2]], [[70, 71, 72, 73]], num_tokens_to_ship=47)
    assert spec.local_idx.tolist() == desc_ids_attention([4, 9, 2], 32, 100).tolist()
    assert spec.remote_idx.tolist() == desc_ids_attention([70, 71, 72], 32, 80).tolist()
    assert spec.nbytes == 3 * 32 * 8 * 16 * 256 * 2
    assert spec.local_blocks[0].tolist() == [4, 9, 2]


def test_kernel_expansion_with_own_ppl_per_side() -> None:
    d = worker(LLAMA3_8B, 1, 0, 32, 16, 10, 1)   # ppl 2
    plan = build_transfer_plan(d, engine(LLAMA3_8B, 1, 64, 16, 10))  # ppl 4
    (spec,) = plan.request_ids([[3, 5]], [[7]], num_tokens_to_ship=64)
    assert spec.local_idx[:4].tolist() == [6, 7, 10, 11]
    assert spec.remote_idx[:4].tolist() == [28, 29, 30, 31]


def test_prefix_hit_moves_only_the_tail() -> None:
    d = worker(LLAMA3_8B, 1, 0, 16, 16, 100, 1)
    plan = build_transfer_plan(d, engine(LLAMA3_8B, 1, 32, 32, 100))
    # D already has tokens [0, 32); P's 32-token blocks hold 16-token halves of D's blocks
    (spec,) = plan.request_ids([[50, 51]], [[10, 11]], num_tokens_to_ship=63, local_computed_tokens=32)
    # chunk = 16 tokens: P block 11 chunk 0 and chunk 1 → D blocks 50, 51; per head pieces
    assert spec.local_blocks[0].tolist() == [50, 51]
    remote = plan.source(0).remote_descs[spec.remote_idx]
    p_base = plan.source(0).remote_descs[0, 0]
    assert int(remote[0, 0] - p_base) == 11 * 8 * 32 * 512


def test_contiguous_blocks_merge_into_one_descriptor_per_region() -> None:
    d, p = worker(LLAMA3_8B, 1, 0, 16, 16, 100, 1), worker(LLAMA3_8B, 1, 0, 16, 16, 100, 0)
    plan = build_transfer_plan(d, {0: p})
    source = plan.source(0)
    (spec,) = plan.request_ids([list(range(20, 84))], [list(range(0, 64))], num_tokens_to_ship=1024)
    local, remote = source.local_descs[spec.local_idx], source.remote_descs[spec.remote_idx]
    (local_regions, _), (remote_regions, _) = region_of(d, local), region_of(p, remote)
    merged = count_merged(local, remote, local_regions, remote_regions)
    assert (len(spec.local_idx), merged) == (64 * 32, 32)


def test_hybrid_ships_only_the_state_block() -> None:
    d = worker(TINY_HYBRID, 2, 1, 16, 16, 20, 1)
    plan = build_transfer_plan(d, engine(TINY_HYBRID, 1, 16, 16, 20))
    (spec,) = plan.request_ids([[3, 4], [9]], [[0, 1], [5, 6]], num_tokens_to_ship=20)
    assert spec.local_blocks[1].tolist() == [9]
    ssm_ids = spec.remote_idx[-8:]  # 2 SSM layers x (3 conv + state)
    source = plan.source(0)
    first_ssm = len(source.remote_descs) - 8 * 20
    assert ((ssm_ids - first_ssm) % 20 == 6).all()


def test_only_the_state_moves_after_a_full_prefix_hit() -> None:
    d = worker(TINY_HYBRID, 1, 0, 16, 16, 20, 1)
    plan = build_transfer_plan(d, engine(TINY_HYBRID, 1, 16, 16, 20))
    (spec,) = plan.request_ids([[], [3]], [[0, 1], [5]], num_tokens_to_ship=16, local_computed_tokens=16)
    assert spec.nbytes == sum(r.page_len for r in d.ssm_regions)
    assert spec.local_blocks[0].size == 0 and spec.local_blocks[1].tolist() == [3]
    (none,) = plan.request_ids([[], [3]], [[0], [5]], num_tokens_to_ship=0)
    assert none.local_idx.size == none.remote_idx.size == none.nbytes == 0


def test_push_mode_plans_one_source() -> None:
    p_engine = engine(LLAMA3_8B, 2, 16, 16, 50)
    d = worker(LLAMA3_8B, 1, 0, 16, 16, 50, 1)
    push = build_transfer_plan(d, {1: p_engine[1]}, only_sources=[1])
    pull = build_transfer_plan(d, p_engine)
    assert [s.src_rank for s in push.sources] == [1]
    np.testing.assert_array_equal(push.source(1).local_descs, pull.source(1).local_descs)
    np.testing.assert_array_equal(push.source(1).remote_descs, pull.source(1).remote_descs)


def test_bad_requests_are_refused_clearly() -> None:
    d = worker(LLAMA3_8B, 1, 0, 16, 16, 10, 1)
    plan = build_transfer_plan(d, engine(LLAMA3_8B, 1, 16, 16, 10))
    with pytest.raises(ValueError, match="multiple of the local block size"):
        plan.request_ids([[1]], [[1, 2]], 20, local_computed_tokens=8)
    with pytest.raises(ValueError, match="has 1 blocks but tokens"):
        plan.request_ids([[1]], [[1, 2]], 20)
    with pytest.raises(ValueError, match=r"must lie in \[0, 10\)"):
        plan.request_ids([[1, 2]], [[1, -1]], 20)
    with pytest.raises(ValueError, match="expected block ids for 1 groups"):
        plan.request_ids([[1], [2]], [[1]], 5)


def test_missing_source_geometry_is_refused() -> None:
    d = worker(LLAMA3_8B, 1, 0, 16, 16, 10, 1)
    with pytest.raises(ValueError, match=r"geometry missing for \[1\]"):
        build_transfer_plan(d, {0: engine(LLAMA3_8B, 2, 16, 16, 10)[0]})


def test_model_mismatch_names_every_field() -> None:
    other = ModelSpec("other", 4, 64, "float32", (FullAttention(),), (0,) * 32)
    d = worker(LLAMA3_8B, 1, 0, 16, 16, 10, 1)
    p = worker(other, 1, 0, 16, 16, 10, 0)
    with pytest.raises(IncompatibleLayout) as info:
        check_compatible(p.to_wire(), d.to_wire())
    text = str(info.value)
    for field in ("name", "dtype", "head_dim", "num_kv_heads"):
        assert f"{field}:" in text
    assert "Supported:" in text
    with pytest.raises(IncompatibleLayout):
        build_transfer_plan(d, {0: p})


def test_conv_layout_mismatch_is_refused_naming_both_layouts() -> None:
    sd = TINY_HYBRID_SD
    d = worker(sd, 1, 0, 16, 16, 10, 1)
    p = worker(TINY_HYBRID, 1, 0, 16, 16, 10, 0)
    with pytest.raises(IncompatibleLayout) as info:
        check_compatible(p.to_wire(), d.to_wire())
    text = str(info.value)
    assert "SSM conv state layout: P has 'DS', D has 'SD'" in text
    assert "group parameters" not in text  # nothing else differs
    check_compatible(worker(sd, 1, 0, 16, 16, 10, 0).to_wire(), d.to_wire())  # SD on both sides moves


def _order_worker(model: ModelSpec, tp: int, rank: int, kbs: int, blocks: int, side: int,
                  order: str | None) -> WorkerGeometry:
    start = (1 + side * 16 + rank) << 36
    bases = packed_base_addrs(model, tp, 2 * kbs, kbs, blocks, start)
    if order is None:
        return build_worker_geometry(model, tp, rank, 2 * kbs, kbs, blocks, bases, device_id=rank)
    return build_worker_geometry(model, tp, rank, 2 * kbs, kbs, blocks, bases, device_id=rank, page_order=order)


@pytest.mark.parametrize(("p_kbs", "d_kbs"), [(16, 16), (32, 16), (16, 64)])
def test_token_major_plans_are_unchanged(p_kbs: int, d_kbs: int) -> None:
    """Explicit token_major equals the default, and chunked pieces follow the original formula:
    per (page, chunk, head) one piece at head*unit + c*chunk*token_bytes of chunk*token_bytes."""
    model = ModelSpec("m", 4, 8, "bfloat16", (FullAttention(),), (0, 0))
    d_default = _order_worker(model, 2, 1, d_kbs, 6, 1, None)
    p_default = {r: _order_worker(model, 1, r, p_kbs, 5, 0, None) for r in range(1)}
    d_explicit = _order_worker(model, 2, 1, d_kbs, 6, 1, "token_major")
    p_explicit = {r: _order_worker(model, 1, r, p_kbs, 5, 0, "token_major") for r in range(1)}
    default, explicit = build_transfer_plan(d_default, p_default), build_transfer_plan(d_explicit, p_explicit)
    for a, b in zip(default.sources, explicit.sources, strict=True):
        np.testing.assert_array_equal(a.local_descs, b.local_descs)
        np.testing.assert_array_equal(a.remote_descs, b.remote_descs)
    if p_kbs == d_kbs:
        return
    chunk = default.chunk_tokens
    region = d_default.attention_regions[0]
    heads = [2, 3]  # D rank 1 of TP 2 holds global heads 2, 3 = P slots 2, 3
    for geometry, descs, slots in ((d_default, default.source(0).local_descs, [0, 1]),
                                   (p_default[0], default.source(0).remote_descs, heads)):
        reg = geometry.attention_regions[0]
        per_page = geometry.kernel_block_size // chunk * len(slots)
        want = [reg.base + page * reg.page_stride + slot * reg.unit_bytes + c * chunk * reg.token_bytes
                for page in range(reg.num_pages) for c in range(geometry.kernel_block_size // chunk)
                for slot in slots]
        got = descs[:reg.num_pages * per_page]
        assert got[:, 0].tolist() == want
        assert set(got[:, 1].tolist()) == {chunk * region.token_bytes}


def test_page_order_mismatch_is_refused_naming_both_orders() -> None:
    model = ModelSpec("m", 4, 32, "bfloat16", (FullAttention(),), (0, 0))
    p = _order_worker(model, 1, 0, 32, 4, 0, "vllm_cpu_amx")
    d = _order_worker(model, 1, 0, 64, 4, 1, "vllm_cpu_vec")
    message = "page order: P has 'vllm_cpu_amx', D has 'vllm_cpu_vec'; kvlink moves KV only between equal"
    with pytest.raises(IncompatibleLayout, match=message):
        check_compatible(p.to_wire(), d.to_wire())
    with pytest.raises(IncompatibleLayout, match=message):
        build_transfer_plan(d, {0: p})
    old_peer = {k: v for k, v in p.to_wire().items() if k != "page_order"}
    with pytest.raises(IncompatibleLayout, match="P has 'token_major', D has 'vllm_cpu_vec'"):
        check_compatible(old_peer, d.to_wire())


def test_chunks_smaller_than_the_order_granule_are_refused() -> None:
    # amx geometries need kernel blocks of 32k tokens, so build the pair past that check
    model = ModelSpec("m", 4, 32, "bfloat16", (FullAttention(),), (0, 0))
    p = dataclasses.replace(_order_worker(model, 1, 0, 8, 4, 0, None), page_order="vllm_cpu_amx")
    d = dataclasses.replace(_order_worker(model, 1, 0, 16, 4, 1, None), page_order="vllm_cpu_amx")
    with pytest.raises(IncompatibleLayout, match="granules of 16 tokens, but kernel block sizes P 8 and D 16"):
        build_transfer_plan(d, {0: p})


def test_vec_pieces_follow_each_sides_segments() -> None:
    """vllm_cpu_vec 32 → 128: each head chunk is D K rows of `chunk` elements, then one V run;
    the K rows are N apart on each side with that side's own N."""
    model = ModelSpec("m", 2, 32, "float32", (FullAttention(),), (0,))
    p, d = _order_worker(model, 1, 0, 32, 4, 0, "vllm_cpu_vec"), _order_worker(model, 1, 0, 128, 2, 1, "vllm_cpu_vec")
    plan = build_transfer_plan(d, {0: p})
    source = plan.source(0)
    seg = source.attention[0]
    assert plan.chunk_tokens == 32 and seg.pieces == 2 * (32 + 1)
    (spec,) = plan.request_ids([[0]], [[0, 1]], 64)
    local, remote = source.local_descs[spec.local_idx], source.remote_descs[spec.remote_idx]
    l_base, r_base = d.regions[0].base, p.regions[0].base
    # chunk 1 of D page 0 (tokens 32..63) head 0, K row 1 ← P page 1 (tokens 32..63) head 0, K row 1
    piece = seg.pieces + 1
    assert int(local[piece, 0]) - l_base == 1 * 128 * 4 + 32 * 4
    assert int(remote[piece, 0]) - r_base == p.regions[0].page_stride + 1 * 32 * 4
    assert int(local[piece, 1]) == 32 * 4
    assert spec.nbytes == 64 * 2 * 2 * 32 * 4
