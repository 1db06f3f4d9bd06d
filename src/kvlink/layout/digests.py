"""Where a worker keeps the digests of its shipped KV, and which bytes each digest covers.

A worker that ships KV keeps a digest table next to its cache: one row per logical block,
in the row one slice per KV-cache group, `[seed, digest of unit 0, digest of unit 1, ...]`
(uint64 entries). A *unit* is what any reader takes whole or not at all:

* attention: one head of one kernel page (a reader of another TP size reads whole heads);
* MLA: one kernel page (one latent per token, the same on every rank);
* SSM (Mamba2, GDN): one head unit of one sub-part (conv parts, then the state) of the
  state-bearing block.

A unit's digest runs over its bytes in every layer of the group, layer by layer. In a page
whose order keeps a unit's tokens in one run (`token_major`, MLA) it covers only the tokens
shipped, so a reader that moves token chunks can check the last, partly filled page; other
orders (vLLM's CPU pages, read whole) cover the whole unit. The slice's seed names the tokens
the block was computed from (`kvlink.layout.digests.block_seeds`), so a reader tells a block
that holds its request's KV from one that was reused, or not digested yet.

Pure: numbers and numpy arrays only; computing digests over memory is `connector.integrity`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import numpy.typing as npt
import xxhash

from kvlink.layout.geometry import Region, WorkerGeometry
from kvlink.layout.spec import SlidingWindow, is_ssm

ENTRY_BYTES = 8
_SEED_ROOT = 0x6B766C696E6B2D31  # any constant: the chain's start
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class DigestLayout:
    """The digest table of one worker: `num_blocks` rows of `row_entries` uint64 entries."""

    num_blocks: int
    group_offsets: tuple[int, ...]  # entry offset of each group's slice inside a row
    group_units: tuple[int, ...]  # digests per slice (the slice is 1 + this many entries)

    @property
    def row_entries(self) -> int:
        return sum(1 + units for units in self.group_units)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.row_entries * ENTRY_BYTES

    def slice_offset(self, group: int, block: int) -> int:
        """Byte offset of (group, block)'s slice from the table start."""
        return (block * self.row_entries + self.group_offsets[group]) * ENTRY_BYTES

    def slice_bytes(self, group: int) -> int:
        return (1 + self.group_units[group]) * ENTRY_BYTES


def group_regions(geometry: WorkerGeometry, group: int) -> tuple[Region, ...]:
    return tuple(r for r in geometry.regions if r.group == group)


def _units_per_block(geometry: WorkerGeometry, group: int) -> int:
    regions = group_regions(geometry, group)
    if not regions:
        return 0
    first = regions[0]
    if first.kind == "ssm":
        return sum(sub.length // sub.unit_bytes for sub in first.sub_parts)
    return geometry.physical_per_logical * first.units


def digest_layout(geometry: WorkerGeometry) -> DigestLayout:
    units = tuple(_units_per_block(geometry, g) for g in range(len(geometry.model.groups)))
    offsets, at = [], 0
    for n in units:
        offsets.append(at)
        at += 1 + n
    return DigestLayout(geometry.num_blocks, tuple(offsets), units)


def prefix_digests(geometry: WorkerGeometry, region: Region) -> bool:
    """True where a unit keeps its tokens in one run, so a digest can cover a token prefix."""
    return len(geometry.token_segments(region)) == 1


def shipped_blocks(geometry: WorkerGeometry, group: int, num_tokens: int, listed: int) -> range:
    """Indices into a request's block list of `group` (`listed` blocks long) whose KV ships
    for `num_tokens` tokens: every block holding them (a sliding window's from the window's
    first token on), or an SSM group's last block, which holds the state."""
    if num_tokens <= 0 or listed <= 0:
        return range(0)
    spec = geometry.model.groups[group]
    if is_ssm(spec):
        return range(listed - 1, listed)
    first = 0
    if isinstance(spec, SlidingWindow):
        first = max(0, num_tokens - spec.window) // geometry.block_size
    return range(first, min(listed, -(-num_tokens // geometry.block_size)))


def seed_index(geometry: WorkerGeometry, group: int, list_index: int, num_tokens: int) -> int:
    """Which of `block_seeds` a slice carries: its block's, or for SSM state (which follows
    every shipped token) the last."""
    if is_ssm(geometry.model.groups[group]):
        return -(-num_tokens // geometry.block_size) - 1
    return list_index


@dataclass(frozen=True)
class UnitRanges:
    """The byte ranges of some blocks' units, block by block and unit by unit in slice order:
    unit `k`'s digest runs over `addrs[k*per_unit:(k+1)*per_unit]` with their `lengths` (one
    range per layer of the group; a length of 0 is a page with no shipped token)."""

    addrs: IntArray
    lengths: IntArray
    per_unit: int
    units_per_block: int

    @property
    def units(self) -> int:
        return self.addrs.size // self.per_unit if self.per_unit else 0


@dataclass(frozen=True, eq=False)
class GroupPages:
    """One group's layers as the digests see them, as arrays (built once per geometry)."""

    ssm: bool
    bases: IntArray  # per layer of the group
    strides: IntArray
    unit_bytes: IntArray
    token_bytes: IntArray
    prefix: npt.NDArray[np.bool_]
    heads: int  # units of one attention page
    units_per_block: int
    ssm_offsets: IntArray  # [unit, layer] from the page start (SSM)
    ssm_lengths: IntArray

    @cached_property
    def all_prefix(self) -> bool:
        return bool(self.prefix.size) and bool(self.prefix.all())

    @cached_property
    def any_prefix(self) -> bool:
        return bool(self.prefix.any())


@dataclass(frozen=True, eq=False)
class DigestGeometry:
    """A worker's geometry with its digest table layout and per-group arrays."""

    geometry: WorkerGeometry
    layout: DigestLayout
    groups: tuple[GroupPages | None, ...]


def digest_geometry(geometry: WorkerGeometry) -> DigestGeometry:
    groups: list[GroupPages | None] = []
    for group in range(len(geometry.model.groups)):
        regions = group_regions(geometry, group)
        if not regions:
            groups.append(None)
            continue
        def ints(values: list[int]) -> IntArray:
            return np.array(values, dtype=np.int64)

        ssm = regions[0].kind == "ssm"
        empty = np.zeros((0, len(regions)), np.int64)
        offsets, lengths = _ssm_unit_offsets(regions) if ssm else (empty, empty)
        heads = regions[0].units
        groups.append(GroupPages(
            ssm=ssm, bases=ints([r.base for r in regions]), strides=ints([r.page_stride for r in regions]),
            unit_bytes=ints([r.unit_bytes for r in regions]), token_bytes=ints([r.token_bytes for r in regions]),
            prefix=np.array([not ssm and prefix_digests(geometry, r) for r in regions]), heads=heads,
            units_per_block=offsets.shape[0] if ssm else geometry.physical_per_logical * heads,
            ssm_offsets=offsets, ssm_lengths=lengths))
    return DigestGeometry(geometry, digest_layout(geometry), tuple(groups))


def unit_ranges(dg: DigestGeometry, group: int, blocks: npt.ArrayLike, block_indices: npt.ArrayLike,
                num_tokens: int, units: npt.ArrayLike | None = None) -> UnitRanges:
    """Where units of logical blocks `blocks` (at `block_indices` in the request's block list)
    of `group` lie in the worker's memory, for a request shipping `num_tokens` tokens: every
    unit of each block, block by block, or with `units` the one unit of each entry."""
    pages_of = dg.groups[group]
    block_ids = np.asarray(blocks, dtype=np.int64).reshape(-1)
    indices = np.asarray(block_indices, dtype=np.int64).reshape(-1)
    if pages_of is None:
        return UnitRanges(np.zeros(0, np.int64), np.zeros(0, np.int64), 0, 0)
    g = pages_of
    per_block = g.units_per_block
    if units is None:
        unit = np.arange(block_ids.size * per_block, dtype=np.int64) % max(per_block, 1)
        block_ids, indices = np.repeat(block_ids, per_block), np.repeat(indices, per_block)
    else:
        unit = np.asarray(units, dtype=np.int64).reshape(-1)
    layers = g.bases.size
    if g.ssm:
        addrs = g.bases[None, :] + block_ids[:, None] * g.strides[None, :] + g.ssm_offsets[unit]
        return UnitRanges(addrs.reshape(-1), g.ssm_lengths[unit].reshape(-1), layers, per_block)
    geometry = dg.geometry
    kbs = geometry.kernel_block_size
    page_in_block, head = np.divmod(unit, g.heads)
    # np.minimum/np.maximum: np.clip's own overhead is several times theirs on arrays this small
    page_tokens = np.minimum(np.maximum(num_tokens - indices * geometry.block_size - page_in_block * kbs, 0), kbs)
    pages = block_ids * geometry.physical_per_logical + page_in_block
    # [unit, layer]
    addrs = g.bases + pages[:, None] * g.strides + head[:, None] * g.unit_bytes
    shipped = page_tokens[:, None]
    if g.all_prefix:  # a page with no shipped token gets length 0 either way
        lengths = shipped * g.token_bytes
    elif not g.any_prefix:
        lengths = (shipped > 0) * g.unit_bytes
    else:
        lengths = np.where(shipped > 0, np.where(g.prefix, shipped * g.token_bytes, g.unit_bytes), 0)
    return UnitRanges(addrs.reshape(-1), lengths.reshape(-1), layers, per_block)


def _ssm_unit_offsets(regions: tuple[Region, ...]) -> tuple[IntArray, IntArray]:
    """[unit, layer] byte offsets from each layer's page start, and lengths, of an SSM page."""
    offsets: list[list[int]] = []
    lengths: list[list[int]] = []
    for index, sub in enumerate(regions[0].sub_parts):
        for unit in range(sub.length // sub.unit_bytes):
            parts = [region.sub_parts[index] for region in regions]
            offsets.append([part.offset + unit * part.unit_bytes for part in parts])
            lengths.append([part.unit_bytes for part in parts])
    shape = (-1, len(regions))
    return np.array(offsets, dtype=np.int64).reshape(shape), np.array(lengths, dtype=np.int64).reshape(shape)


def block_seeds(token_ids: npt.ArrayLike, block_size: int, num_tokens: int) -> list[int]:
    """Seed of each block of a request: a hash chained over the tokens `[0, end of block)`
    (the last block ends at `num_tokens`); the last entry seeds SSM state slices too.
    Both sides compute it from the prompt, so equal seeds mean equal tokens."""
    tokens = np.asarray(token_ids, dtype=np.int64)[:num_tokens]
    if tokens.size < num_tokens:
        raise ValueError(f"{tokens.size} prompt tokens, but {num_tokens} are shipped")
    data = memoryview(tokens.tobytes())
    step = block_size * tokens.itemsize
    seeds: list[int] = []
    chain = _SEED_ROOT
    for start in range(0, len(data), step):
        # 0 marks an unwritten slice, never a seed.
        chain = xxhash.xxh3_64_intdigest(data[start:start + step], seed=chain) or 1
        seeds.append(chain)
    return seeds
