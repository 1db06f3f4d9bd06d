"""The plan-memory bound: the size computed before building equals what building allocates,
and a plan over the bound is refused with that size before any descriptor list exists."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlink.layout.geometry import WorkerGeometry, build_worker_geometry, packed_base_addrs
from kvlink.layout.presets import DEEPSEEK_MLA, LLAMA3_8B, TINY_HYBRID
from kvlink.layout.spec import FullAttention, ModelSpec, SlidingWindow
from kvlink.plan.budget import plan_bytes
from kvlink.plan.report import EngineConfig, fake_engine
from kvlink.plan.transfer_plan import build_transfer_plan

MODELS = {"llama3-8b": LLAMA3_8B, "deepseek-mla": DEEPSEEK_MLA, "hybrid-mamba2": TINY_HYBRID}


def _config(tp: int, block: int, ppl: int) -> EngineConfig:
    return EngineConfig(tp, block, block // ppl)


@settings(max_examples=40, deadline=None)
@given(model=st.sampled_from(sorted(MODELS)), p_tp=st.sampled_from([1, 2, 4, 8]),
       d_tp=st.sampled_from([1, 2, 4, 8]), p_block=st.sampled_from([8, 16, 32, 64]),
       d_block=st.sampled_from([8, 16, 32, 64]), p_ppl=st.sampled_from([1, 2, 4]),
       d_ppl=st.sampled_from([1, 2, 4]), num_blocks=st.integers(1, 9))
def test_computed_size_equals_built_lists(model: str, p_tp: int, d_tp: int, p_block: int, d_block: int,
                                          p_ppl: int, d_ppl: int, num_blocks: int) -> None:
    spec = MODELS[model]
    p_workers = fake_engine(spec, _config(p_tp, p_block, p_ppl), num_blocks, 0x10_0000_0000)
    d_workers = fake_engine(spec, _config(d_tp, d_block, d_ppl), num_blocks + 3, 0x20_0000_0000)
    p_engine = dict(enumerate(p_workers))
    for reader in d_workers:
        plan = build_transfer_plan(reader, p_engine)
        built = sum(s.local_descs.nbytes + s.remote_descs.nbytes for s in plan.sources)
        assert plan_bytes(reader, p_engine) == built


def test_plan_over_the_bound_is_refused_with_its_size_before_allocating() -> None:
    # 32 layers x 2**24 kernel blocks of one token, on both sides: 24 GiB of descriptors.
    config = EngineConfig(1, 1, 1)
    (p_worker,) = fake_engine(LLAMA3_8B, config, 2**24, 0x10_0000_0000)
    (d_worker,) = fake_engine(LLAMA3_8B, config, 2**24, 0x20_0000_0000_0000)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as refused:
            build_transfer_plan(d_worker, {0: p_worker})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(refused.value)
    assert "24576.0 MiB of descriptor lists (1073741824 descriptors" in message
    assert "bound of 1024 MiB" in message
    assert peak < 2**20


def test_request_longer_than_its_block_lists_is_refused_before_allocating() -> None:
    (p_worker,) = fake_engine(LLAMA3_8B, EngineConfig(1, 16, 16), 8, 0x10_0000_0000)
    (d_worker,) = fake_engine(LLAMA3_8B, EngineConfig(1, 16, 16), 8, 0x20_0000_0000)
    plan = build_transfer_plan(d_worker, {0: p_worker})
    ids = [np.arange(8)]
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="local block list of group 0 has 8 blocks but tokens"):
            plan.request_ids(ids, ids, 2**24)
        with pytest.raises(ValueError, match=r"num_tokens_to_ship: expected an integer in \[0, 16777216\]"):
            plan.request_ids(ids, ids, 10**12)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20


@settings(max_examples=30, deadline=None)
@given(order=st.sampled_from(["token_major", "vllm_cpu_vec", "vllm_cpu_amx"]),
       p_tp=st.sampled_from([1, 2, 4]), d_tp=st.sampled_from([1, 2, 4]),
       p_kbs=st.sampled_from([32, 64, 128]), d_kbs=st.sampled_from([32, 64, 128]),
       p_ppl=st.sampled_from([1, 2]), d_ppl=st.sampled_from([1, 2]), num_blocks=st.integers(1, 5))
def test_computed_size_equals_built_lists_for_page_orders(order: str, p_tp: int, d_tp: int, p_kbs: int,
                                                          d_kbs: int, p_ppl: int, d_ppl: int,
                                                          num_blocks: int) -> None:
    model = ModelSpec("o", 4, 64, "bfloat16", (FullAttention(), SlidingWindow(64)), (0, 1, 0))

    def workers(tp: int, kbs: int, ppl: int, blocks: int, start: int) -> dict[int, WorkerGeometry]:
        bases = [packed_base_addrs(model, tp, kbs * ppl, kbs, blocks, start + (r << 36)) for r in range(tp)]
        return {r: build_worker_geometry(model, tp, r, kbs * ppl, kbs, blocks, bases[r], device_id=r,
                                         page_order=order) for r in range(tp)}

    p_engine = workers(p_tp, p_kbs, p_ppl, num_blocks, 1 << 40)
    for reader in workers(d_tp, d_kbs, d_ppl, num_blocks + 2, 1 << 44).values():
        plan = build_transfer_plan(reader, p_engine)
        built = sum(s.local_descs.nbytes + s.remote_descs.nbytes for s in plan.sources)
        assert plan_bytes(reader, p_engine) == built
