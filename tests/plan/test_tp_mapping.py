"""Heterogeneous TP mapping: the worked examples, replication, MLA, notifications."""

from __future__ import annotations

from kvlink.layout.presets import TINY_HYBRID
from kvlink.layout.spec import MLA, FullAttention, Mamba2, ModelSpec
from kvlink.plan.tp_mapping import UnitRun, compute_tp_mapping, consumers_per_producer


def dense(kv_heads: int) -> ModelSpec:
    return ModelSpec("dense", kv_heads, 128, "bfloat16", (FullAttention(),), (0, 0))


def kv_runs(model: ModelSpec, d_tp: int, d_rank: int, p_tp: int) -> tuple[UnitRun, ...]:
    return compute_tp_mapping(model, d_tp, d_rank, p_tp).runs["kv"]


def test_d_tp_above_p_tp_reads_a_head_slice() -> None:
    # P=2, D=4, K=8: D rank 3 holds heads 6,7 = slots 2,3 of P rank 1
    assert kv_runs(dense(8), 4, 3, 2) == (UnitRun(1, 0, 2, 2),)
    assert consumers_per_producer(dense(8), 2, 4) == (2, 2)


def test_p_tp_above_d_tp_reads_several_sources_into_halves() -> None:
    # P=4, D=2, K=8: D rank 1 heads 4..7 = P2's two heads then P3's two heads
    assert kv_runs(dense(8), 2, 1, 4) == (UnitRun(2, 0, 0, 2), UnitRun(3, 2, 0, 2))
    assert consumers_per_producer(dense(8), 4, 2) == (1, 1, 1, 1)


def test_d_replicates_heads() -> None:
    # P=2, D=4, K=2: D ranks 0,1 hold head 0 (P0), ranks 2,3 head 1 (P1)
    assert [kv_runs(dense(2), 4, d, 2) for d in range(4)] == [
        (UnitRun(0, 0, 0, 1),), (UnitRun(0, 0, 0, 1),), (UnitRun(1, 0, 0, 1),), (UnitRun(1, 0, 0, 1),)]
    assert consumers_per_producer(dense(2), 2, 4) == (2, 2)


def test_p_replicates_heads_reads_each_head_once() -> None:
    # P=4, K=2, D=2: P0,P1 hold head 0, P2,P3 head 1; each D rank reads one copy
    maps = [compute_tp_mapping(dense(2), 2, d, 4) for d in range(2)]
    assert [m.source_ranks for m in maps] == [(0,), (2,)]
    assert [m.notify_only_ranks for m in maps] == [(1,), (3,)]
    assert consumers_per_producer(dense(2), 4, 2) == (1, 1, 1, 1)


def test_equal_tp_with_replication_maps_rank_to_rank() -> None:
    for rank in range(8):
        assert kv_runs(dense(2), 8, rank, 8) == (UnitRun(rank, 0, 0, 1),)


def test_both_replicated_spreads_reads_over_replicas() -> None:
    # P=4, D=8, K=2: D ranks 0..3 share head 0, held by P0 and P1
    assert [kv_runs(dense(2), 8, d, 4)[0].src_rank for d in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]


def test_mla_one_reader_others_notified() -> None:
    model = ModelSpec("mla", 1, 576, "bfloat16", (MLA(576),), (0,))
    maps = [compute_tp_mapping(model, 2, d, 4) for d in range(2)]
    assert [m.runs["g0.latent"] for m in maps] == [(UnitRun(0, 0, 0, 1),), (UnitRun(2, 0, 0, 1),)]
    assert [m.notify_ranks for m in maps] == [(0, 1), (2, 3)]
    assert consumers_per_producer(model, 4, 2) == (1, 1, 1, 1)
    assert consumers_per_producer(model, 2, 4) == (2, 2)


def test_ssm_state_is_sharded_even_when_attention_is_replicated() -> None:
    model = ModelSpec("h", 1, 8, "float32", (FullAttention(), Mamba2(4, 2, 2, 2, 4)), (0, 1))
    mapping = compute_tp_mapping(model, 1, 0, 4)
    assert mapping.runs["kv"] == (UnitRun(0, 0, 0, 1),)
    assert mapping.runs["g1.ssm_state"] == tuple(UnitRun(p, p, 0, 1) for p in range(4))
    assert mapping.source_ranks == (0, 1, 2, 3)


def test_tiny_hybrid_every_producer_has_a_consumer() -> None:
    for p_tp in (1, 2):
        for d_tp in (1, 2):
            counts = consumers_per_producer(TINY_HYBRID, p_tp, d_tp)
            assert len(counts) == p_tp and min(counts) >= 1


def test_replicated_parts_come_from_a_rank_already_read() -> None:
    # tiny hybrid P=4 -> D=8: D rank 1 reads head 0 and SSM head 1 from P0; the B/C conv
    # group 0 is on P0 and P1, so it comes from P0 too, not from a second P rank
    maps = [compute_tp_mapping(TINY_HYBRID, 8, d, 4) for d in range(8)]
    assert [m.source_ranks for m in maps] == [(p,) for p in (0, 0, 1, 1, 2, 2, 3, 3)]
    assert maps[1].runs["g1.conv_B"] == (UnitRun(0, 0, 0, 1),)
    assert consumers_per_producer(TINY_HYBRID, 4, 8) == (2, 2, 2, 2)
    # P=8 -> D=4: D rank 1 holds SSM heads 2, 3 (P2, P3); kv head 1 and B/C group 0 follow
    back = [compute_tp_mapping(TINY_HYBRID, 4, d, 8) for d in range(4)]
    assert [m.source_ranks for m in back] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert back[1].runs["g1.conv_B"] == (UnitRun(2, 0, 0, 1),)
    assert consumers_per_producer(TINY_HYBRID, 8, 4) == (1,) * 8
