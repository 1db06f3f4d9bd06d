"""TransferPlan on hand-checkable cases: the seed formula, merging, failure marking, errors."""

from __future__ import annotations

import numpy as np
import pytest

from kvlink.layout.geometry import WorkerGeometry, build_worker_geometry, packed_base_addrs
from kvlink.layout.presets import LLAMA3_8B, TINY_HYBRID
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
