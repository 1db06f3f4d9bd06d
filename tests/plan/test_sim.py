"""Property test: every planned transfer moves exactly the right bytes and nothing else."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
import sim
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvlink.layout.conv_state import conv_layouts, conv_transpose, planning_view, with_conv_layouts
from kvlink.layout.geometry import build_worker_geometry, packed_base_addrs
from kvlink.layout.presets import TINY_HYBRID
from kvlink.layout.spec import (
    GDN,
    MLA,
    ConvLayout,
    FullAttention,
    GroupSpec,
    Mamba2,
    ModelSpec,
    SlidingWindow,
)
from kvlink.plan.compat import IncompatibleLayout, check_configuration
from kvlink.plan.request import ReadSpec
from kvlink.plan.tp_mapping import compute_tp_mapping, consumers_per_producer
from kvlink.plan.transfer_plan import TransferPlan, build_transfer_plan

TP_PAIRS = [(p, d) for p in (1, 2, 4, 8) for d in (1, 2, 4, 8)]
BLOCK_SIZES = st.sampled_from([8, 16, 32, 64])
PPL = st.sampled_from([1, 2, 4])
UNITS = st.one_of(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]), st.integers(1, 16))
MIXES = ["full", "full+sliding", "full+mamba2", "mla", "full+gdn"]


CONV_LAYOUT = st.sampled_from(["DS", "SD"])
STATE_DTYPE = st.sampled_from(["", "float32"])  # "": the model's dtype; fp32 next to a bf16 conv state


@st.composite
def models(draw: st.DrawFn, mix: str | None = None) -> ModelSpec:
    mix = mix or draw(st.sampled_from(MIXES))
    groups: list[GroupSpec]
    if mix == "full":
        groups = [FullAttention()]
    elif mix == "full+sliding":
        groups = [FullAttention(), SlidingWindow(window=draw(st.integers(1, 120)))]
    elif mix == "full+mamba2":
        groups = [FullAttention(), Mamba2(num_heads=draw(UNITS), head_dim=2, n_groups=draw(UNITS),
                                          d_state=draw(st.sampled_from([2, 3])), conv_kernel=draw(st.integers(2, 4)),
                                          conv_layout=draw(CONV_LAYOUT), state_dtype=draw(STATE_DTYPE))]
    elif mix == "full+gdn":
        k_heads = draw(UNITS)
        groups = [FullAttention(), GDN(num_k_heads=k_heads, num_v_heads=k_heads * draw(st.sampled_from([1, 2])),
                                       head_k_dim=2, head_v_dim=3, conv_kernel=draw(st.integers(2, 4)),
                                       conv_layout=draw(CONV_LAYOUT), state_dtype=draw(STATE_DTYPE))]
    else:
        groups = [MLA(latent_dim=draw(st.sampled_from([3, 8])))]
    layers = draw(st.integers(len(groups), 4))
    layer_groups = tuple(i % len(groups) for i in range(layers))
    return ModelSpec(name=mix, num_kv_heads=draw(UNITS), head_dim=draw(st.sampled_from([1, 4])),
                     dtype=draw(st.sampled_from(["bfloat16", "float32"])), groups=tuple(groups),
                     layer_groups=layer_groups)


@dataclass(frozen=True)
class Side:
    tp: int
    block_size: int
    kernel_block_size: int


@st.composite
def sides(draw: st.DrawFn, tp: int) -> Side:
    block_size = draw(BLOCK_SIZES)
    return Side(tp, block_size, block_size // draw(PPL))


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _block_lists(model: ModelSpec, side: Side, num_blocks: int, count: int, drop_front: int,
                 rng: np.random.Generator) -> list[np.ndarray]:
    lists = []
    for group in model.groups:
        perm = rng.permutation(num_blocks)
        if isinstance(group, (Mamba2, GDN)):
            lists.append(perm[: int(rng.integers(1, 3))])
        else:
            lists.append(perm[drop_front:count])
    return lists


def _null_out_of_window(model: ModelSpec, lists: list[np.ndarray], block_size: int, shipped: int) -> None:
    """P frees sliding-window blocks that lie wholly before the window: ids become -1."""
    for g, group in enumerate(model.groups):
        if isinstance(group, SlidingWindow):
            ends = (np.arange(lists[g].size) + 1) * block_size
            lists[g] = np.where(ends <= shipped - group.window, -1, lists[g])


def _tokens(model: ModelSpec, start_of: list[int], end: int) -> list[np.ndarray]:
    return [np.arange(start_of[g], end, dtype=np.int64) for g in range(len(model.groups))]


def _layerwise_specs(plan: TransferPlan, model: ModelSpec, d_ids: list[np.ndarray], p_ids: list[np.ndarray],
                     shipped: int, computed: int, rng: np.random.Generator) -> list[list[ReadSpec]]:
    """The request cut as a layerwise write cuts it: token ranges on chunk boundaries, one
    layer at a time, in random order; the SSM state comes with the range that ends the prompt."""
    c = plan.chunk_tokens
    inner = sorted({int(x) * c for x in rng.integers(0, shipped // c + 1, size=int(rng.integers(0, 4)))})
    bounds = sorted({0, shipped, *[b for b in inner if b < shipped]})
    parts = [(lo, hi, layer) for lo, hi in itertools.pairwise(bounds)
             for layer in range(model.num_layers)]
    if shipped == 0:
        parts = [(0, 0, layer) for layer in range(model.num_layers)]
    order = rng.permutation(len(parts))
    return [plan.request_ids(d_ids, p_ids, shipped, computed, tokens=parts[i][:2], layers=[parts[i][2]])
            for i in order]


def run_scenario(model: ModelSpec, p: Side, d: Side, shipped: int, prefix_blocks: int,
                 seed: int, page_order: str = "token_major", layerwise: bool = False,
                 d_conv: ConvLayout | None = None) -> list[list[int]]:
    """Simulate every D rank; returns, per D rank, the P ranks it read bytes from.

    `layerwise`: the same request moved in parts (token ranges x layers), as P streams it.
    `d_conv`: D keeps its SSM conv state in this layout (P in the model's): D plans through
    its planning view of P's layout and re-lays the state out once the bytes are in."""
    rng = np.random.default_rng(seed)
    prompt = shipped + 1
    computed = prefix_blocks * d.block_size
    p_count, d_count = _blocks_for(prompt, p.block_size), _blocks_for(prompt, d.block_size)
    p_num_blocks = p_count + int(rng.integers(0, 4))
    d_num_blocks = d_count + int(rng.integers(0, 4))
    logical = sim.make_logical(model, shipped, rng)
    p_ids = _block_lists(model, p, p_num_blocks, p_count, 0, rng)
    _null_out_of_window(model, p_ids, p.block_size, shipped)
    p_tokens = [
        np.flatnonzero(np.repeat(ids >= 0, p.block_size)[:shipped]) if not sim.group_is_ssm(model, g)
        else np.zeros(0, dtype=np.int64)
        for g, ids in enumerate(p_ids)
    ]
    sources = {}
    for rank in range(p.tp):
        mem = sim.make_worker(model, p.tp, rank, p.block_size, p.kernel_block_size, p_num_blocks, 0, rng,
                              page_order)
        sim.store(mem, logical, p_ids, p_tokens)
        sources[rank] = mem
    geometries = {rank: mem.geometry for rank, mem in sources.items()}
    d_ids = _block_lists(model, d, d_num_blocks, d_count, prefix_blocks, rng)
    must_start = [
        max(computed, shipped - g.window) if isinstance(g, SlidingWindow) else computed for g in model.groups
    ]
    notified = [0] * p.tp
    read_from: list[list[int]] = []
    has_state = any(sim.group_is_ssm(model, g) for g in range(len(model.groups)))
    d_model = model if d_conv is None else with_conv_layouts(model, dict.fromkeys(conv_layouts(model), d_conv))
    for rank in range(d.tp):
        own = sim.make_worker(d_model, d.tp, rank, d.block_size, d.kernel_block_size, d_num_blocks, 1, rng,
                              page_order)
        view = planning_view(own.geometry, model)
        reader = sim.WorkerMemory(view, own.start, own.data, own.writes)
        before = reader.data.copy()
        plan = build_transfer_plan(reader.geometry, geometries)
        specs = plan.request_ids(d_ids, p_ids, shipped, computed)
        assert [s.src_rank for s in specs] == list(plan.mapping.source_ranks)
        if layerwise:
            parts = _layerwise_specs(plan, model, d_ids, p_ids, shipped, computed, rng)
            for rank_specs in zip(*parts, strict=True):
                assert sum(s.nbytes for s in rank_specs) == specs[[x.src_rank for x in specs].index(
                    rank_specs[0].src_rank)].nbytes, "the parts do not add up to the request"
            for part in parts:
                sim.execute(plan, part, reader, sources)
        else:
            sim.execute(plan, specs, reader, sources)
        transpose = conv_transpose(own.geometry, view)
        if transpose is not None:
            blocks = {g: [b for s in specs for b in s.local_blocks[g].tolist()] for g in transpose.groups}
            transpose.apply(blocks, lambda a, n, m=own: m.data[a - m.start: a - m.start + n])
        reader = own
        assert reader.writes.max(initial=0) <= 1, "a destination byte was written twice"
        outside = ~sim.destination_mask(reader, d_ids)
        assert np.array_equal(reader.data[outside], before[outside]), "bytes outside the destination changed"
        read_from.append([s.src_rank for s in specs if len(s.local_idx)])
        if shipped == 0 or (shipped <= computed and not has_state):
            assert not reader.writes.any()
        else:  # a hybrid model gets P's state after `shipped` tokens even with a full D hit
            tokens = _tokens(model, must_start, shipped)
            got = sim.load(reader, d_ids, tokens, computed)
            want = sim.expected_for(reader, sim.in_conv_layouts(logical, model, d_model), tokens)
            for layer, rows in want.rows.items():
                np.testing.assert_array_equal(got.rows[layer], rows, err_msg=f"layer {layer}")
            for key, state in want.ssm.items():
                np.testing.assert_array_equal(got.ssm[key], state, err_msg=f"ssm {key}")
        for src in plan.mapping.notify_ranks:
            notified[src] += 1
    assert tuple(notified) == consumers_per_producer(model, p.tp, d.tp)
    assert min(notified) >= 1, "a P rank would never free its blocks"
    return read_from


def _valid(model: ModelSpec, p: Side, d: Side) -> bool:
    try:
        check_configuration(model, model, p.tp, d.tp, p.block_size, p.kernel_block_size,
                            d.block_size, d.kernel_block_size)
    except IncompatibleLayout as exc:
        message = str(exc)
        assert "cannot shard" in message and "Supported:" in message
        bad_tp = p.tp if "P: TP" in message else d.tp
        with pytest.raises(ValueError):
            build_worker_geometry(model, bad_tp, 0, p.block_size, p.kernel_block_size, 1,
                                  packed_base_addrs(model, 1, p.block_size, p.kernel_block_size, 1, 0))
        return False
    return True


SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _scenario(data: st.DataObject, model: ModelSpec, p_tp: int, d_tp: int, layerwise: bool = False) -> None:
    p, d = data.draw(sides(p_tp), "P"), data.draw(sides(d_tp), "D")
    if not _valid(model, p, d):
        event("refused")
        return
    event("same kernel blocks" if p.kernel_block_size == d.kernel_block_size else "chunked")
    shipped = data.draw(st.integers(0, 300), "shipped")
    prefix_blocks = data.draw(st.integers(0, shipped // d.block_size), "prefix blocks")
    run_scenario(model, p, d, shipped, prefix_blocks, data.draw(st.integers(0, 2**16), "seed"), layerwise=layerwise)


@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS)
@pytest.mark.parametrize("mix", MIXES)
@SETTINGS
@given(data=st.data())
def test_transfer_is_byte_exact(mix: str, p_tp: int, d_tp: int, data: st.DataObject) -> None:
    _scenario(data, data.draw(models(mix), "model"), p_tp, d_tp)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2), (4, 2)])
@pytest.mark.parametrize("mix", MIXES)
@SETTINGS
@given(data=st.data())
def test_layerwise_parts_are_byte_exact(mix: str, p_tp: int, d_tp: int, data: st.DataObject) -> None:
    """Token ranges x layers, posted in any order, write every destination byte once and
    rebuild exactly what one whole-request transfer does."""
    _scenario(data, data.draw(models(mix), "model"), p_tp, d_tp, layerwise=True)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2), (4, 2), (2, 8)])
@pytest.mark.parametrize("mix", ["full+mamba2", "full+gdn"])
@SETTINGS
@given(data=st.data())
def test_conv_state_between_layouts_is_exact(mix: str, p_tp: int, d_tp: int, data: st.DataObject) -> None:
    """P keeps its conv state in one layout, D in the other: D reads it as P lays it out (its
    planning view), re-lays it out in place, and holds exactly P's state in its own layout;
    pull and layerwise parts alike."""
    model = data.draw(models(mix), "model")
    p, d = data.draw(sides(p_tp), "P"), data.draw(sides(d_tp), "D")
    if not _valid(model, p, d):
        return
    layout = model.groups[1].conv_layout  # type: ignore[union-attr]
    shipped = data.draw(st.integers(0, 200), "shipped")
    prefix_blocks = data.draw(st.integers(0, shipped // d.block_size), "prefix blocks")
    run_scenario(model, p, d, shipped, prefix_blocks, data.draw(st.integers(0, 2**16), "seed"),
                 layerwise=data.draw(st.booleans(), "layerwise"), d_conv="SD" if layout == "DS" else "DS")


def test_layerwise_range_must_sit_on_chunks() -> None:
    model = ModelSpec("m", 2, 4, "float32", (FullAttention(),), (0, 0))
    p = sim.make_worker(model, 1, 0, 16, 16, 8, 0, np.random.default_rng(0), "token_major")
    d = sim.make_worker(model, 1, 0, 32, 32, 8, 1, np.random.default_rng(1), "token_major")
    plan = build_transfer_plan(d.geometry, {0: p.geometry})
    ids, p_ids = [np.arange(4)], [np.arange(8)]
    with pytest.raises(ValueError, match="chunks of 16 tokens"):
        plan.request_ids(ids, p_ids, 100, tokens=(0, 40))
    with pytest.raises(ValueError, match=r"must lie in \[0, 100\]"):
        plan.request_ids(ids, p_ids, 100, tokens=(48, 120))
    (tail,) = plan.request_ids(ids, p_ids, 100, tokens=(96, 100), layers=[1])
    (whole,) = plan.request_ids(ids, p_ids, 100)
    assert tail.nbytes * 14 == whole.nbytes  # one chunk of 16 tokens of one layer, of 7 x 2
    with pytest.raises(ValueError, match=r"layers: expected an integer in \[0, 1\], got 5"):
        plan.request_ids(ids, p_ids, 100, tokens=(96, 100), layers=[5])  # the model has 2 layers


def test_refused_tp_names_the_part() -> None:
    model = ModelSpec("m", 3, 4, "bfloat16", (FullAttention(),), (0, 0))
    with pytest.raises(IncompatibleLayout, match=r"P: TP 2 cannot shard kv \(3 units\)"):
        check_configuration(model, model, 2, 1, 16, 16, 16, 16)
    with pytest.raises(IncompatibleLayout, match=r"D: TP 8 cannot shard kv"):
        check_configuration(model, model, 1, 8, 16, 16, 16, 16)


def test_hand_picked_scenarios() -> None:
    """Corner cases the random search may visit rarely."""
    full8 = ModelSpec("f", 8, 4, "bfloat16", (FullAttention(),), (0, 0))
    hybrid = ModelSpec("h", 2, 4, "float32", (FullAttention(), Mamba2(4, 2, 2, 2, 4)), (0, 1, 0, 1))
    run_scenario(full8, Side(2, 16, 16), Side(4, 16, 16), 100, 2, 1)   # D_tp > P_tp, prefix hit
    run_scenario(full8, Side(4, 64, 16), Side(2, 16, 8), 150, 3, 2)    # P blocks larger, P_tp > D_tp
    run_scenario(full8, Side(1, 8, 2), Side(8, 64, 64), 130, 1, 3)     # tiny P kernel blocks
    run_scenario(hybrid, Side(8, 32, 8), Side(1, 16, 16), 77, 4, 4)    # P replicates KV heads and SSM
    run_scenario(hybrid, Side(1, 16, 16), Side(8, 32, 16), 64, 0, 5)   # D replicates KV heads
    run_scenario(full8, Side(1, 16, 16), Side(1, 16, 16), 48, 3, 6)    # full prefix hit: nothing moves
    run_scenario(hybrid, Side(1, 16, 16), Side(1, 16, 16), 48, 3, 6)   # full prefix hit: the state moves
    twelve = ModelSpec("t", 12, 4, "bfloat16", (FullAttention(), Mamba2(12, 2, 12, 2, 4)), (0, 1, 0))
    run_scenario(twelve, Side(3, 16, 8), Side(4, 32, 32), 90, 1, 7)    # TP sizes that do not divide
    run_scenario(twelve, Side(6, 16, 16), Side(4, 48, 16), 120, 2, 9)  # ... and a 48-token block


def test_mapping_consistent_with_simulated_notifications() -> None:
    model = ModelSpec("mla", 1, 1, "bfloat16", (MLA(8),), (0,))
    ranks = [compute_tp_mapping(model, 2, d, 4) for d in range(2)]
    assert [m.source_ranks for m in ranks] == [(0,), (2,)]
    assert [m.notify_only_ranks for m in ranks] == [(1,), (3,)]


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (1, 2), (2, 1), (4, 8), (8, 4)])
@pytest.mark.parametrize("prefix_blocks", [0, 1, 2])
def test_hybrid_state_arrives_with_partial_and_full_d_hits(p_tp: int, d_tp: int, prefix_blocks: int) -> None:
    """32 tokens shipped, D holds 0, 16 or all 32 of them: every D rank still gets P's state
    (run_scenario checks the bytes), so it reads from each of its source ranks."""
    side = Side(p_tp, 16, 16), Side(d_tp, 16, 16)
    read_from = run_scenario(TINY_HYBRID, *side, 32, prefix_blocks, 11)
    assert read_from == [list(compute_tp_mapping(TINY_HYBRID, d_tp, d, p_tp).source_ranks)
                         for d in range(d_tp)]


def test_hybrid_tp_4_8_reads_each_d_rank_from_one_p_rank() -> None:
    # D ranks 1, 2, 5, 6 used to read the replicated B/C conv groups from a second P rank
    assert run_scenario(TINY_HYBRID, Side(4, 16, 16), Side(8, 16, 16), 40, 0, 12) == [
        [0], [0], [1], [1], [2], [2], [3], [3]]
    assert consumers_per_producer(TINY_HYBRID, 4, 8) == (2, 2, 2, 2)
    assert run_scenario(TINY_HYBRID, Side(8, 16, 16), Side(4, 16, 16), 40, 0, 13) == [
        [0, 1], [2, 3], [4, 5], [6, 7]]
    assert consumers_per_producer(TINY_HYBRID, 8, 4) == (1,) * 8


# ---------------------------------------------------------------------------------------
# page orders: vLLM CPU attention pages (K/V split, transposed or AMX-tiled inside a head)
# ---------------------------------------------------------------------------------------
ORDER_TP_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4)]
# vLLM's vec16 kernel stores the vec order for blocks and head sizes that are not multiples of 32
ORDER_KERNEL_BLOCKS = {"vllm_cpu_vec": st.sampled_from([16, 32, 48, 64, 128])}
ORDER_HEAD_DIMS = {"vllm_cpu_vec": st.sampled_from([32, 64, 80])}
# element types per order: fp8 KV caches are 1-byte elements in vLLM's vec and amx orders
ORDER_DTYPES = {"vllm_cpu_amx": ["bfloat16", "fp8_e4m3"], "vllm_cpu_vec": ["float32", "bfloat16", "fp8_e4m3"]}


@st.composite
def order_models(draw: st.DrawFn, order: str) -> ModelSpec:
    dtype = draw(st.sampled_from(ORDER_DTYPES.get(order, ["float32", "bfloat16"])))
    mix = draw(st.sampled_from(["full", "full+sliding"]))
    groups: tuple[GroupSpec, ...] = (FullAttention(),)
    if mix == "full+sliding":
        groups = (FullAttention(), SlidingWindow(window=draw(st.integers(1, 200))))
    layers = draw(st.integers(len(groups), 2))
    return ModelSpec(name=mix, num_kv_heads=draw(st.sampled_from([2, 4])),
                     head_dim=draw(ORDER_HEAD_DIMS.get(order, st.sampled_from([32, 64]))), dtype=dtype, groups=groups,
                     layer_groups=tuple(i % len(groups) for i in range(layers)))


@st.composite
def order_sides(draw: st.DrawFn, tp: int, order: str) -> Side:
    kernel = draw(ORDER_KERNEL_BLOCKS.get(order, st.sampled_from([32, 64, 128])))
    return Side(tp, kernel * draw(st.sampled_from([1, 2])), kernel)


@pytest.mark.parametrize(("p_tp", "d_tp"), ORDER_TP_PAIRS)
@pytest.mark.parametrize("order", ["token_major", "vllm_cpu_vec", "vllm_cpu_amx"])
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_page_orders_are_byte_exact(order: str, p_tp: int, d_tp: int, data: st.DataObject) -> None:
    """Both sides lay pages out in `order` (the simulator through `element_index`); any pair
    of kernel block sizes from {32, 64, 128} (`vllm_cpu_vec`: also 16 and 48, with head dim
    80 too: vLLM's vec16 shapes), fp8 elements too, any D prefix hit, any token count."""
    model = data.draw(order_models(order), "model")
    p, d = data.draw(order_sides(p_tp, order), "P"), data.draw(order_sides(d_tp, order), "D")
    event("same kernel blocks" if p.kernel_block_size == d.kernel_block_size
          else "P smaller" if p.kernel_block_size < d.kernel_block_size else "P larger")
    shipped = data.draw(st.one_of(st.integers(0, 400), st.sampled_from([31, 33, 95, 127, 129, 257])), "shipped")
    prefix_blocks = data.draw(st.integers(0, shipped // d.block_size), "prefix blocks")
    run_scenario(model, p, d, shipped, prefix_blocks, data.draw(st.integers(0, 2**16), "seed"), order)


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("order", ["vllm_cpu_vec", "vllm_cpu_amx"])
@pytest.mark.parametrize(("p_kbs", "d_kbs"), [(32, 128), (128, 32), (64, 32), (32, 64)])
def test_page_orders_hand_picked(order: str, p_kbs: int, d_kbs: int, dtype: str) -> None:
    model = ModelSpec("o", 4, 32, dtype, (FullAttention(),), (0, 0))
    run_scenario(model, Side(1, p_kbs, p_kbs), Side(2, 2 * d_kbs, d_kbs), 300, 1, 21, order)
    run_scenario(model, Side(2, 2 * p_kbs, p_kbs), Side(1, d_kbs, d_kbs), 97, 0, 22, order)


@pytest.mark.parametrize(("p_kbs", "d_kbs"), [(16, 32), (32, 16), (16, 128), (48, 16)])
def test_vec16_shapes_are_byte_exact(p_kbs: int, d_kbs: int) -> None:
    """vLLM's vec16 kernel: head size 80 (not a multiple of 32) and blocks of 16 or 48 tokens,
    stored in the vec order; fp32 and fp8 elements."""
    for dtype, seed in (("float32", 31), ("fp8_e4m3", 32)):
        model = ModelSpec("v16", 2, 80, dtype, (FullAttention(),), (0, 0, 0))
        run_scenario(model, Side(1, p_kbs, p_kbs), Side(1, d_kbs, d_kbs), 150, 1, seed, "vllm_cpu_vec")
        run_scenario(model, Side(2, 2 * p_kbs, p_kbs), Side(1, d_kbs, d_kbs), 47, 0, seed + 10, "vllm_cpu_vec")
