"""Which of P's digests a reader can check after a transfer, and over which of its own bytes.

A reader's local descriptors are byte copies of P's remote descriptors, pair by pair, so
every byte of a P unit (see `kvlink.layout.digests`) that was read lies at a known local
address. A unit is checked when the request read all of its bytes (in one descriptor or a
contiguous run of them); a unit read in part (a D prefix hit or a window start inside a P
page) is counted as unverifiable, never guessed at.

Pure: from the plan's descriptor arrays and both geometries to index arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvlink.layout.digests import (
    DigestLayout,
    digest_layout,
    seed_index,
    shipped_blocks,
    unit_ranges,
)
from kvlink.layout.geometry import WorkerGeometry
from kvlink.plan.descriptors import DescArray, IntArray

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class VerifySpec:
    """What to check of one source rank's part of a request.

    `slice_*`: the digest slices to read from the source, one per (group, block): its
    group, which of the request's `block_seeds` it carries, and the source's block id.
    `unit_slice` / `unit_slot`: for each checked unit, its slice (index into `slice_*`) and
    its digest's position in the slice (1 + unit index; entry 0 is the seed).
    Unit `k` hashes local ranges `piece_addr[piece_starts[k]:piece_starts[k+1]]` in order.
    """

    src_rank: int
    layout: DigestLayout
    slice_group: IntArray
    slice_index: IntArray
    slice_block: IntArray
    unit_slice: IntArray
    unit_slot: IntArray
    piece_starts: IntArray
    piece_addr: IntArray
    piece_len: IntArray
    unverifiable: int

    @property
    def units(self) -> int:
        return int(self.unit_slice.size)

    @property
    def checked_bytes(self) -> int:
        return int(self.piece_len.sum())

    def sample(self, rng: np.random.Generator, count: int) -> VerifySpec:
        """The same spec checking at most `count` units, chosen at random (slices all kept:
        every seed is still checked)."""
        if count >= self.units:
            return self
        keep = np.sort(rng.choice(self.units, size=count, replace=False))
        sizes = np.diff(self.piece_starts)[keep]
        starts = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        pieces = np.concatenate([np.arange(self.piece_starts[k], self.piece_starts[k + 1]) for k in keep]) \
            if keep.size else _EMPTY
        return VerifySpec(self.src_rank, self.layout, self.slice_group, self.slice_index, self.slice_block,
                          self.unit_slice[keep], self.unit_slot[keep], starts, self.piece_addr[pieces],
                          self.piece_len[pieces], self.unverifiable)


def _locate(ranges_addr: IntArray, ranges_len: IntArray, remote_start: IntArray, remote_len: IntArray,
            local_start: IntArray) -> tuple[npt.NDArray[np.bool_], IntArray, dict[int, list[tuple[int, int]]]]:
    """For each remote range: whether the read covered it whole, its local address when one
    descriptor holds it, and the local pieces of those spread over several descriptors."""
    covered = np.zeros(ranges_addr.size, dtype=bool)
    local = np.zeros(ranges_addr.size, dtype=np.int64)
    spread: dict[int, list[tuple[int, int]]] = {}
    if not remote_start.size:
        return covered, local, spread
    i = np.searchsorted(remote_start, ranges_addr, side="right") - 1
    ok = i >= 0
    j = np.where(ok, i, 0)
    whole = ok & (remote_start[j] + remote_len[j] >= ranges_addr + ranges_len)
    local = np.where(whole, local_start[j] + ranges_addr - remote_start[j], 0)
    covered |= whole
    # A range over several descriptors (token chunks): walk them while they follow on.
    for k in np.flatnonzero(ok & ~whole):
        at, end, d = int(ranges_addr[k]), int(ranges_addr[k] + ranges_len[k]), int(j[k])
        run: list[tuple[int, int]] = []
        while at < end and d < remote_start.size and remote_start[d] <= at < remote_start[d] + remote_len[d]:
            stop = min(end, int(remote_start[d] + remote_len[d]))
            run.append((int(local_start[d] + at - remote_start[d]), stop - at))
            at, d = stop, d + 1
        if at >= end:
            covered[k], spread[int(k)] = True, run
    return covered, local, spread


def _touched(ranges_addr: IntArray, ranges_len: IntArray, remote_start: IntArray,
             remote_len: IntArray) -> npt.NDArray[np.bool_]:
    """Whether the read overlaps each range at all (descriptors are sorted, never overlapping)."""
    if not remote_start.size:
        return np.zeros(ranges_addr.size, dtype=bool)
    i = np.searchsorted(remote_start, ranges_addr + ranges_len, side="left") - 1
    j = np.where(i >= 0, i, 0)
    touched: npt.NDArray[np.bool_] = (i >= 0) & (remote_start[j] + remote_len[j] > ranges_addr)
    return touched


def verify_spec(
    src_rank: int, remote: WorkerGeometry, local_descs: DescArray, remote_descs: DescArray,
    local_idx: IntArray, remote_idx: IntArray, remote_block_ids: Sequence[Sequence[int] | IntArray],
    num_tokens: int,
) -> VerifySpec:
    """The units of source `remote` that a read of `remote_descs[remote_idx]` into
    `local_descs[local_idx]` holds whole, for a request shipping `num_tokens` tokens."""
    layout = digest_layout(remote)
    remote_all = remote_descs[remote_idx, 0].astype(np.int64)
    order = np.argsort(remote_all, kind="stable")
    remote_start = remote_all[order]
    remote_len = remote_descs[remote_idx, 1].astype(np.int64)[order]
    local_start = local_descs[local_idx, 0].astype(np.int64)[order]
    slice_cols: list[IntArray] = []
    unit_slice: list[IntArray] = []
    unit_slot: list[IntArray] = []
    addr_parts: list[IntArray] = []
    len_parts: list[IntArray] = []
    counts: list[IntArray] = []
    unverifiable = 0
    slices_so_far = 0
    for group in range(len(remote.model.groups)):
        ids = np.asarray(remote_block_ids[group], dtype=np.int64)
        indices = np.asarray(shipped_blocks(remote, group, num_tokens, ids.size), dtype=np.int64)
        indices = indices[ids[indices] >= 0]
        if not indices.size or not layout.group_units[group]:
            continue
        ranges = unit_ranges(remote, group, ids[indices], indices, num_tokens)
        covered, local, spread = _locate(ranges.addrs, ranges.lengths, remote_start, remote_len, local_start)
        shape = (ranges.units, ranges.per_unit)
        shipped = ranges.lengths.reshape(shape)[:, 0] > 0
        held = shipped & covered.reshape(shape).all(axis=1)
        partial = shipped & ~held & _touched(ranges.addrs, ranges.lengths, remote_start,
                                             remote_len).reshape(shape).any(axis=1)
        unverifiable += int(partial.sum())
        units = np.flatnonzero(held)
        if not units.size:
            continue
        block_of = units // ranges.units_per_block
        blocks, slice_of = np.unique(block_of, return_inverse=True)
        seeds = [seed_index(remote, group, int(i), num_tokens) for i in indices[blocks]]
        slice_cols.append(np.stack([np.full(blocks.size, group), seeds, ids[indices[blocks]]], axis=1))
        unit_slice.append(slices_so_far + slice_of.astype(np.int64))
        unit_slot.append(1 + units % ranges.units_per_block)
        slices_so_far += blocks.size
        range_ids = (units[:, None] * ranges.per_unit + np.arange(ranges.per_unit)[None, :]).reshape(-1)
        if not spread:
            addr_parts.append(local[range_ids])
            len_parts.append(ranges.lengths[range_ids])
            counts.append(np.full(units.size, ranges.per_unit, dtype=np.int64))
            continue
        for unit in units:
            n = 0
            for k in range(unit * ranges.per_unit, (unit + 1) * ranges.per_unit):
                run = spread.get(k) or [(int(local[k]), int(ranges.lengths[k]))]
                addr_parts.append(np.array([a for a, _ in run], dtype=np.int64))
                len_parts.append(np.array([length for _, length in run], dtype=np.int64))
                n += len(run)
            counts.append(np.array([n], dtype=np.int64))
    cols = np.concatenate(slice_cols) if slice_cols else np.zeros((0, 3), dtype=np.int64)
    per_unit_pieces = np.concatenate(counts) if counts else _EMPTY
    return VerifySpec(
        src_rank, layout, cols[:, 0], cols[:, 1], cols[:, 2],
        np.concatenate(unit_slice) if unit_slice else _EMPTY,
        np.concatenate(unit_slot) if unit_slot else _EMPTY,
        np.concatenate(([0], np.cumsum(per_unit_pieces))).astype(np.int64),
        np.concatenate(addr_parts) if addr_parts else _EMPTY,
        np.concatenate(len_parts) if len_parts else _EMPTY,
        unverifiable,
    )
