"""KV digests over memory: P seals a request's shipped blocks, D checks what it received.

The table layout and the byte ranges of each unit are `kvlink.layout.digests`; which units a
reader holds whole is `kvlink.plan.verify`. Digests are xxh3-64, seeded with the block's
token seed, which binds a digest to the tokens the block was computed from. `kvlink bench
digest` chose it: on KV-sized buffers (16 KiB, one head of one page, to 12 MiB) it hashed
19-27 GB/s on one core here, hardware CRC32C (the `crc32c` package) 9-26 GB/s (slowest on
the small buffers a unit is made of), zlib's CRC32 2-3 GB/s (BENCHMARKS.md, "KV digests").
"""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from kvlink.layout.digests import DigestGeometry, seed_index, shipped_blocks, unit_ranges
from kvlink.plan.verify import VerifySpec

Memory = Callable[[int, int], memoryview]


class _Areas:
    """One immutable snapshot of an address space's areas, sorted by base."""

    def __init__(self, bases: list[int], views: list[memoryview]) -> None:
        self.bases = bases
        self.views = views
        self.base_array = np.array(bases, dtype=np.int64)
        self.size_array = np.array([v.nbytes for v in views], dtype=np.int64)


class AddressSpace:
    """Bytes by address inside areas this process owns (cache tensors, staging pages).

    Looked up from the verifier's planning thread while D's thread may add a staging area:
    an area is added by swapping in a new snapshot, so a lookup sees the areas before or
    after, never half of a change."""

    def __init__(self, areas: Sequence[tuple[int, int]]) -> None:
        # Aliased layers (vLLM's hybrid cache) list one memory several times: merge overlaps.
        spans: list[list[int]] = []
        for base, n in sorted((int(b), int(n)) for b, n in areas if n > 0):
            if spans and base <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], base + n)
            else:
                spans.append([base, base + n])
        self._areas = _Areas([base for base, _ in spans],
                             [memoryview((ctypes.c_uint8 * (end - base)).from_address(base)).cast("B")
                              for base, end in spans])

    def add(self, base: int, data: npt.NDArray[np.uint8]) -> None:
        old = self._areas
        at = bisect.bisect(old.bases, base)
        self._areas = _Areas([*old.bases[:at], base, *old.bases[at:]],
                             [*old.views[:at], data.data.cast("B"), *old.views[at:]])

    def __call__(self, addr: int, length: int) -> memoryview:
        areas = self._areas
        at = bisect.bisect_right(areas.bases, addr) - 1
        if at < 0:
            raise ValueError(f"address {addr:#x} is below every registered area")
        offset = addr - areas.bases[at]
        view = areas.views[at]
        if offset + length > view.nbytes:
            raise ValueError(f"range {addr:#x}+{length} runs past its area")
        return view[offset:offset + length]

    def pieces(self, addrs: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]) -> list[memoryview]:
        """The bytes of many ranges at once (one lookup for all of them)."""
        areas = self._areas
        at = np.searchsorted(areas.base_array, addrs, side="right") - 1
        if at.size and int(at.min()) < 0:
            raise ValueError(f"address {int(addrs[np.argmin(at)]):#x} is below every registered area")
        starts = addrs - areas.base_array[at]
        ends = starts + lengths
        over = np.flatnonzero(ends > areas.size_array[at])
        if over.size:
            raise ValueError(f"range {int(addrs[over[0]]):#x}+{int(lengths[over[0]])} runs past its area")
        views = areas.views
        return [views[i][a:b] for i, a, b in zip(at.tolist(), starts.tolist(), ends.tolist(), strict=True)]


def _pieces(memory: Memory, addrs: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]) -> list[Any]:
    many = getattr(memory, "pieces", None)
    if many is not None:
        return list(many(addrs, lengths))
    return [memory(a, n) for a, n in zip(addrs.tolist(), lengths.tolist(), strict=True)]


@dataclass(frozen=True)
class UnitViews:
    """Units as bytes of this process, looked up once (a pulled load's check does it on its
    planning thread while the READ runs): unit `k` hashes `views[bounds[k]:bounds[k+1]]`."""

    views: list[Any]
    bounds: list[int]


def _lookup(memory: Memory, addrs: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64],
            starts: npt.NDArray[np.int64]) -> UnitViews:
    """The bytes of units whose ranges are `starts[k]:starts[k+1]` (empty ranges left out)."""
    if not lengths.size or lengths.min() > 0:
        return UnitViews(_pieces(memory, addrs, lengths), starts.tolist())
    keep = lengths > 0
    bounds = np.concatenate(([0], np.cumsum(keep)))[starts].tolist()
    return UnitViews(_pieces(memory, addrs[keep], lengths[keep]), bounds)


def unit_views(spec: VerifySpec, memory: Memory) -> UnitViews:
    """Look up the bytes of every unit of `spec`."""
    return _lookup(memory, spec.piece_addr, spec.piece_len, spec.piece_starts)


def _view_digests(views: UnitViews, units: Sequence[int], seeds: Sequence[int]) -> list[int]:
    """Digests of some units (their bytes looked up already), one seed per unit."""
    pieces, bounds = views.views, views.bounds
    out = []
    for k, seed in zip(units, seeds, strict=True):
        h = xxhash.xxh3_64(seed=seed)
        for piece in pieces[bounds[k]:bounds[k + 1]]:
            h.update(piece)
        out.append(h.intdigest())
    return out


def digests(memory: Memory, addrs: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64],
            starts: npt.NDArray[np.int64], seeds: Sequence[int]) -> list[int]:
    """Digest of each unit `k`: xxh3-64 seeded with `seeds[k]` over its ranges
    `starts[k]:starts[k+1]` in order, as one stream (empty ranges add nothing)."""
    return _view_digests(_lookup(memory, addrs, lengths, starts), range(len(seeds)), seeds)


def seal(table: npt.NDArray[np.uint64], dg: DigestGeometry, memory: Memory, block_ids: Sequence[Sequence[int]],
         num_tokens: int, seeds: Sequence[int]) -> int:
    """Write the digests of every shipped unit of a request into its slices (digests first,
    then the seed, so a reader that sees the seed sees the digests); bytes hashed."""
    hashed = 0
    geometry, layout = dg.geometry, dg.layout
    for group in range(len(geometry.model.groups)):
        ids = list(block_ids[group]) if group < len(block_ids) else []
        indices = [i for i in shipped_blocks(geometry, group, num_tokens, len(ids)) if ids[i] >= 0]
        if not indices or not layout.group_units[group]:
            continue
        blocks = np.array([ids[i] for i in indices], dtype=np.int64)
        ranges = unit_ranges(dg, group, blocks, indices, num_tokens)
        per_block, per_unit = ranges.units_per_block, ranges.per_unit
        block_seeds = [seeds[seed_index(geometry, group, index, num_tokens)] for index in indices]
        starts = np.arange(blocks.size * per_block + 1, dtype=np.int64) * per_unit
        values = digests(memory, ranges.addrs, ranges.lengths, starts,
                         [seed for seed in block_seeds for _ in range(per_block)])
        offset = layout.group_offsets[group]
        table[blocks, offset + 1:offset + 1 + per_block] = np.array(values, dtype=np.uint64).reshape(
            blocks.size, per_block)
        table[blocks, offset] = np.array(block_seeds, dtype=np.uint64)
        hashed += int(ranges.lengths.sum())
    return hashed


@dataclass
class CheckResult:
    """What a reader found: units checked and bytes hashed, slices whose seed was not the
    request's (not sealed yet, or reused for other tokens), and units whose bytes differ."""

    units: int = 0
    hashed_bytes: int = 0
    unsealed: list[tuple[int, int]] = field(default_factory=list)  # (group, block index)
    mismatches: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    # (group, block index, unit, expected, got)

    @property
    def ok(self) -> bool:
        return not self.unsealed and not self.mismatches


def _unit_bytes(starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64], units: npt.NDArray[np.int64]) -> int:
    """Bytes of some units (unit k's ranges are `starts[k]:starts[k+1]`)."""
    total = np.concatenate(([0], np.cumsum(lengths)))
    return int((total[starts[units + 1]] - total[starts[units]]).sum())


def check(spec: VerifySpec, slices: npt.NDArray[np.uint64], seeds: Sequence[int] | npt.NDArray[np.uint64],
          memory: Memory, views: UnitViews | None = None) -> CheckResult:
    """Compare the digest slices read from P (`slices[i]`: slice i of `spec`, entry 0 the seed)
    with digests of our own copies of the units (`views`: their bytes, when looked up already)."""
    result = CheckResult()
    expected_seed = np.asarray(seeds, dtype=np.uint64)[spec.slice_index]
    unit_slice, unit_slot = spec.unit_slice, spec.unit_slot
    if np.array_equal(slices[:, 0], expected_seed):  # the usual case: every slice sealed for us
        if not unit_slice.size:
            return result
        which: Sequence[int] = range(spec.units)
        result.hashed_bytes = spec.checked_bytes
    else:
        unsealed = np.flatnonzero(slices[:, 0] != expected_seed)
        result.unsealed = [(int(spec.slice_group[i]), int(spec.slice_index[i])) for i in unsealed]
        units = np.flatnonzero(~np.isin(unit_slice, unsealed))
        if not units.size:
            return result
        which = units.tolist()
        result.hashed_bytes = _unit_bytes(spec.piece_starts, spec.piece_len, units)
        unit_slice, unit_slot = unit_slice[units], unit_slot[units]
    if views is None:
        views = unit_views(spec, memory)
    got = np.array(_view_digests(views, which, expected_seed[unit_slice].tolist()), dtype=np.uint64)
    want = slices[unit_slice, unit_slot]
    result.units = int(unit_slice.size)
    for k in np.flatnonzero(got != want).tolist():
        s = int(unit_slice[k])
        result.mismatches.append((int(spec.slice_group[s]), int(spec.slice_index[s]),
                                  int(unit_slot[k]) - 1, int(want[k]), int(got[k])))
    return result

