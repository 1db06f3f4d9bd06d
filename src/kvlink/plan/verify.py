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
    DigestGeometry,
    DigestLayout,
    seed_index,
    shipped_blocks,
    unit_ranges,
)
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


def _eligible(dg: DigestGeometry, group: int, ids: IntArray, num_tokens: int, first_token: int) -> IntArray:
    """Indices of the group's shipped blocks the reader reads from (a D prefix hit or a window
    start skips whole blocks before `first_token`)."""
    geometry = dg.geometry
    shipped = shipped_blocks(geometry, group, num_tokens, ids.size)
    start = shipped.start
    pages = dg.groups[group]
    if pages is not None and not pages.ssm:
        start = max(start, first_token // geometry.block_size)
    indices = np.arange(start, max(start, shipped.stop), dtype=np.int64)
    return indices[ids[indices] >= 0]


@dataclass(frozen=True)
class _Eligible:
    group: int
    indices: IntArray  # into the request's block list
    ids: IntArray  # the source's block ids of the group
    per_block: int


@dataclass(frozen=True, eq=False)
class _Held:
    """Some held units of one group, in slice order: their block indices and units, and their
    local pieces (unit k's are `counts[k]` consecutive entries of `addr` / `length`)."""

    group: int
    index: IntArray
    unit: IntArray
    counts: IntArray
    addr: IntArray
    length: IntArray


@dataclass(frozen=True, eq=False)
class _Found:
    """Located units of one group: which are held whole, and where their ranges landed."""

    group: int
    held: IntArray  # positions of the held units
    index_of: IntArray
    unit_of: IntArray
    per_unit: int
    local: IntArray
    lengths: IntArray
    spread: dict[int, list[tuple[int, int]]]
    partial: int

    def take(self, positions: IntArray) -> _Held:
        per = self.per_unit
        rows = (positions[:, None] * per + np.arange(per, dtype=np.int64)[None, :]).reshape(-1)
        if not self.spread:  # every range in one descriptor: one piece per range
            counts = np.full(positions.size, per, dtype=np.int64)
            return _Held(self.group, self.index_of[positions], self.unit_of[positions], counts,
                         self.local[rows], self.lengths[rows])
        addrs: list[int] = []
        lengths: list[int] = []
        counts_list = []
        for k in positions.tolist():
            pieces = [piece for r in range(k * per, (k + 1) * per)
                      for piece in self.spread.get(r, [(int(self.local[r]), int(self.lengths[r]))])]
            counts_list.append(len(pieces))
            addrs += [a for a, _ in pieces]
            lengths += [n for _, n in pieces]
        return _Held(self.group, self.index_of[positions], self.unit_of[positions],
                     np.array(counts_list, dtype=np.int64), np.array(addrs, dtype=np.int64),
                     np.array(lengths, dtype=np.int64))


def _find(dg: DigestGeometry, block: _Eligible, located: tuple[IntArray, IntArray, IntArray],
          num_tokens: int) -> _Found:
    """Locate every unit of one group's eligible blocks."""
    indices = block.indices
    ranges = unit_ranges(dg, block.group, block.ids[indices], indices, num_tokens)
    remote_start, remote_len, local_start = located
    covered, local, spread = _locate(ranges.addrs, ranges.lengths, remote_start, remote_len, local_start)
    shape = (ranges.units, ranges.per_unit)
    shipped = ranges.lengths.reshape(shape)[:, 0] > 0
    held = shipped & covered.reshape(shape).all(axis=1)
    partial = shipped & ~held & _touched(ranges.addrs, ranges.lengths, remote_start,
                                         remote_len).reshape(shape).any(axis=1)
    index_of = np.repeat(indices, block.per_block)
    unit_of = np.tile(np.arange(block.per_block, dtype=np.int64), indices.size)
    return _Found(block.group, np.flatnonzero(held), index_of, unit_of, ranges.per_unit, local, ranges.lengths,
                  spread, int(partial.sum()))


def verify_spec(
    src_rank: int, dg: DigestGeometry, local_descs: DescArray, remote_descs: DescArray,
    local_idx: IntArray, remote_idx: IntArray, remote_block_ids: Sequence[Sequence[int] | IntArray],
    num_tokens: int, first_tokens: Sequence[int], sample: tuple[np.random.Generator, int] | None = None,
) -> VerifySpec:
    """The units of source `dg` that a read of `remote_descs[remote_idx]` into
    `local_descs[local_idx]` holds whole, for a request shipping `num_tokens` tokens, the
    reader's part of group g starting at token `first_tokens[g]`. With `sample = (rng, k)`:
    k of them drawn at random, locating only candidates, so the cost does not grow with the
    request. Every read block's slice is listed either way (its seed is always checked)."""
    remote_all = remote_descs[remote_idx, 0].astype(np.int64)
    order = np.argsort(remote_all, kind="stable")
    located = (remote_all[order], remote_descs[remote_idx, 1].astype(np.int64)[order],
               local_descs[local_idx, 0].astype(np.int64)[order])
    blocks = []
    for group, pages in enumerate(dg.groups):
        ids = np.asarray(remote_block_ids[group], dtype=np.int64)
        if pages is None or not pages.units_per_block or not ids.size:
            continue
        indices = _eligible(dg, group, ids, num_tokens, int(first_tokens[group]))
        if indices.size:
            blocks.append(_Eligible(group, indices, ids, pages.units_per_block))
    held: list[_Held] | None = None
    unverifiable = 0
    if sample is not None:
        held = _sampled(dg, blocks, located, num_tokens, *sample)
    if held is None:
        found = [_find(dg, block, located, num_tokens) for block in blocks]
        unverifiable = sum(f.partial for f in found)
        held = [f.take(f.held) for f in found] if sample is None else _pick(found, *sample)
    return _spec(src_rank, dg, blocks, held, num_tokens, unverifiable)


def _sampled(dg: DigestGeometry, blocks: list[_Eligible], located: tuple[IntArray, IntArray, IntArray],
             num_tokens: int, rng: np.random.Generator, count: int) -> list[_Held] | None:
    """`count` held units out of a few random candidates, each range inside one read
    descriptor; None when too few candidates are (a reader of a few heads, token chunks over
    several descriptors): the caller then locates every unit and picks from those.

    Runs once per request on D's critical path, so it keeps to few numpy calls: candidates
    are drawn in random order and the first `count` held ones are kept."""
    sizes = [b.indices.size * b.per_block for b in blocks]
    total = sum(sizes)
    if total == 0:
        return []
    remote_start, remote_len, local_start = located
    if not remote_start.size:
        return None
    want = min(count, total)
    draws = min(total, 4 * count)
    # random order; a short permutation costs about half of `choice` (more so with cold caches)
    drawn = rng.permutation(total)[:draws] if total <= 4096 else rng.choice(total, size=draws, replace=False)
    several = len(blocks) > 1
    found = []
    at = 0
    for block, size in zip(blocks, sizes, strict=True):
        order = np.flatnonzero((drawn >= at) & (drawn < at + size)) if several else None
        mine = drawn[order] - at if order is not None else drawn
        at += size
        if not mine.size:
            continue
        index, unit = np.divmod(mine, block.per_block)
        indices = block.indices[index]
        ranges = unit_ranges(dg, block.group, block.ids[indices], indices, num_tokens, unit)
        addrs, lengths, per = ranges.addrs, ranges.lengths, ranges.per_unit
        # j = -1 (below every descriptor) wraps to the last one, whose start lies above addr
        j = np.searchsorted(remote_start, addrs, side="right") - 1
        start = remote_start[j]
        whole = (start <= addrs) & (start + remote_len[j] >= addrs + lengths)
        held = np.flatnonzero(whole.reshape(-1, per).all(axis=1) & (lengths[::per] > 0))
        # where in the draw each held candidate came
        found.append((block, held, order[held] if order is not None else held, mine, indices, unit, addrs,
                      lengths, j, per))
    if not found:
        return None
    # one group's held positions are its draw ranks already, ascending
    ranks = found[0][2] if len(found) == 1 else np.sort(np.concatenate([f[2] for f in found]))
    if ranks.size < want:
        return None
    cutoff = ranks[want - 1]
    out = []
    for block, held, rank, mine, indices, unit, addrs, lengths, j, per in found:
        pos = held[rank <= cutoff]
        if not pos.size:
            continue
        pos = pos[np.argsort(mine[pos])]  # slice order
        rows = (pos[:, None] * per + np.arange(per, dtype=np.int64)).reshape(-1)
        picked = j[rows]
        out.append(_Held(block.group, indices[pos], unit[pos], np.full(pos.size, per, dtype=np.int64),
                         local_start[picked] + addrs[rows] - remote_start[picked], lengths[rows]))
    return out


def _pick(found: list[_Found], rng: np.random.Generator, count: int) -> list[_Held]:
    """`count` of the held units at random, in slice order."""
    sizes = np.array([f.held.size for f in found], dtype=np.int64)
    picked = np.sort(rng.permutation(int(sizes.sum()))[:count])
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    out = []
    for i, f in enumerate(found):
        mine = picked[(picked >= bounds[i]) & (picked < bounds[i + 1])] - bounds[i]
        if mine.size:
            out.append(f.take(f.held[mine]))
    return out


def _starts(counts: IntArray) -> IntArray:
    """Where each unit's pieces start, and the end: [0, c0, c0 + c1, ...]."""
    starts = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return starts


def _spec(src_rank: int, dg: DigestGeometry, blocks: list[_Eligible], held: list[_Held], num_tokens: int,
          unverifiable: int) -> VerifySpec:
    groups, seeds, ids = [], [], []
    first_slice: dict[int, tuple[int, _Eligible]] = {}
    at = 0
    for block in blocks:
        first_slice[block.group] = (at, block)
        groups.append(np.full(block.indices.size, block.group, dtype=np.int64))
        pages = dg.groups[block.group]
        seeds.append(np.full(block.indices.size, seed_index(dg.geometry, block.group, 0, num_tokens), np.int64)
                     if pages is not None and pages.ssm else block.indices)
        ids.append(block.ids[block.indices])
        at += block.indices.size

    def joined(parts: list[IntArray]) -> IntArray:
        if len(parts) == 1:
            return parts[0].astype(np.int64, copy=False)
        return np.concatenate(parts).astype(np.int64) if parts else _EMPTY

    unit_slice = []
    for h in held:
        start, block = first_slice[h.group]
        unit_slice.append(start + np.searchsorted(block.indices, h.index))
    counts = joined([h.counts for h in held])
    return VerifySpec(
        src_rank, dg.layout, joined(groups), joined(seeds), joined(ids),
        joined(unit_slice), joined([1 + h.unit for h in held]),
        _starts(counts),
        joined([h.addr for h in held]), joined([h.length for h in held]),
        unverifiable,
    )
