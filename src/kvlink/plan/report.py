"""A whole P/D configuration planned end to end on fake addresses, as plain data (for `kvlink plan`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlink.layout.geometry import Region, WorkerGeometry, build_worker_geometry, packed_base_addrs
from kvlink.layout.limits import BLOCK_SIZE, TOKENS, TP, bounded, check, check_fields, int_range
from kvlink.layout.spec import ModelSpec, is_ssm
from kvlink.plan.budget import DESCRIPTOR_BYTES, check_plan_bytes, plan_bytes
from kvlink.plan.compat import check_configuration
from kvlink.plan.descriptors import DescArray, IntArray, count_merged, locate
from kvlink.plan.tp_mapping import consumers_per_producer
from kvlink.plan.transfer_plan import build_transfer_plan

P_ADDRESS_SPACE = 0x10_0000_0000
D_ADDRESS_SPACE = 0x20_0000_0000
RANK_ADDRESS_STRIDE = 0x1_0000_0000
# A report plans every D rank of a sample request in turn and may list each transfer:
# tighter bounds than one engine's plan, so it answers within seconds.
REPORT_MAX_PLAN_BYTES = 2**28
MAX_LISTED_TRANSFERS = 100_000


@dataclass(frozen=True)
class EngineConfig:
    tp: int = bounded(TP)
    block_size: int = bounded(BLOCK_SIZE)
    kernel_block_size: int = bounded(BLOCK_SIZE)

    def __post_init__(self) -> None:
        check_fields(self)


def blocks_for(tokens: int, block_size: int) -> int:
    return max(1, -(-tokens // block_size))


def fake_engine(model: ModelSpec, config: EngineConfig, num_blocks: int, space: int) -> list[WorkerGeometry]:
    """Every rank of an engine, tensors packed from a deterministic per-rank base address."""
    return [
        build_worker_geometry(
            model, config.tp, rank, config.block_size, config.kernel_block_size, num_blocks,
            packed_base_addrs(model, config.tp, config.block_size, config.kernel_block_size, num_blocks,
                              space + rank * RANK_ADDRESS_STRIDE),
            device_id=rank,
        )
        for rank in range(config.tp)
    ]


def sample_block_ids(model: ModelSpec, tokens: int, block_size: int, skip_blocks: int,
                     scatter_seed: int | None) -> list[list[int]]:
    """Block ids of a sample request: consecutive from 0 (best case), or shuffled."""
    count = blocks_for(tokens, block_size)
    order = np.arange(count) if scatter_seed is None else np.random.default_rng(scatter_seed).permutation(count)
    return [[count - 1] if is_ssm(g) else [int(b) for b in order[skip_blocks:]] for g in model.groups]


def region_info(region: Region) -> dict[str, Any]:
    return {"layer": region.layer, "group": region.group, "kind": region.kind, "base": region.base,
            "page_len": region.page_len, "page_stride": region.page_stride, "num_pages": region.num_pages}


def _locate(worker: WorkerGeometry, descs: DescArray) -> tuple[IntArray, IntArray]:
    """Region (= NIXL registration: one per layer tensor) and offset of each descriptor."""
    return locate(descs, [r.base for r in worker.regions])


def plan_report(model: ModelSpec, p: EngineConfig, d: EngineConfig, prompt_tokens: int,
                d_computed_tokens: int = 0, scatter_seed: int | None = None,
                with_transfers: bool = False) -> dict[str, Any]:
    """Plan every D rank for one sample request; raises IncompatibleLayout for impossible pairs."""
    check("prompt_tokens", prompt_tokens, TOKENS)
    check("d_computed_tokens", d_computed_tokens, int_range(0, prompt_tokens - 1))
    if scatter_seed is not None:
        check("scatter_seed", scatter_seed, int_range(0, 2**63 - 1))
    check_configuration(model, model, p.tp, d.tp, p.block_size, p.kernel_block_size,
                        d.block_size, d.kernel_block_size)
    shipped = max(0, prompt_tokens - 1)
    p_workers = fake_engine(model, p, blocks_for(prompt_tokens, p.block_size), P_ADDRESS_SPACE)
    d_workers = fake_engine(model, d, blocks_for(prompt_tokens, d.block_size), D_ADDRESS_SPACE)
    p_engine = dict(enumerate(p_workers))
    total_bytes = sum(plan_bytes(reader, p_engine) for reader in d_workers)
    check_plan_bytes(total_bytes, f"the plans of all {d.tp} D rank(s)", REPORT_MAX_PLAN_BYTES,
                     "plan fewer tokens, larger blocks, or kernel block sizes equal on P and D")
    # A request posts each descriptor pair at most once: at most half the listed descriptors.
    most_listed = total_bytes // (2 * DESCRIPTOR_BYTES)
    if with_transfers and most_listed > MAX_LISTED_TRANSFERS:
        raise ValueError(f"listing every transfer (--json) may take up to {most_listed} entries, more "
                         f"than {MAX_LISTED_TRANSFERS}; plan fewer tokens or leave out the list")
    p_ids = sample_block_ids(model, prompt_tokens, p.block_size, 0, scatter_seed)
    d_ids = sample_block_ids(model, prompt_tokens, d.block_size, d_computed_tokens // d.block_size,
                             scatter_seed)
    ranks = []
    for reader in d_workers:
        plan = build_transfer_plan(reader, p_engine)
        specs = plan.request_ids(d_ids, p_ids, shipped, d_computed_tokens)
        entry: dict[str, Any] = {
            "rank": reader.tp_rank, "source_ranks": [s.src_rank for s in specs if len(s.local_idx)],
            "notify_ranks": list(plan.mapping.notify_ranks), "chunk_tokens": plan.chunk_tokens,
            "descriptors": 0, "merged_descriptors": 0, "bytes": 0, "transfers": [],
        }
        for spec in specs:
            source = plan.source(spec.src_rank)
            local, remote = source.local_descs[spec.local_idx], source.remote_descs[spec.remote_idx]
            dst_region, dst_offset = _locate(reader, local)
            src_region, src_offset = _locate(p_workers[spec.src_rank], remote)
            entry["descriptors"] += len(local)
            entry["merged_descriptors"] += count_merged(local, remote, dst_region, src_region)
            entry["bytes"] += spec.nbytes
            if with_transfers:
                entry["transfers"] += _transfers(spec.src_rank, (src_region, src_offset),
                                                 (dst_region, dst_offset), local[:, 1])
        ranks.append(entry)
    return {
        "model": model.name, "dtype": model.dtype,
        "p": _engine_info(p, p_workers), "d": _engine_info(d, d_workers),
        "request": {"prompt_tokens": prompt_tokens, "tokens_shipped": shipped,
                    "d_computed_tokens": d_computed_tokens, "p_block_ids": p_ids, "d_block_ids": d_ids},
        "consumers_per_producer": list(consumers_per_producer(model, p.tp, d.tp)),
        "d_ranks": ranks,
    }


def _engine_info(config: EngineConfig, workers: list[WorkerGeometry]) -> dict[str, Any]:
    first = workers[0]
    return {
        "tp": config.tp, "block_size": config.block_size, "kernel_block_size": config.kernel_block_size,
        "num_blocks": first.num_blocks,
        "kv_bytes_per_token_per_rank": sum(r.units * r.token_bytes for r in first.attention_regions),
        "ssm_state_bytes_per_rank": sum(r.page_len for r in first.ssm_regions),
        "workers": [{"rank": w.tp_rank, "regions": [region_info(r) for r in w.regions]} for w in workers],
    }


def _transfers(src_rank: int, src: tuple[IntArray, IntArray], dst: tuple[IntArray, IntArray],
               lengths: DescArray) -> list[dict[str, int]]:
    return [
        {"src_rank": src_rank, "src_region": int(sr), "src_offset": int(so),
         "dst_region": int(dr), "dst_offset": int(do), "length": int(n)}
        for sr, so, dr, do, n in zip(*src, *dst, lengths, strict=True)
    ]
