"""Prepared descriptor lists and descriptor-id arithmetic, vectorized over numpy.

A prepared list is an Nx3 uint64 array of `(addr, len, device)`. Attention
descriptors come first, region-major (`r * N * S + b * S + piece`, S pieces per
kernel block, N kernel blocks per region on that side), then SSM descriptors
(`R_fa * N * S + s * L + b`, s over SSM sub-part pieces, L logical blocks). With
one piece per block this is the seed formula `r * N + b` / `R_fa * N + s * L + b`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]
DescArray = npt.NDArray[np.uint64]


def descriptor_ids(region_starts: IntArray, block_offsets: IntArray) -> IntArray:
    """Region-major ids: for each region start, every block offset (in the given order)."""
    return concat_descriptor_ids([(region_starts, block_offsets)])


def concat_descriptor_ids(parts: Sequence[tuple[IntArray, IntArray]]) -> IntArray:
    """`descriptor_ids` of each (region starts, block offsets) pair, concatenated.

    Writes straight into one output array: on large requests fresh allocations
    (page faults) cost more than the arithmetic.
    """
    out = np.empty(sum(starts.size * offsets.size for starts, offsets in parts), dtype=np.int64)
    pos = 0
    for starts, offsets in parts:
        size = starts.size * offsets.size
        np.add(starts[:, None], offsets[None, :], out=out[pos:pos + size].reshape(starts.size, offsets.size))
        pos += size
    return out


def desc_ids_attention(block_ids: Sequence[int] | IntArray, num_regions: int, blocks_per_region: int) -> IntArray:
    """Ids of kernel blocks `block_ids` in every attention region: `r * N + b`, region-major."""
    starts = np.arange(num_regions, dtype=np.int64) * blocks_per_region
    return descriptor_ids(starts, np.asarray(block_ids, dtype=np.int64))


def desc_ids_hybrid(
    fa_kernel_ids: Sequence[int] | IntArray,
    ssm_logical_ids: Sequence[int] | IntArray,
    num_fa_regions: int,
    num_ssm_regions: int,
    kernel_blocks_per_region: int,
    logical_blocks: int,
) -> IntArray:
    """Attention ids `r * N + b`, then SSM ids `R_fa * N + s * L + b` (s over SSM sub-part regions)."""
    attention = desc_ids_attention(fa_kernel_ids, num_fa_regions, kernel_blocks_per_region)
    ssm_starts = (num_fa_regions * kernel_blocks_per_region
                  + np.arange(num_ssm_regions, dtype=np.int64) * logical_blocks)
    ssm = descriptor_ids(ssm_starts, np.asarray(ssm_logical_ids, dtype=np.int64))
    return np.concatenate([attention, ssm])


def page_descs(
    base: int, page_stride: int, num_pages: int,
    offsets: Sequence[int] | IntArray, lengths: Sequence[int] | IntArray, device_id: int,
    out: DescArray | None = None,
) -> DescArray:
    """Descriptors for pieces (`offsets`, `lengths` within a page) of every page, page-major;
    written into `out` (`num_pages * len(offsets)` rows) when given."""
    offs = np.asarray(offsets, dtype=np.uint64)
    lens = np.asarray(lengths, dtype=np.uint64)
    pages = np.arange(num_pages, dtype=np.uint64) * np.uint64(page_stride) + np.uint64(base)
    if out is None:
        out = np.empty((num_pages * offs.size, 3), dtype=np.uint64)
    elif out.shape != (num_pages * offs.size, 3) or out.dtype != np.uint64:
        raise ValueError(f"out has shape {out.shape} {out.dtype}, not ({num_pages * offs.size}, 3) uint64")
    descs = out.reshape(num_pages, offs.size, 3)
    descs[:, :, 0] = pages[:, None] + offs[None, :]
    descs[:, :, 1] = lens[None, :]
    descs[:, :, 2] = device_id
    return out


def locate(descs: DescArray, region_bases: Sequence[int] | IntArray) -> tuple[IntArray, IntArray]:
    """(region index, byte offset from that region's base) of each descriptor's start.

    `region_bases[i]` is where region i starts; regions must not overlap (any order).
    """
    bases = np.asarray(region_bases, dtype=np.uint64)
    order = np.argsort(bases)
    slot = np.searchsorted(bases[order], descs[:, 0], side="right") - 1
    region: IntArray = order[slot].astype(np.int64)
    return region, (descs[:, 0] - bases[region]).astype(np.int64)


def count_merged(local_descs: DescArray, remote_descs: DescArray,
                 local_regions: IntArray, remote_regions: IntArray) -> int:
    """Descriptors NIXL posts after merging, for one transfer given in posting order.

    NIXL joins a descriptor pair with the next one only when both sides continue
    exactly (same device, next byte) and both stay inside one registered region:
    kvlink registers every layer's tensor on its own, so two layers packed back to
    back never merge. `local_regions[i]` / `remote_regions[i]` name the registered
    region descriptor i lies in on each side (see `locate`).
    """
    if local_descs.shape != remote_descs.shape:
        raise ValueError(f"descriptor arrays differ in shape: {local_descs.shape} vs {remote_descs.shape}")
    if local_regions.shape != (len(local_descs),) or remote_regions.shape != (len(remote_descs),):
        raise ValueError(f"expected one region index per descriptor ({len(local_descs)}); got "
                         f"{local_regions.shape} local and {remote_regions.shape} remote")
    if len(local_descs) == 0:
        return 0

    def continues(descs: DescArray, regions: IntArray) -> npt.NDArray[np.bool_]:
        joined: npt.NDArray[np.bool_] = (descs[:-1, 0] + descs[:-1, 1] == descs[1:, 0]) & (
            descs[:-1, 2] == descs[1:, 2]) & (regions[:-1] == regions[1:])
        return joined

    joins = continues(local_descs, local_regions) & continues(remote_descs, remote_regions)
    return int(len(local_descs) - np.count_nonzero(joins))
