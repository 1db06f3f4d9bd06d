"""vLLM's sliding-window KV-cache groups in kvlink's terms (no engine): the window kvlink ships,
the groups it accepts, and how groups that share memory pair between block sizes."""

from __future__ import annotations

import pytest

from kvlink.connector.params import InvalidTransferParams, parse_remote_prefill
from kvlink.integrations.vllm.layout import (
    GroupInfo,
    LayerTensor,
    UnsupportedVllmLayout,
    check_hybrid_tensors,
    model_spec,
)
from kvlink.layout.digests import shipped_blocks
from kvlink.layout.geometry import WorkerGeometry, build_worker_geometry
from kvlink.layout.spec import FullAttention, Mamba2, ModelSpec, SlidingWindow
from kvlink.plan.compat import IncompatibleLayout
from kvlink.plan.request import first_token_to_ship
from kvlink.plan.staged import build_staged_plan, needs_staging, staging_geometry
from kvlink.plan.transfer_plan import build_transfer_plan

BLOCK, WINDOW = 32, 64


def group(kind: str, layer: int, window: int = 0, heads: int = 1) -> GroupInfo:
    return GroupInfo(kind, (f"model.layers.{layer}.self_attn.attn",), "float32", num_kv_heads=heads, head_dim=64,
                     block_size=BLOCK, sliding_window=window)


GEMMA = [group("sliding", 0, WINDOW), group("sliding", 1, WINDOW), group("sliding", 2, WINDOW), group("attention", 3)]


def test_groups_map_in_vllm_order_with_the_window_d_needs() -> None:
    model = model_spec("g", GEMMA, 1)
    assert model.groups == (SlidingWindow(WINDOW - 1),) * 3 + (FullAttention(),)
    assert model.layer_groups == (0, 1, 2, 3)
    uniform = model_spec("m", [group("sliding", 0, WINDOW)], 1)
    assert uniform.groups == (SlidingWindow(WINDOW - 1),)


@pytest.mark.parametrize("num_tokens", [20, 64, 65, 96, 97, 300, 321])
def test_shipped_window_starts_at_the_first_block_vllm_gives_memory(num_tokens: int) -> None:
    """vLLM's D leaves the blocks before (N - window) // block as null blocks; kvlink ships the
    tokens [window start, N - 1), which must lie in blocks D holds and must cover what the
    recomputed token N - 1 attends to."""
    model = model_spec("g", GEMMA, 1)
    geometry = build_worker_geometry(model, 1, 0, BLOCK, BLOCK, 64, [1 << 30] * 4, page_order="vllm_cpu_vec",
                                     aliased=True)
    shipped = num_tokens - 1
    blocks = shipped_blocks(geometry, 0, shipped, -(-num_tokens // BLOCK))
    d_null_blocks = max(0, shipped - WINDOW + 1) // BLOCK  # vLLM's skipped tokens for N - 1 computed
    assert blocks.start == d_null_blocks
    first_attended = max(0, num_tokens - 1 - WINDOW + 1)
    assert blocks.start * BLOCK <= first_attended
    plan = build_transfer_plan(geometry, {0: geometry})
    assert first_token_to_ship(plan, 0, shipped, 0) == blocks.start * BLOCK
    assert first_token_to_ship(plan, 3, shipped, 0) == 0  # the global layer's group moves whole


def test_window_below_two_tokens_and_mixed_shapes_are_refused() -> None:
    with pytest.raises(UnsupportedVllmLayout, match="sliding window of 1 tokens"):
        model_spec("g", [group("sliding", 0, 1), group("attention", 1)], 1)
    with pytest.raises(UnsupportedVllmLayout, match="differ in"):
        model_spec("g", [group("sliding", 0, WINDOW, heads=2), group("attention", 1)], 1)


def test_aliased_sliding_and_full_layers_register_one_region_each() -> None:
    page = BLOCK * 2 * 64 * 4
    tensors = [LayerTensor(g.layer_names[0], 1 << 30, (8, 1, BLOCK, 128), (BLOCK * 128, BLOCK * 128, 128, 1), 4,
                           "float32") for g in GEMMA]
    bases, sizes, blocks, stride = check_hybrid_tensors(tensors, GEMMA)
    assert bases == [1 << 30] * 4 and sizes == [8 * page] * 4 and blocks == 8 and stride is None


def test_p_lists_may_repeat_the_null_block_only() -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r",
              "remote_block_ids": [[0, 0, 7, 8], [3, 4, 5, 6]], "remote_host": "127.0.0.1", "remote_port": 5000,
              "tp_size": 1}
    assert parse_remote_prefill(params).remote_block_ids[0] == [0, 0, 7, 8]
    with pytest.raises(InvalidTransferParams, match="repeats a block id"):
        parse_remote_prefill({**params, "remote_block_ids": [[0, 7, 7]]})


def test_groups_sharing_memory_between_block_sizes_read_through_staging() -> None:
    """Aliased groups between block sizes go through staging pages (every layer's P page in
    one slot, each group copied into its own D blocks; a hybrid's state page whole), never as
    token chunks of the transposed pages."""
    model = model_spec("g", GEMMA, 1)

    def worker(m: ModelSpec, block: int) -> WorkerGeometry:
        return build_worker_geometry(m, 1, 0, block, block, 16, [1 << 32] * m.num_layers,
                                     page_order="vllm_cpu_vec", aliased=True)

    d, p = worker(model, 32), worker(model, 64)
    assert needs_staging(d, p)
    staging = staging_geometry(d, 64, 8, [(1 << 33) + i * (1 << 20) for i in range(4)])
    plan = build_staged_plan(d, staging, {0: p})
    # 300 tokens: the sliding groups' window (63 tokens) starts at 237, in P's page 3 (192..255)
    req = plan.request([list(range(10))] * 4, [list(range(5))] * 4, 300, 0, list(range(plan.slots_needed(300, 0))))
    # (copies run to the end of the 32-token chunk holding token 299)
    assert len(req.slots) == 5
    assert [int(r[:, 4].sum()) for r in req.runs] == [320 - 224] * 3 + [320]
    assert [int(r[0, 1]) for r in req.runs] == [224 % 64] * 3 + [0]  # first token in its staging page
    with pytest.raises(IncompatibleLayout, match="through staging pages only"):
        build_transfer_plan(d, {0: p})
    hybrid = ModelSpec("h", 1, 64, "float32", (FullAttention(), Mamba2(2, 2, 1, 2, 2)), (0, 1))
    d, p = worker(hybrid, 32), worker(hybrid, 64)
    assert needs_staging(d, p)
    staging = staging_geometry(d, 64, 8, [(1 << 33) + i * (1 << 20) for i in range(2)])
    req = build_staged_plan(d, staging, {0: p}).request([[3], [9]], [[1, 2], [7]], 100, 96, [4])
    assert req.states == ((staging.regions[1].base + 4 * staging.regions[1].page_len,
                           (1 << 32) + 9 * d.regions[1].page_stride, d.regions[1].page_len),)
    build_transfer_plan(worker(model, 64), {0: worker(model, 64)})
