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

import numpy as np
import numpy.typing as npt
import xxhash

from kvlink.layout.digests import DigestGeometry, seed_index, shipped_blocks, unit_ranges
from kvlink.plan.verify import VerifySpec

Memory = Callable[[int, int], memoryview]


class AddressSpace:
    """Bytes by address inside areas this process owns (cache tensors, staging pages)."""

    def __init__(self, areas: Sequence[tuple[int, int]]) -> None:
        # Aliased layers (vLLM's hybrid cache) list one memory several times: merge overlaps.
        spans: list[list[int]] = []
        for base, n in sorted((int(b), int(n)) for b, n in areas if n > 0):
            if spans and base <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], base + n)
            else:
                spans.append([base, base + n])
        self._bases = [base for base, _ in spans]
        self._views = [memoryview((ctypes.c_uint8 * (end - base)).from_address(base)).cast("B")
                       for base, end in spans]

    def add(self, base: int, data: npt.NDArray[np.uint8]) -> None:
        at = bisect.bisect(self._bases, base)
        self._bases.insert(at, base)
        self._views.insert(at, data.data.cast("B"))

    def __call__(self, addr: int, length: int) -> memoryview:
        at = bisect.bisect_right(self._bases, addr) - 1
        if at < 0:
            raise ValueError(f"address {addr:#x} is below every registered area")
        offset = addr - self._bases[at]
        view = self._views[at]
        if offset + length > view.nbytes:
            raise ValueError(f"range {addr:#x}+{length} runs past its area")
        return view[offset:offset + length]


def digest_of(memory: Memory, addrs: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64], seed: int) -> int:
    h = xxhash.xxh3_64(seed=seed)
    for addr, length in zip(addrs.tolist(), lengths.tolist(), strict=True):
        if length:
            h.update(memory(addr, length))
    return int(h.intdigest())


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
        offset = layout.group_offsets[group]
        for b, (block, index) in enumerate(zip(blocks.tolist(), indices, strict=True)):
            seed = seeds[seed_index(geometry, group, index, num_tokens)]
            row = table[block]
            for unit in range(per_block):
                span = slice((b * per_block + unit) * per_unit, (b * per_block + unit + 1) * per_unit)
                row[offset + 1 + unit] = digest_of(memory, ranges.addrs[span], ranges.lengths[span], seed)
                hashed += int(ranges.lengths[span].sum())
            row[offset] = seed
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


def check(spec: VerifySpec, slices: npt.NDArray[np.uint64], seeds: Sequence[int], memory: Memory) -> CheckResult:
    """Compare the digest slices read from P (`slices[i]`: slice i of `spec`, entry 0 the seed)
    with digests of our own copies of the units."""
    result = CheckResult()
    expected_seed = np.asarray(seeds, dtype=np.uint64)[spec.slice_index]
    unsealed = np.flatnonzero(slices[:, 0] != expected_seed)
    bad_slice = set(unsealed.tolist())
    result.unsealed = [(int(spec.slice_group[i]), int(spec.slice_index[i])) for i in unsealed]
    for k in range(spec.units):
        s = int(spec.unit_slice[k])
        if s in bad_slice:
            continue
        span = slice(int(spec.piece_starts[k]), int(spec.piece_starts[k + 1]))
        got = digest_of(memory, spec.piece_addr[span], spec.piece_len[span], int(expected_seed[s]))
        result.units += 1
        result.hashed_bytes += int(spec.piece_len[span].sum())
        want = int(slices[s, int(spec.unit_slot[k])])
        if got != want:
            result.mismatches.append((int(spec.slice_group[s]), int(spec.slice_index[s]),
                                      int(spec.unit_slot[k]) - 1, want, got))
    return result
