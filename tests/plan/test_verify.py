"""Property test: P's digests of its shipped units, checked by every D rank over the bytes its
plan moved, match on a correct transfer and name the unit when one byte differs."""

from __future__ import annotations

import numpy as np
import pytest
import sim
from hypothesis import given
from hypothesis import strategies as st
from test_sim import (
    MIXES,
    SETTINGS,
    TP_PAIRS,
    _block_lists,
    _blocks_for,
    _null_out_of_window,
    _valid,
    models,
    sides,
)

from kvlink.connector.integrity import UnitViews, check, seal, unit_views
from kvlink.layout.digests import block_seeds, digest_geometry
from kvlink.layout.spec import ModelSpec, SlidingWindow
from kvlink.plan.request import first_token_to_ship
from kvlink.plan.transfer_plan import build_transfer_plan
from kvlink.plan.verify import VerifySpec, verify_spec


def _memory(mem: sim.WorkerMemory):  # type: ignore[no-untyped-def]
    return lambda addr, n: mem.data[addr - mem.start: addr - mem.start + n]


def _slices(table: np.ndarray, spec: VerifySpec) -> np.ndarray:
    """What D's digest READ brings back: each listed slice, padded to one width."""
    layout = spec.layout
    width = 1 + max(layout.group_units, default=0)
    out = np.zeros((spec.slice_block.size, width), dtype=np.uint64)
    for i, (group, block) in enumerate(zip(spec.slice_group.tolist(), spec.slice_block.tolist(), strict=True)):
        start = layout.group_offsets[group]
        out[i, :1 + layout.group_units[group]] = table[block, start:start + 1 + layout.group_units[group]]
    return out


def run_checked(model: ModelSpec, p, d, shipped: int, prefix_blocks: int, seed: int,  # type: ignore[no-untyped-def]
                page_order: str = "token_major") -> None:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 50_000, shipped + 1)
    computed = prefix_blocks * d.block_size
    p_count, d_count = _blocks_for(shipped + 1, p.block_size), _blocks_for(shipped + 1, d.block_size)
    p_num_blocks, d_num_blocks = p_count + 2, d_count + 2
    logical = sim.make_logical(model, shipped, rng)
    p_ids = _block_lists(model, p, p_num_blocks, p_count, 0, rng)
    _null_out_of_window(model, p_ids, p.block_size, shipped)
    p_tokens = [np.flatnonzero(np.repeat(ids >= 0, p.block_size)[:shipped]) if not sim.group_is_ssm(model, g)
                else np.zeros(0, dtype=np.int64) for g, ids in enumerate(p_ids)]
    seeds = block_seeds(prompt, p.block_size, shipped)
    sources, tables = {}, {}
    for rank in range(p.tp):
        mem = sim.make_worker(model, p.tp, rank, p.block_size, p.kernel_block_size, p_num_blocks, 0, rng,
                              page_order)
        sim.store(mem, logical, p_ids, p_tokens)
        dg = digest_geometry(mem.geometry)
        tables[rank] = np.zeros((dg.layout.num_blocks, dg.layout.row_entries), dtype=np.uint64)
        seal(tables[rank], dg, _memory(mem), [ids.tolist() for ids in p_ids], shipped, seeds)
        sources[rank] = mem
    geometries = {rank: mem.geometry for rank, mem in sources.items()}
    digests = {rank: digest_geometry(g) for rank, g in geometries.items()}
    d_ids = _block_lists(model, d, d_num_blocks, d_count, prefix_blocks, rng)
    sliding = any(isinstance(g, SlidingWindow) for g in model.groups)
    for rank in range(d.tp):
        reader = sim.make_worker(model, d.tp, rank, d.block_size, d.kernel_block_size, d_num_blocks, 1, rng,
                                 page_order)
        plan = build_transfer_plan(reader.geometry, geometries)
        specs = plan.request_ids(d_ids, p_ids, shipped, computed)
        memory = _memory(reader)
        firsts = [first_token_to_ship(plan, g, shipped, computed) for g in range(len(model.groups))]
        vspecs = [verify_spec(spec.src_rank, digests[spec.src_rank], plan.source(spec.src_rank).local_descs,
                              plan.source(spec.src_rank).remote_descs, spec.local_idx, spec.remote_idx, p_ids,
                              shipped, firsts) for spec in specs]
        # D looks up the bytes of its units while the READ runs: views taken before it must see what landed
        early = [unit_views(vspec, memory) for vspec in vspecs]
        sim.execute(plan, specs, reader, sources)
        for spec, vspec, views in zip(specs, vspecs, early, strict=True):
            source = plan.source(spec.src_rank)
            few = verify_spec(spec.src_rank, digests[spec.src_rank], source.local_descs, source.remote_descs,
                              spec.local_idx, spec.remote_idx, p_ids, shipped, firsts, (rng, 2))
            assert few.units == min(2, vspec.units) and np.array_equal(few.slice_block, vspec.slice_block)
            assert set(zip(few.unit_slice.tolist(), few.unit_slot.tolist(), strict=True)) <= set(
                zip(vspec.unit_slice.tolist(), vspec.unit_slot.tolist(), strict=True))
            assert check(few, _slices(tables[spec.src_rank], few), seeds, memory).ok
            slices = _slices(tables[spec.src_rank], vspec)
            result = check(vspec, slices, seeds, memory)
            assert result.ok, (result.unsealed[:3], result.mismatches[:3])
            assert result.units == vspec.units and result.hashed_bytes == vspec.checked_bytes
            assert check(vspec, slices, seeds, memory, views) == result
            if computed % p.kernel_block_size == 0 and not sliding and page_order == "token_major":
                assert vspec.unverifiable == 0, "a unit read whole was not checked"
                if len(spec.local_idx):
                    assert vspec.units > 0
            if vspec.units:
                _assert_flip_caught(vspec, slices, seeds, reader, rng)
                _assert_flip_caught(vspec, slices, seeds, reader, rng, views)
                other = block_seeds(prompt[::-1].copy(), p.block_size, shipped)
                stale = check(vspec, slices, other, memory)
                assert len(stale.unsealed) == vspec.slice_block.size and not stale.mismatches
                assert check(vspec, slices, other, memory, views) == stale
                _assert_some_unsealed_rest_checked(vspec, slices, seeds, memory, views, rng)


def _assert_some_unsealed_rest_checked(vspec: VerifySpec, slices: np.ndarray, seeds: list[int], memory,  # type: ignore[no-untyped-def]
                                       views: UnitViews, rng: np.random.Generator) -> None:
    """A slice not sealed for us yet: its units wait, every other unit is judged, with or
    without the views looked up before."""
    unsealed = slices.copy()
    s = int(rng.integers(0, unsealed.shape[0]))
    unsealed[s, 0] ^= np.uint64(1)
    plain = check(vspec, unsealed, seeds, memory)
    assert plain.unsealed == [(int(vspec.slice_group[s]), int(vspec.slice_index[s]))] and not plain.mismatches
    assert plain.units == int(np.count_nonzero(vspec.unit_slice != s))
    assert check(vspec, unsealed, seeds, memory, views) == plain


def _assert_flip_caught(vspec: VerifySpec, slices: np.ndarray, seeds: list[int], reader: sim.WorkerMemory,
                        rng: np.random.Generator, views: UnitViews | None = None) -> None:
    unit = int(rng.integers(0, vspec.units))
    piece = int(rng.integers(vspec.piece_starts[unit], vspec.piece_starts[unit + 1]))
    at = int(vspec.piece_addr[piece]) - reader.start + int(rng.integers(0, vspec.piece_len[piece]))
    reader.data[at] ^= 0x40
    try:
        result = check(vspec, slices, seeds, _memory(reader), views)
    finally:
        reader.data[at] ^= 0x40
    slot = int(vspec.unit_slot[unit]) - 1
    s = int(vspec.unit_slice[unit])
    assert [(m[0], m[1], m[2]) for m in result.mismatches] == [
        (int(vspec.slice_group[s]), int(vspec.slice_index[s]), slot)]


@pytest.mark.parametrize(("p_tp", "d_tp"), [pair for pair in TP_PAIRS if max(pair) <= 4])
@pytest.mark.parametrize("mix", MIXES)
@SETTINGS
@given(data=st.data())
def test_digests_check_what_moved(mix: str, p_tp: int, d_tp: int, data: st.DataObject) -> None:
    model = data.draw(models(mix), "model")
    p, d = data.draw(sides(p_tp), "P"), data.draw(sides(d_tp), "D")
    if not _valid(model, p, d):
        return
    shipped = data.draw(st.integers(0, 200), "shipped")
    prefix_blocks = data.draw(st.integers(0, shipped // d.block_size), "prefix blocks")
    run_checked(model, p, d, shipped, prefix_blocks, data.draw(st.integers(0, 2**16), "seed"))


@pytest.mark.parametrize("order", ["vllm_cpu_vec", "vllm_cpu_amx"])
def test_vllm_page_orders_digest_whole_units(order: str) -> None:
    """vLLM's CPU pages keep a head's tokens in many runs: the digest covers the whole unit,
    which a reader of whole pages (vLLM's plans) checks, the last page included."""
    from test_sim import Side

    from kvlink.layout.spec import FullAttention
    model = ModelSpec("v", 4, 32, "bfloat16", (FullAttention(),), (0, 0, 0))
    for p_tp, d_tp in ((1, 1), (2, 1), (1, 2)):
        for shipped in (1, 31, 32, 33, 100):
            run_checked(model, Side(p_tp, 32, 32), Side(d_tp, 32, 32), shipped, 0, shipped, order)
