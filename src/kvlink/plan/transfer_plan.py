"""The prepared plan of one reader (D) worker against one source (P) engine, built once.

For every source rank it holds a local and a remote descriptor list in the same
id scheme; a request then only computes integer index arrays (`request_ids`).
The unit of attention movement is (region, kernel block, token chunk, piece) with
chunk = gcd of both kernel block sizes: one piece per contiguous head run when
both sides' kernel blocks are equal, otherwise one piece per head and segment of
the page order (one segment for kvlink's token-major pages).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from math import gcd

import numpy as np

from kvlink.layout.geometry import Region, WorkerGeometry, remote_sub_part_slice
from kvlink.layout.page_order import DEFAULT_PAGE_ORDER, min_chunk_tokens
from kvlink.plan.budget import DESCRIPTOR_BYTES, check_plan_bytes, descriptor_count
from kvlink.plan.compat import IncompatibleLayout, check_compatible
from kvlink.plan.descriptors import DescArray, IntArray, page_descs
from kvlink.plan.plan_types import AttentionSegment, PreparedPlan, SourcePlan, SsmSegment
from kvlink.plan.request import ReadSpec, request_ids
from kvlink.plan.tp_mapping import TPMapping, UnitRun, compute_tp_mapping


class TransferPlan(PreparedPlan):
    """Built once per (reader worker, source engine) by `build_transfer_plan`."""

    def request_ids(
        self,
        local_block_ids: Sequence[Sequence[int] | IntArray],
        remote_block_ids: Sequence[Sequence[int] | IntArray],
        num_tokens_to_ship: int,
        local_computed_tokens: int = 0,
        *,
        tokens: tuple[int, int] | None = None,
        layers: Sequence[int] | None = None,
    ) -> list[ReadSpec]:
        """One ReadSpec per source rank; see `kvlink.plan.request.request_ids`."""
        return request_ids(self, local_block_ids, remote_block_ids, num_tokens_to_ship,
                           local_computed_tokens, tokens=tokens, layers=layers)


@dataclass
class _ListBuilder:
    """One side's descriptor list: regions are added first (each gets its start id), and the
    list is written once, in place, at the end (no second copy of a list that may take
    hundreds of MB)."""

    device_id: int
    parts: list[tuple[Region, int, IntArray, IntArray]] = field(default_factory=list)
    size: int = 0

    def add(self, region: Region, num_pages: int, offsets: IntArray, lengths: IntArray) -> int:
        start = self.size
        self.parts.append((region, num_pages, offsets, lengths))
        self.size += num_pages * len(offsets)
        return start

    def array(self) -> DescArray:
        descs = np.empty((self.size, 3), dtype=np.uint64)
        at = 0
        for region, num_pages, offsets, lengths in self.parts:
            count = num_pages * len(offsets)
            page_descs(region.base, region.page_stride, num_pages, offsets, lengths, self.device_id,
                       out=descs[at:at + count])
            at += count
        return descs


def _attention_pieces(
    runs: Sequence[UnitRun], local: WorkerGeometry, remote: WorkerGeometry, local_reg: Region,
    remote_reg: Region, chunk: int, whole_blocks: bool,
) -> tuple[IntArray, IntArray, IntArray]:
    """(local offsets, remote offsets, lengths) of the pieces of token chunk 0 of a page.

    Chunk c of a piece lies `c * length` bytes further on both sides: with equal kernel
    blocks there is one chunk per page; otherwise every piece is `chunk / g` whole
    granules of one segment of one head's unit (`WorkerGeometry.token_segments`).
    """
    if whole_blocks:
        rows = [(r.local_slot * local_reg.unit_bytes, r.remote_slot * remote_reg.unit_bytes,
                 r.count * local_reg.unit_bytes) for r in runs]
    else:
        pairs = list(zip(local.token_segments(local_reg), remote.token_segments(remote_reg), strict=True))
        rows = [((r.local_slot + j) * local_reg.unit_bytes + ls.offset_bytes,
                 (r.remote_slot + j) * remote_reg.unit_bytes + rs.offset_bytes,
                 chunk // ls.granule_tokens * ls.granule_bytes)
                for r in runs for j in range(r.count) for ls, rs in pairs]
    table = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    return table[:, 0], table[:, 1], table[:, 2]


def _chunk_offsets(piece_offsets: IntArray, chunks_per_block: int, chunk_strides: IntArray) -> IntArray:
    """Offsets of every (chunk, piece) of a page, chunk-major; piece i advances `chunk_strides[i]`."""
    return (np.arange(chunks_per_block, dtype=np.int64)[:, None] * chunk_strides[None, :]
            + piece_offsets[None, :]).reshape(-1)


def _build_source(plan_args: _PlanArgs, src: int) -> SourcePlan:
    local, remote, mapping, chunk = plan_args.local, plan_args.remotes[src], plan_args.mapping, plan_args.chunk
    whole = local.kernel_block_size == remote.kernel_block_size
    local_list, remote_list = _ListBuilder(local.device_id), _ListBuilder(remote.device_id)
    att: dict[int, list[tuple[int, int, int, int, int]]] = {}
    for local_reg, remote_reg in zip(local.attention_regions, remote.attention_regions, strict=True):
        key = "kv" if local_reg.kind == "attention" else f"g{local_reg.group}.latent"
        runs = mapping.runs_from(key, src)
        if not runs:
            continue
        l_off, r_off, lens = _attention_pieces(runs, local, remote, local_reg, remote_reg, chunk, whole)
        l_chunks, r_chunks = local.kernel_block_size // chunk, remote.kernel_block_size // chunk
        l_start = local_list.add(local_reg, local_reg.num_pages, _chunk_offsets(l_off, l_chunks, lens),
                                 np.tile(lens, l_chunks))
        r_start = remote_list.add(remote_reg, remote_reg.num_pages, _chunk_offsets(r_off, r_chunks, lens),
                                  np.tile(lens, r_chunks))
        att.setdefault(local_reg.group, []).append((l_start, r_start, len(lens), int(lens.sum()),
                                                    local_reg.layer))
    ssm: dict[int, list[tuple[int, int, int, int]]] = {}
    for local_reg, remote_reg in zip(local.ssm_regions, remote.ssm_regions, strict=True):
        for l_sub, r_sub in zip(local_reg.sub_parts, remote_reg.sub_parts, strict=True):
            for run in mapping.runs_from(f"g{local_reg.group}.{l_sub.name}", src):
                l_byte, length = remote_sub_part_slice(l_sub, run.local_slot, run.count)
                r_byte, _ = remote_sub_part_slice(r_sub, run.remote_slot, run.count)
                lens = np.array([length], dtype=np.int64)
                l_start = local_list.add(local_reg, local_reg.num_pages,
                                         np.array([l_byte], dtype=np.int64), lens)
                r_start = remote_list.add(remote_reg, remote_reg.num_pages,
                                          np.array([r_byte], dtype=np.int64), lens)
                ssm.setdefault(local_reg.group, []).append((l_start, r_start, length, local_reg.layer))
    l_kbs, r_kbs = local.kernel_block_size, remote.kernel_block_size
    attention = tuple(
        AttentionSegment(
            group=g,
            local_region_starts=np.array([e[0] for e in entries], dtype=np.int64),
            remote_region_starts=np.array([e[1] for e in entries], dtype=np.int64),
            pieces=entries[0][2],
            local_block_span=(l_kbs // chunk) * entries[0][2],
            remote_block_span=(r_kbs // chunk) * entries[0][2],
            chunk_bytes=sum(e[3] for e in entries),
            layers=np.array([e[4] for e in entries], dtype=np.int64),
            region_chunk_bytes=np.array([e[3] for e in entries], dtype=np.int64),
        )
        for g, entries in sorted(att.items())
    )
    ssm_segments = tuple(
        SsmSegment(g, np.array([e[0] for e in entries], dtype=np.int64),
                   np.array([e[1] for e in entries], dtype=np.int64), sum(e[2] for e in entries),
                   np.array([e[3] for e in entries], dtype=np.int64),
                   np.array([e[2] for e in entries], dtype=np.int64))
        for g, entries in sorted(ssm.items())
    )
    return SourcePlan(src, local_list.array(), remote_list.array(), attention, ssm_segments)


@dataclass(frozen=True)
class _PlanArgs:
    local: WorkerGeometry
    remotes: Mapping[int, WorkerGeometry]
    mapping: TPMapping
    chunk: int


def build_transfer_plan(
    local: WorkerGeometry,
    remotes: Mapping[int, WorkerGeometry],
    only_sources: Iterable[int] | None = None,
) -> TransferPlan:
    """Plan reader `local` (a D worker) against source engine workers `remotes` (rank → geometry).

    `remotes` must hold every source rank the reader reads from (`compute_tp_mapping(...)
    .source_ranks`), or those in `only_sources` (push mode: a P rank plans for one D rank
    with only itself as source).
    """
    if not remotes:
        raise ValueError("no remote geometries given")
    any_remote = next(iter(remotes.values()))
    for rank, geometry in remotes.items():
        check_compatible(geometry, local)
        if geometry.tp_rank != rank or geometry.tp_size != any_remote.tp_size:
            raise ValueError(f"remote geometry under key {rank} is rank {geometry.tp_rank} "
                             f"of TP {geometry.tp_size}; expected rank {rank} of TP {any_remote.tp_size}")
        if (geometry.block_size, geometry.kernel_block_size, geometry.num_blocks) != (
                any_remote.block_size, any_remote.kernel_block_size, any_remote.num_blocks):
            raise IncompatibleLayout([f"remote rank {rank} block geometry differs from its engine peers"])
    mapping = compute_tp_mapping(local.model, local.tp_size, local.tp_rank, any_remote.tp_size)
    wanted = mapping.source_ranks if only_sources is None else tuple(sorted(set(only_sources)))
    missing = [s for s in wanted if s not in remotes]
    stray = [s for s in wanted if s not in mapping.source_ranks]
    if missing or stray:
        raise ValueError(f"reader rank {local.tp_rank} reads from ranks {mapping.source_ranks}; "
                         f"geometry missing for {missing}, not a source: {stray}")
    chunk = gcd(local.kernel_block_size, any_remote.kernel_block_size)
    if (local.kernel_block_size != any_remote.kernel_block_size and local.page_order != DEFAULT_PAGE_ORDER
            and (local.aliased or any_remote.aliased)):
        # token chunks of such pages, with groups aliasing one allocation, were seen to address
        # past P's descriptor list inside vLLM; the connector reads these through staging pages
        raise IncompatibleLayout([
            f"kernel block sizes P {any_remote.kernel_block_size} and D {local.kernel_block_size} of the "
            f"{local.page_order!r} page order with groups sharing one allocation move through staging "
            f"pages only (kvlink.plan.staged), not as token chunks"])
    if local.kernel_block_size != any_remote.kernel_block_size and chunk % min_chunk_tokens(local.page_order):
        raise IncompatibleLayout([
            f"page order {local.page_order!r} moves whole granules of {min_chunk_tokens(local.page_order)} "
            f"tokens, but kernel block sizes P {any_remote.kernel_block_size} and D "
            f"{local.kernel_block_size} only share chunks of {chunk} tokens"])
    check_plan_bytes(DESCRIPTOR_BYTES * descriptor_count(local, remotes, mapping, wanted, chunk),
                     f"the transfer plan of reader rank {local.tp_rank}")
    args = _PlanArgs(local, remotes, mapping, chunk)
    sources = tuple(_build_source(args, src) for src in wanted)
    return TransferPlan(local, any_remote.tp_size, any_remote.block_size, any_remote.kernel_block_size,
                        any_remote.num_blocks, chunk, mapping, sources)
