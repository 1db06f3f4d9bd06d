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
# A report plans every D rank of one sample request in turn, on fake engines holding just
# that request's blocks. Its bound on all those plans together is set by deployments: every
# preset's request of 128 Ki tokens, P and D at TP up to 8, equal or unequal kernel blocks,
# fits (the most: deepseek-mla read by D at TP 8 with kernel blocks 8 and 16, 366 MiB).
# At the bound a report holds about 3.5 times it in memory (the plan, the request's
# indices, the located descriptors). It also bounds `--json`: each listed transfer is one
# descriptor of a local list and one of a remote list, and the list is streamed
# (report_json.py), so it adds no memory of its own.
REPORT_MAX_PLAN_BYTES = 2**29
MAX_LISTED_TRANSFERS = REPORT_MAX_PLAN_BYTES // (2 * DESCRIPTOR_BYTES)
REPORT_BOUND_REASON = (f"that is the report's bound: every preset's 128 Ki-token request at TP up to 8 "
                       f"stays under it, and it caps --json at {MAX_LISTED_TRANSFERS} transfers")


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
    return [[count - 1] if is_ssm(g) else order[skip_blocks:].tolist() for g in model.groups]


def region_info(region: Region) -> dict[str, Any]:
    return {"layer": region.layer, "group": region.group, "kind": region.kind, "base": region.base,
            "page_len": region.page_len, "page_stride": region.page_stride, "num_pages": region.num_pages}


def _locate(worker: WorkerGeometry, descs: DescArray) -> tuple[IntArray, IntArray]:
    """Region (= NIXL registration: one per layer tensor) and offset of each descriptor."""
    return locate(descs, [r.base for r in worker.regions])


@dataclass(frozen=True)
class Sample:
    """A checked configuration and its sample request, before any plan is built."""

    model: ModelSpec
    p: EngineConfig
    d: EngineConfig
    prompt_tokens: int
    d_computed_tokens: int
    p_workers: list[WorkerGeometry]
    d_workers: list[WorkerGeometry]
    p_ids: list[list[int]]
    d_ids: list[list[int]]


def prepare_sample(model: ModelSpec, p: EngineConfig, d: EngineConfig, prompt_tokens: int,
                   d_computed_tokens: int = 0, scatter_seed: int | None = None) -> Sample:
    """Every check of a report, before anything is planned: raises IncompatibleLayout for an
    impossible pair, ValueError for an impossible request or plans over the report's bound."""
    check("prompt_tokens", prompt_tokens, TOKENS)
    check("d_computed_tokens", d_computed_tokens, int_range(0, prompt_tokens - 1))
    if d_computed_tokens % d.block_size:  # as the planner would refuse it, but before any output
        raise ValueError(f"d_computed_tokens {d_computed_tokens} must be a multiple of the local block "
                         f"size {d.block_size}: D's prefix hit is whole D blocks")
    if scatter_seed is not None:
        check("scatter_seed", scatter_seed, int_range(0, 2**63 - 1))
    check_configuration(model, model, p.tp, d.tp, p.block_size, p.kernel_block_size,
                        d.block_size, d.kernel_block_size)
    p_workers = fake_engine(model, p, blocks_for(prompt_tokens, p.block_size), P_ADDRESS_SPACE)
    d_workers = fake_engine(model, d, blocks_for(prompt_tokens, d.block_size), D_ADDRESS_SPACE)
    p_engine = dict(enumerate(p_workers))
    total_bytes = sum(plan_bytes(reader, p_engine) for reader in d_workers)
    check_plan_bytes(total_bytes, f"the plans of all {d.tp} D rank(s)", REPORT_MAX_PLAN_BYTES,
                     f"{REPORT_BOUND_REASON}; plan fewer tokens, larger blocks, or kernel block "
                     "sizes equal on P and D")
    p_ids = sample_block_ids(model, prompt_tokens, p.block_size, 0, scatter_seed)
    d_ids = sample_block_ids(model, prompt_tokens, d.block_size, d_computed_tokens // d.block_size,
                             scatter_seed)
    return Sample(model, p, d, prompt_tokens, d_computed_tokens, p_workers, d_workers, p_ids, d_ids)


@dataclass(frozen=True, eq=False)
class Transfers:
    """One READ's descriptor pairs, located: region index and offset in it on both sides."""

    src_rank: int
    src_region: IntArray
    src_offset: IntArray
    dst_region: IntArray
    dst_offset: IntArray
    length: IntArray

    def as_dicts(self) -> list[dict[str, int]]:
        return [
            {"src_rank": self.src_rank, "src_region": int(sr), "src_offset": int(so),
             "dst_region": int(dr), "dst_offset": int(do), "length": int(n)}
            for sr, so, dr, do, n in zip(self.src_region, self.src_offset, self.dst_region,
                                         self.dst_offset, self.length, strict=True)
        ]


def plan_rank(sample: Sample, reader: WorkerGeometry) -> tuple[dict[str, Any], list[Transfers]]:
    """Plan D rank `reader` for the sample request: its `d_ranks` entry without `transfers`,
    and those transfers, one READ (source rank) after the other."""
    plan = build_transfer_plan(reader, dict(enumerate(sample.p_workers)))
    specs = plan.request_ids(sample.d_ids, sample.p_ids, max(0, sample.prompt_tokens - 1),
                             sample.d_computed_tokens)
    entry: dict[str, Any] = {
        "rank": reader.tp_rank, "source_ranks": [s.src_rank for s in specs if len(s.local_idx)],
        "notify_ranks": list(plan.mapping.notify_ranks), "chunk_tokens": plan.chunk_tokens,
        "descriptors": 0, "merged_descriptors": 0, "bytes": 0,
    }
    reads = []
    for spec in specs:
        source = plan.source(spec.src_rank)
        local, remote = source.local_descs[spec.local_idx], source.remote_descs[spec.remote_idx]
        dst_region, dst_offset = _locate(reader, local)
        src_region, src_offset = _locate(sample.p_workers[spec.src_rank], remote)
        entry["descriptors"] += len(local)
        entry["merged_descriptors"] += count_merged(local, remote, dst_region, src_region)
        entry["bytes"] += spec.nbytes
        reads.append(Transfers(spec.src_rank, src_region, src_offset, dst_region, dst_offset,
                               local[:, 1].astype(np.int64)))
    return entry, reads


def report_header(sample: Sample) -> dict[str, Any]:
    """Every top-level field of the report but `d_ranks`, in the documented order."""
    model, p, d = sample.model, sample.p, sample.d
    return {
        "model": model.name, "dtype": model.dtype,
        "p": _engine_info(p, sample.p_workers), "d": _engine_info(d, sample.d_workers),
        "request": {"prompt_tokens": sample.prompt_tokens, "tokens_shipped": max(0, sample.prompt_tokens - 1),
                    "d_computed_tokens": sample.d_computed_tokens, "p_block_ids": sample.p_ids,
                    "d_block_ids": sample.d_ids},
        "consumers_per_producer": list(consumers_per_producer(model, p.tp, d.tp)),
    }


def plan_report(model: ModelSpec, p: EngineConfig, d: EngineConfig, prompt_tokens: int,
                d_computed_tokens: int = 0, scatter_seed: int | None = None,
                with_transfers: bool = False) -> dict[str, Any]:
    """Plan every D rank for one sample request; raises IncompatibleLayout for impossible pairs.
    The whole document in memory: `kvlink plan --json` streams it with `report_json.plan_json`."""
    sample = prepare_sample(model, p, d, prompt_tokens, d_computed_tokens, scatter_seed)
    ranks = []
    for reader in sample.d_workers:
        entry, reads = plan_rank(sample, reader)
        entry["transfers"] = [t for read in reads for t in read.as_dicts()] if with_transfers else []
        ranks.append(entry)
    return {**report_header(sample), "d_ranks": ranks}


def _engine_info(config: EngineConfig, workers: list[WorkerGeometry]) -> dict[str, Any]:
    first = workers[0]
    return {
        "tp": config.tp, "block_size": config.block_size, "kernel_block_size": config.kernel_block_size,
        "num_blocks": first.num_blocks,
        "kv_bytes_per_token_per_rank": sum(r.units * r.token_bytes for r in first.attention_regions),
        "ssm_state_bytes_per_rank": sum(r.page_len for r in first.ssm_regions),
        "workers": [{"rank": w.tp_rank, "regions": [region_info(r) for r in w.regions]} for w in workers],
    }
