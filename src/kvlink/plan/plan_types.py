"""The data of a prepared transfer plan: per source rank, paired descriptor lists and their segments.

`transfer_plan.py` builds these and `request.py` reads them to plan one request; both
import them from here, so the builder depends on the request planner and not back.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlink.layout.geometry import WorkerGeometry
from kvlink.plan.descriptors import DescArray, IntArray
from kvlink.plan.tp_mapping import TPMapping


@dataclass(frozen=True, eq=False)
class AttentionSegment:
    """The regions of one attention or MLA group that one source rank supplies."""

    group: int
    local_region_starts: IntArray
    remote_region_starts: IntArray
    pieces: int
    local_block_span: int
    remote_block_span: int
    chunk_bytes: int
    # Per region entry: its model layer and the bytes it moves per token chunk (a layerwise
    # write posts a subset of the entries; `chunk_bytes` is their sum over all of them).
    layers: IntArray
    region_chunk_bytes: IntArray


@dataclass(frozen=True, eq=False)
class SsmSegment:
    """The SSM sub-part pieces of one SSM group that one source rank supplies."""

    group: int
    local_starts: IntArray
    remote_starts: IntArray
    block_bytes: int
    layers: IntArray  # per piece: its model layer
    piece_bytes: IntArray


@dataclass(frozen=True, eq=False)
class SourcePlan:
    """Paired descriptor lists for one source rank: `local_descs[i]` ↔ `remote_descs[j]`."""

    src_rank: int
    local_descs: DescArray
    remote_descs: DescArray
    attention: tuple[AttentionSegment, ...]
    ssm: tuple[SsmSegment, ...]


@dataclass(frozen=True, eq=False)
class PreparedPlan:
    """What a plan holds once built; `TransferPlan` adds the per-request planning over it."""

    local: WorkerGeometry
    remote_tp: int
    remote_block_size: int
    remote_kernel_block_size: int
    remote_num_blocks: int
    chunk_tokens: int
    mapping: TPMapping
    sources: tuple[SourcePlan, ...]

    def source(self, src_rank: int) -> SourcePlan:
        for plan in self.sources:
            if plan.src_rank == src_rank:
                return plan
        raise KeyError(f"source rank {src_rank} not in this plan (has {[s.src_rank for s in self.sources]})")
