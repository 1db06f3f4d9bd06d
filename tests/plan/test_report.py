"""`plan_report` figures: merged descriptors as NIXL merges them, transfers in documented order."""

from __future__ import annotations

from typing import Any

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvlink.layout.presets import PRESETS, TINY_HYBRID
from kvlink.plan.compat import IncompatibleLayout
from kvlink.plan.report import EngineConfig, plan_report


def nixl_merged(transfers: list[dict[str, int]]) -> int:
    """Brute force of NIXL's merge, one transfer per source rank: a descriptor joins the one
    before it only in the same READ, inside the same registered region on both sides, and
    starting where it ended on both sides."""
    merged = 0
    previous: dict[str, int] | None = None
    for t in transfers:
        joins = previous is not None and all((
            previous["src_rank"] == t["src_rank"],
            previous["src_region"] == t["src_region"], previous["dst_region"] == t["dst_region"],
            previous["src_offset"] + previous["length"] == t["src_offset"],
            previous["dst_offset"] + previous["length"] == t["dst_offset"],
        ))
        merged += 0 if joins else 1
        previous = t
    return merged


def test_mla_layers_packed_back_to_back_do_not_merge_across_layers() -> None:
    config = EngineConfig(tp=4, block_size=16, kernel_block_size=16)
    report = plan_report(PRESETS["deepseek-mla"], config, EngineConfig(1, 16, 16), prompt_tokens=20,
                         with_transfers=True)
    (rank,) = report["d_ranks"]
    # 19 tokens = 2 blocks in each of 61 layers; each engine holds exactly those 2 blocks, so
    # layer l ends where layer l + 1 begins, but every layer is its own NIXL registration
    assert (rank["descriptors"], rank["merged_descriptors"]) == (122, 61)
    assert nixl_merged(rank["transfers"]) == 61


@st.composite
def engine_configs(draw: st.DrawFn) -> EngineConfig:
    block_size = draw(st.sampled_from([8, 16, 32]))
    return EngineConfig(draw(st.sampled_from([1, 2, 4])), block_size, block_size // draw(st.sampled_from([1, 2])))


@settings(max_examples=100, deadline=None)
@given(name=st.sampled_from(sorted(PRESETS)), p=engine_configs(), d=engine_configs(),
       tokens=st.integers(1, 90), prefix_blocks=st.integers(0, 3),
       scatter=st.one_of(st.none(), st.integers(0, 3)))
def test_merged_descriptors_match_a_brute_force_count(name: str, p: EngineConfig, d: EngineConfig, tokens: int,
                                                      prefix_blocks: int, scatter: int | None) -> None:
    computed = min(prefix_blocks * d.block_size, (tokens - 1) // d.block_size * d.block_size)
    try:
        report = plan_report(PRESETS[name], p, d, tokens, computed, scatter, with_transfers=True)
    except IncompatibleLayout:
        assume(False)
        raise
    for rank in report["d_ranks"]:
        assert rank["merged_descriptors"] == nixl_merged(rank["transfers"])
        assert rank["descriptors"] == len(rank["transfers"])


def _token_and_head(t: dict[str, int], region: dict[str, Any], config: EngineConfig, units: int) -> tuple[int, int]:
    """Token and head a D attention piece starts at (consecutive block ids from 0)."""
    unit_bytes = region["page_len"] // units
    kernel_block, in_page = divmod(t["dst_offset"], region["page_stride"])
    head, in_unit = divmod(in_page, unit_bytes)
    return kernel_block * config.kernel_block_size + in_unit // (unit_bytes // config.kernel_block_size), head


def test_transfers_follow_the_documented_order() -> None:
    # D rank 0 reads from two P ranks; per-head pieces (kernel blocks 16 vs 8); SSM layers interleaved
    p, d = EngineConfig(2, 32, 16), EngineConfig(1, 16, 8)
    report = plan_report(TINY_HYBRID, p, d, prompt_tokens=40, with_transfers=True)
    (rank,) = report["d_ranks"]
    transfers = rank["transfers"]
    regions = report["d"]["workers"][0]["regions"]
    # grouped by source rank, ascending: one READ per source rank
    sources = [t["src_rank"] for t in transfers]
    assert sources == sorted(sources) and sorted(set(sources)) == rank["source_ranks"] == [0, 1]
    for src in (0, 1):
        mine = [t for t in transfers if t["src_rank"] == src]
        kinds = [regions[t["dst_region"]]["kind"] for t in mine]
        # attention first, then SSM, though the layers alternate attention / SSM
        assert kinds == sorted(kinds, key=lambda k: k == "ssm") and {"attention", "ssm"} == set(kinds)
        attention = [t for t, k in zip(mine, kinds, strict=True) if k == "attention"]
        ssm = [t for t, k in zip(mine, kinds, strict=True) if k == "ssm"]
        # group by group, region-major, then by token chunk, then by head
        keys = [(regions[t["dst_region"]]["group"], t["dst_region"],
                 *_token_and_head(t, regions[t["dst_region"]], d, TINY_HYBRID.num_kv_heads))
                for t in attention]
        assert keys == sorted(keys) and len(set(keys)) == len(keys)
        assert {k[3] for k in keys} == {2 * src, 2 * src + 1}  # this source's heads, one piece each
        # per SSM layer: conv parts, then the state (in page order)
        ssm_keys = [(t["dst_region"], t["dst_offset"]) for t in ssm]
        assert ssm_keys == sorted(ssm_keys) and len(ssm) == 2 * 4
