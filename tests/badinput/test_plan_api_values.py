"""Wrong values given straight to the public planning API (not through the CLI or the wire,
which check their own): each is a ValueError naming what is wrong, never a block read from
the wrong place, a silent empty read, or an IndexError/TypeError/OverflowError from numpy."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvlink.layout.geometry import build_worker_geometry
from kvlink.layout.spec import FullAttention, ModelSpec, SlidingWindow
from kvlink.plan import build_transfer_plan, compute_tp_mapping, consumers_per_producer
from kvlink.plan.transfer_plan import TransferPlan

MODEL = ModelSpec(name="t", num_kv_heads=4, head_dim=4, dtype="float32", groups=(FullAttention(),),
                  layer_groups=(0, 0))


def _plan(model: ModelSpec = MODEL) -> TransferPlan:
    p = build_worker_geometry(model, 1, 0, 4, 4, 8, [0x10_0000 * (i + 1) for i in range(model.num_layers)])
    d = build_worker_geometry(model, 1, 0, 4, 4, 8, [0x100_0000 * (i + 1) for i in range(model.num_layers)])
    return build_transfer_plan(d, {0: p})


@pytest.mark.parametrize(("args", "match"), [
    ((1, 0, 3), r"remote TP size 3: part 'kv': 4 units cannot be split over TP 3"),
    ((1, 0, 6), r"remote TP size 6: .* not a multiple"),
    ((3, 0, 1), r"local TP size 3"),
    ((1, 0, 0), r"remote TP size: expected an integer in \[1, 256\], got 0"),
    ((1, 0, True), r"remote TP size: expected an integer .* got bool"),
    ((1, 1, 1), r"local rank: expected an integer in \[0, 0\], got 1"),
    (([1], 0, 1), r"local TP size: expected an integer"),
])
def test_tp_mapping_refuses_sizes_that_do_not_shard_the_heads(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        compute_tp_mapping(MODEL, *args)


@pytest.mark.parametrize(("producer_tp", "consumer_tp"), [(6, 1), (3, 2), (4, 0), (4, -1), (1, 5)])
def test_consumers_per_producer_refuses_what_compute_tp_mapping_refuses(producer_tp: int, consumer_tp: int) -> None:
    with pytest.raises(ValueError, match="TP size"):
        consumers_per_producer(MODEL, producer_tp, consumer_tp)


def test_consumers_per_producer_in_range_counts_every_producer() -> None:
    for producer_tp, consumer_tp in [(1, 1), (4, 2), (2, 4), (8, 2), (8, 8), (1, 8)]:
        assert min(consumers_per_producer(MODEL, producer_tp, consumer_tp)) >= 1


@pytest.mark.parametrize(("local", "remote", "tokens", "kwargs", "match"), [
    ([[1.9, 2.2, 3.7]], [[0, 1, 2]], 9, {}, r"local block ids of group 0 must be a flat sequence of integers"),
    ([[True, 2, 3]], [[0, 1, 2]], 9, {}, r"local block ids of group 0 must be integers, got a bool"),
    ([[1, 2, 3]], [[0, 1, 2**70]], 9, {}, r"remote block ids of group 0 must be a flat sequence of integers"),
    ([None], [[0, 1, 2]], 9, {}, r"local block ids of group 0 must be a sequence of integers"),
    (["123"], [[0, 1, 2]], 9, {}, r"local block ids of group 0 must be a sequence of integers"),
    ([[[1, 2], [3, 4]]], [[0, 1, 2]], 9, {}, r"local block ids of group 0 must be a flat sequence"),
    ([np.array([1, 2, 3], dtype=bool)], [[0, 1, 2]], 9, {}, r"local block ids of group 0 must be a flat"),
    ([[1, 2, 3]], [[0, 1, 2]], 9.5, {}, r"num_tokens_to_ship: expected an integer"),
    ([[1, 2, 3]], [[0, 1, 2]], "9", {}, r"num_tokens_to_ship: expected an integer"),
    ([[1, 2, 3]], [[0, 1, 2]], 9, {"local_computed_tokens": 4.0}, r"local_computed_tokens: expected an integer"),
    ([[1, 2, 3]], [[0, 1, 2]], 9, {"layers": [99]}, r"layers: expected an integer in \[0, 1\], got 99"),
    ([[1, 2, 3]], [[0, 1, 2]], 9, {"layers": [0.0]}, r"layers: expected an integer"),
    ([[1, 2, 3]], [[0, 1, 2]], 9, {"layers": "01"}, r"layers must be a sequence of layer indices"),
    ([[1, 2, 3]], [[0, 1, 2]], 9, {"tokens": (0.0, 4)}, r"tokens\[0\]: expected an integer"),
    ([[1, 2, 3]], [[0, 1, 2]], 9, {"tokens": 4}, r"tokens must be a \(start, end\) pair"),
    ([[1, 1, 1]], [[0, 1, 2]], 9, {}, r"local block ids of group 0 repeat a block"),
])
def test_request_ids_refuses_what_is_not_a_block_list(local: Any, remote: Any, tokens: Any,
                                                     kwargs: dict[str, Any], match: str) -> None:
    plan = _plan()
    with pytest.raises(ValueError, match=match):
        plan.request_ids(local, remote, tokens, **kwargs)


def test_request_ids_takes_numpy_and_list_ids_alike() -> None:
    plan = _plan()
    (from_lists,) = plan.request_ids([[1, 2, 3]], [[0, 1, 2]], 9)
    for local, remote in [([np.array([1, 2, 3], dtype=np.int32)], [np.array([0, 1, 2], dtype=np.uint16)]),
                          ([(1, 2, 3)], [range(3)]),
                          ([[np.int64(1), np.int64(2), np.int64(3)]], [[0, 1, 2]])]:
        (spec,) = plan.request_ids(local, remote, np.int64(9))
        assert np.array_equal(spec.local_idx, from_lists.local_idx)
        assert np.array_equal(spec.remote_idx, from_lists.remote_idx)
        assert spec.nbytes == from_lists.nbytes


def test_a_sliding_group_may_list_one_block_twice_outside_its_window() -> None:
    """vLLM lists its null block for every block a sliding window let go: those are not written."""
    model = ModelSpec(name="s", num_kv_heads=4, head_dim=4, dtype="float32", groups=(SlidingWindow(4),),
                      layer_groups=(0, 0))
    (spec,) = _plan(model).request_ids([[0, 0, 5, 6]], [[0, 0, 2, 3]], 13)  # window: tokens 8..12
    assert spec.local_blocks[0].tolist() == [5, 6]


def test_model_spec_refuses_what_is_not_a_group_or_layer_index() -> None:
    base: dict[str, Any] = dict(name="x", num_kv_heads=4, head_dim=4, dtype="float32",
                                groups=(FullAttention(),), layer_groups=(0, 0))
    for change, match in [({"groups": ("full",)}, "groups must be group specs"),
                          ({"groups": ()}, "at least one group"),
                          ({"groups": FullAttention()}, "groups must be a tuple"),
                          ({"layer_groups": (0.0, 0)}, r"layer_groups\[0\]: expected an integer"),
                          ({"layer_groups": (True, 0)}, r"layer_groups\[0\]: expected an integer"),
                          ({"kv_scales": (1.0, 1.0)}, "kv_scales must be"),
                          ({"dtype": ["float32"]}, "not supported")]:
        with pytest.raises(ValueError, match=match):
            ModelSpec(**{**base, **change})
    listed = ModelSpec(**{**base, "layer_groups": [0, 0], "groups": [FullAttention()]})
    assert listed == ModelSpec(**base) and hash(listed) == hash(ModelSpec(**base))


def test_worker_geometry_refuses_base_addresses_that_are_not_integers() -> None:
    for bases in ([0.5, 0x10_0000], ["65536", 0x10_0000], [True, 0x10_0000]):
        with pytest.raises(ValueError, match="base address of layer 0 must be an integer"):
            build_worker_geometry(MODEL, 1, 0, 4, 4, 8, bases)
    assert len(build_worker_geometry(MODEL, 1, 0, 4, 4, 8, [np.uint64(0x10_0000), 0x20_0000]).regions) == 2
