"""Staged reads against the byte-level simulator: P pages → staging (the READ, as byte copies)
→ D pages (the re-layout), then D's KV read back through D's own geometry."""

from __future__ import annotations

import numpy as np
import pytest
import sim
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlink.layout.conv_state import conv_layouts, conv_transpose, planning_view, with_conv_layouts
from kvlink.layout.geometry import Region, WorkerGeometry, packed_base_addrs
from kvlink.layout.page_order import element_index
from kvlink.layout.relayout import copy_token_runs, page_views, token_axes
from kvlink.layout.spec import (
    GDN,
    FullAttention,
    GroupSpec,
    Mamba2,
    ModelSpec,
    SlidingWindow,
    is_ssm,
)
from kvlink.plan.compat import IncompatibleLayout
from kvlink.plan.staged import build_staged_plan, needs_staging, staging_geometry

ORDERS = ["vllm_cpu_vec", "vllm_cpu_amx"]
UINT = {2: np.uint16, 4: np.uint32}


def _pages(mem: sim.WorkerMemory, region: Region) -> np.ndarray:
    e = mem.geometry.model.dtype_bytes
    lo = region.base - mem.start
    raw = mem.data[lo: lo + region.num_pages * region.page_stride]
    return raw.view(UINT[e]).reshape(region.num_pages, region.units, region.unit_bytes // e)


def _staging_memory(geometry: WorkerGeometry, slots: int, k: int, rng: np.random.Generator) -> sim.WorkerMemory:
    start = sim.MEMORY_STRIDE * 40
    bases = packed_base_addrs(geometry.model, geometry.tp_size, k, k, slots, start, align=64)
    staging = staging_geometry(geometry, k, slots, bases)
    size = max(r.end for r in staging.regions) - start
    return sim.WorkerMemory(staging, start, rng.integers(0, 256, size, dtype=np.uint8),
                            np.zeros(size, dtype=np.int32))


@st.composite
def cases(draw: st.DrawFn) -> dict:
    order = draw(st.sampled_from(ORDERS))
    amx = order == "vllm_cpu_amx"
    kernel = st.sampled_from([32, 64, 128] if amx else [4, 8, 16, 32, 64, 128])
    p_kbs, d_kbs = draw(kernel), draw(kernel.filter(lambda x: True))
    if p_kbs == d_kbs:
        d_kbs = p_kbs * 2
    heads = draw(st.sampled_from([1, 2, 3, 4]))
    tps = [t for t in (1, 2, 4) if heads % t == 0 or t % heads == 0]
    layers = draw(st.integers(1, 4))
    mix = draw(st.sampled_from(["full", "full", "full+sliding", "sliding", "full+mamba2", "full+gdn"]))
    groups: list[GroupSpec] = [FullAttention()] if mix != "sliding" else []
    if "sliding" in mix:  # vLLM's hybrid KV cache: one group per window, local and global layers apart
        groups.append(SlidingWindow(window=draw(st.integers(1, 300))))
    conv = draw(st.sampled_from(["DS", "SD"]))
    if mix == "full+mamba2":  # a hybrid: the state page goes whole, into the last staging slot
        groups.append(Mamba2(num_heads=draw(st.sampled_from([1, 2, 4])), head_dim=2,
                             n_groups=draw(st.sampled_from([1, 2])), d_state=2,
                             conv_kernel=draw(st.integers(2, 4)), conv_layout=conv))
    if mix == "full+gdn":
        k_heads = draw(st.sampled_from([1, 2, 4]))
        groups.append(GDN(num_k_heads=k_heads, num_v_heads=2 * k_heads, head_k_dim=2, head_v_dim=3,
                          conv_kernel=draw(st.integers(2, 4)), conv_layout=conv))
    layer_groups = [draw(st.integers(0, len(groups) - 1)) for _ in range(layers)]
    layer_groups[: len(groups)] = range(len(groups))  # every group holds a layer
    return {
        "order": order, "p_kbs": p_kbs, "d_kbs": d_kbs,
        "p_ppl": draw(st.sampled_from([1, 2])), "d_ppl": draw(st.sampled_from([1, 2])),
        "heads": heads, "head_dim": 32 if amx else draw(st.sampled_from([1, 4, 32])),
        "dtype": "bfloat16" if amx else draw(st.sampled_from(["float32", "bfloat16"])),
        "groups": tuple(groups), "layer_groups": tuple(layer_groups),
        "p_tp": draw(st.sampled_from(tps)),
        "d_conv": draw(st.sampled_from(["", "", "DS", "SD"])),  # D keeps its conv state in this layout
        "d_tp": draw(st.sampled_from(tps)), "shipped": draw(st.integers(0, 400)),
        "prefix": draw(st.floats(0, 1)), "seed": draw(st.integers(0, 2**16)),
    }


def _null_before_window(model: ModelSpec, lists: list[np.ndarray], block_size: int, first_token: int,
                        shipped: int) -> list[np.ndarray]:
    """Blocks (listed from `first_token`) wholly behind a sliding group's window hold no memory:
    vLLM's P freed them, its D never gave them any (-1 here, never to be read or written)."""
    out = []
    for ids, group in zip(lists, model.groups, strict=True):
        if isinstance(group, SlidingWindow):
            ends = first_token + (np.arange(ids.size) + 1) * block_size
            ids = np.where(ends <= shipped - group.window, -1, ids)
        out.append(ids)
    return out


def run_staged(c: dict) -> None:
    rng = np.random.default_rng(c["seed"])
    groups = c.get("groups", (FullAttention(),))
    layer_groups = c.get("layer_groups", (0,) * c.get("layers", 1))
    model = ModelSpec("staged", c["heads"], c["head_dim"], c["dtype"], groups, layer_groups)
    G = len(groups)
    p_bs, d_bs = c["p_kbs"] * c["p_ppl"], c["d_kbs"] * c["d_ppl"]
    shipped = c["shipped"]
    prompt = shipped + 1
    computed = int(c["prefix"] * (shipped // d_bs)) * d_bs
    p_count, d_count = -(-prompt // p_bs), -(-prompt // d_bs)
    p_num, d_num = G * p_count + 2, G * d_count + 2
    logical = sim.make_logical(model, shipped, rng)
    p_perm, d_perm = rng.permutation(p_num), rng.permutation(d_num)  # each group its own blocks
    p_ids = _null_before_window(model, [p_perm[g * p_count:(g + 1) * p_count] for g in range(G)], p_bs, 0, shipped)
    d_tail = _null_before_window(model, [d_perm[g * d_count:(g + 1) * d_count][computed // d_bs:] for g in range(G)],
                                 d_bs, computed, shipped)
    p_tokens = [np.flatnonzero(np.repeat(ids >= 0, p_bs)[:shipped]) for ids in p_ids]
    must_start = [max(computed, shipped - g.window) if isinstance(g, SlidingWindow) else computed for g in groups]
    sources = {}
    for rank in range(c["p_tp"]):
        mem = sim.make_worker(model, c["p_tp"], rank, p_bs, c["p_kbs"], p_num, 0, rng, c["order"])
        sim.store(mem, logical, p_ids, p_tokens)
        sources[rank] = mem
    d_conv = c.get("d_conv") or ""
    d_model = with_conv_layouts(model, dict.fromkeys(conv_layouts(model), d_conv)) if d_conv else model
    for rank in range(c["d_tp"]):
        own = sim.make_worker(d_model, c["d_tp"], rank, d_bs, c["d_kbs"], d_num, 1, rng, c["order"])
        # as the connector plans: D's memory (and its staging pool) described in P's conv layout
        reader = sim.WorkerMemory(planning_view(own.geometry, model), own.start, own.data, own.writes)
        assert needs_staging(reader.geometry, sources[0].geometry)
        before = reader.data.copy()
        slots_total = -(-prompt // c["p_kbs"]) + 3
        pool = _staging_memory(own.geometry, slots_total, c["p_kbs"], rng)
        staging = sim.WorkerMemory(planning_view(pool.geometry, model), pool.start, pool.data, pool.writes)
        plan = build_staged_plan(reader.geometry, staging.geometry,
                                 {r: sources[r].geometry for r in plan_sources(reader, sources)})
        need = plan.slots_needed(shipped, computed)
        slots = rng.permutation(slots_total)[:need].tolist()
        req = plan.request(d_tail, p_ids, shipped, computed, slots)
        sim.execute(plan.read, _as_staging(req, slots, G), staging, sources)
        for s_reg, d_reg in zip(staging.geometry.attention_regions, reader.geometry.attention_regions,
                                strict=True):
            copy_token_runs(_pages(staging, s_reg), c["p_kbs"], _pages(reader, d_reg), c["d_kbs"],
                            c["order"], model.head_dim, req.runs[d_reg.group])
        for src, dst, nbytes in req.states:  # the state pages, whole (as the connector copies them)
            reader.data[dst - reader.start: dst - reader.start + nbytes] = \
                staging.data[src - staging.start: src - staging.start + nbytes]
        transpose = conv_transpose(own.geometry, reader.geometry)
        assert (transpose is not None) == (d_model != model)
        if transpose is not None:  # then into D's own conv layout, in place
            blocks = {g: [b for s in req.specs for b in s.local_blocks[g].tolist()] for g in transpose.groups}
            transpose.apply(blocks, lambda a, n, m=own: m.data[a - m.start: a - m.start + n])
        reader = own
        outside = ~sim.destination_mask(reader, d_tail)
        assert np.array_equal(reader.data[outside], before[outside]), "bytes outside D's blocks changed"
        region = reader.geometry.attention_regions[0]
        per_token = region.units * region.token_bytes
        layers_of = [layer_groups.count(g) for g in range(G)]
        state_bytes = sum(r.page_len for r in reader.geometry.ssm_regions)
        hybrid = any(is_ssm(g) for g in groups)
        assert req.relayout_bytes == state_bytes * (shipped > 0) + sum(
            int(r[:, 4].sum()) * per_token * n for r, n in zip(req.runs, layers_of, strict=True))
        assert len(req.states) == len(reader.geometry.ssm_regions) * (shipped > 0)
        if shipped > computed or (hybrid and shipped > 0):
            tokens = [np.arange(must_start[g], shipped, dtype=np.int64) for g in range(G)]
            got = sim.load(reader, d_tail, tokens, computed)
            want = sim.expected_for(reader, sim.in_conv_layouts(logical, model, d_model), tokens)
            for layer, rows in want.rows.items():
                np.testing.assert_array_equal(got.rows[layer], rows, err_msg=f"layer {layer}")
            for key, state in want.ssm.items():
                np.testing.assert_array_equal(got.ssm[key], state, err_msg=f"ssm {key}")
            for g in range(G):  # the copies cover what D needs, and no more than a chunk either side
                if is_ssm(groups[g]):
                    continue
                copied = int(req.runs[g][:, 4].sum())
                want_tokens = max(0, shipped - must_start[g])
                assert want_tokens <= copied < want_tokens + 2 * c["d_kbs"] or copied == want_tokens == 0
            assert len(req.slots) <= max(1, -(-(shipped - min(must_start)) // c["p_kbs"]) + 1)
        else:
            assert not req.copies and not req.slots
            assert all(not len(s.local_idx) for s in req.specs)


def plan_sources(reader: sim.WorkerMemory, sources: dict) -> list[int]:
    from kvlink.plan.tp_mapping import compute_tp_mapping
    g = reader.geometry
    return list(compute_tp_mapping(g.model, g.tp_size, g.tp_rank, len(sources)).source_ranks)


def _as_staging(req, slots, groups=1):  # the READ specs name staging slots; the sim checks them as blocks
    return [type(s)(s.src_rank, s.local_idx, s.remote_idx, s.nbytes, (np.asarray(slots, dtype=np.int64),) * groups)
            for s in req.specs]


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(c=cases())
def test_staged_read_is_byte_exact(c: dict) -> None:
    run_staged(c)


@pytest.mark.parametrize("order", ["token_major", *ORDERS])
@pytest.mark.parametrize(("n", "m"), [(32, 128), (128, 32), (64, 32)])
def test_copy_token_runs_moves_logical_elements(order: str, n: int, m: int) -> None:
    """Every element lands where element_index puts it on the other page size."""
    D, units = 32, 2
    rng = np.random.default_rng(n * m)
    src = rng.integers(0, 2**15, (3, units, 2 * n * D)).astype(np.uint16)
    dst = np.zeros((4, units, 2 * m * D), dtype=np.uint16)
    runs = np.array([[1, 0, 2, 0, 32], [2, n - 32, 0, m - 32, 32]], dtype=np.int64)
    copy_token_runs(src, n, dst, m, order, D, runs)
    part, tok, dim = np.meshgrid([0, 1], np.arange(32), np.arange(D), indexing="ij")
    for s_page, s_tok, d_page, d_tok, _ in runs:
        for u in range(units):
            got = dst[d_page, u][element_index(order, m, D, part, tok + d_tok, dim)]
            want = src[s_page, u][element_index(order, n, D, part, tok + s_tok, dim)]
            np.testing.assert_array_equal(got, want)
    written = np.zeros_like(dst, dtype=bool)
    for _, _, d_page, d_tok, count in runs:
        p, t, k = np.meshgrid([0, 1], np.arange(d_tok, d_tok + count), np.arange(D), indexing="ij")
        written[d_page, :, element_index(order, m, D, p, t, k).reshape(-1)] = True
    assert not dst[~written].any(), "an element outside the runs was written"


def test_copy_token_runs_with_leading_layer_axis() -> None:
    src = np.arange(2 * 2 * 1 * 2 * 32 * 4, dtype=np.uint32).reshape(2, 2, 1, 2 * 32 * 4)
    dst = np.zeros((2, 1, 1, 2 * 64 * 4), dtype=np.uint32)
    copy_token_runs(src, 32, dst, 64, "vllm_cpu_vec", 4, np.array([[1, 0, 0, 32, 32]]))
    for layer in range(2):
        k_src, v_src = page_views(src[layer], "vllm_cpu_vec", 32, 4)
        k_dst, v_dst = page_views(dst[layer], "vllm_cpu_vec", 64, 4)
        np.testing.assert_array_equal(k_dst[0, :, :, 32:], k_src[1])
        np.testing.assert_array_equal(v_dst[0, :, 32:, :], v_src[1])
        assert not k_dst[0, :, :, :32].any()


def test_token_axes_match_element_index() -> None:
    for order in ["token_major", *ORDERS]:
        n, d = 64, 32
        unit = np.arange(2 * n * d)
        (parts) = token_axes(order, n, d)
        views = page_views(unit.reshape(1, 1, -1), order, n, d)
        assert len(views) == len(parts)
        seen = np.concatenate([v.reshape(-1) for v in views])
        assert np.array_equal(np.sort(seen), unit), order


def test_copy_token_runs_refuses_bad_runs() -> None:
    src = np.zeros((2, 1, 2 * 32 * 32), dtype=np.uint16)
    dst = np.zeros((2, 1, 2 * 64 * 32), dtype=np.uint16)
    for bad in ([0, 0, 0, 0, 0], [0, 16, 0, 0, 32], [2, 0, 0, 0, 32], [0, 0, 0, 48, 32]):
        with pytest.raises(ValueError):
            copy_token_runs(src, 32, dst, 64, "vllm_cpu_vec", 32, np.array([bad]))
    with pytest.raises(ValueError, match="multiples of 16"):
        copy_token_runs(src, 32, dst, 64, "vllm_cpu_amx", 32, np.array([[0, 8, 0, 0, 8]]))


def test_staging_is_only_for_what_needs_it() -> None:
    att = ModelSpec("a", 2, 32, "float32", (FullAttention(),), (0, 0))
    hybrid = ModelSpec("h", 2, 32, "float32", (FullAttention(), Mamba2(2, 2, 1, 2, 2)), (0, 1))

    def geo(model: ModelSpec, kbs: int, order: str) -> WorkerGeometry:
        mem = sim.make_worker(model, 1, 0, kbs, kbs, 4, 0, np.random.default_rng(0), order)
        return mem.geometry

    assert needs_staging(geo(att, 32, "vllm_cpu_vec"), geo(att, 128, "vllm_cpu_vec"))
    assert not needs_staging(geo(att, 32, "vllm_cpu_vec"), geo(att, 32, "vllm_cpu_vec"))
    assert not needs_staging(geo(att, 32, "token_major"), geo(att, 128, "token_major"))
    assert needs_staging(geo(hybrid, 32, "vllm_cpu_vec"), geo(hybrid, 128, "vllm_cpu_vec"))
    assert not needs_staging(geo(hybrid, 32, "vllm_cpu_vec"), geo(hybrid, 32, "vllm_cpu_vec"))


def test_staged_plan_refuses_chunks_below_the_granule() -> None:
    model = ModelSpec("a", 1, 32, "bfloat16", (FullAttention(),), (0,))
    rng = np.random.default_rng(0)
    d = sim.make_worker(model, 1, 0, 32, 32, 4, 0, rng, "vllm_cpu_amx")
    p = sim.make_worker(model, 1, 0, 96, 96, 4, 1, rng, "vllm_cpu_amx")
    staging = _staging_memory(d.geometry, 2, 96, rng)
    build_staged_plan(d.geometry, staging.geometry, {0: p.geometry})  # gcd 32: fine
    assert needs_staging(d.geometry, p.geometry)
    with pytest.raises((IncompatibleLayout, ValueError)):
        q = sim.make_worker(model, 1, 0, 48, 48, 4, 1, rng, "vllm_cpu_amx")
        build_staged_plan(d.geometry, _staging_memory(d.geometry, 2, 48, rng).geometry, {0: q.geometry})
