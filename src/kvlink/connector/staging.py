"""Staging pages on a reader worker: P-sized pages registered with NIXL, handed out per load.

A staged read (`kvlink.plan.staged`) lands whole P pages here; once every READ of the
load is done the worker copies the tokens into its own pages (`relayout`) and the
slots go back. Slots of a load that stalled stay out of use for the quarantine time:
a frozen peer may still deliver into them.
"""

from __future__ import annotations

import ctypes
import mmap
from collections import deque
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvlink.layout.geometry import Region, WorkerGeometry
from kvlink.layout.relayout import RunArray, copy_token_runs
from kvlink.plan.staged import staging_geometry, staging_layer_bytes, staging_page_bytes
from kvlink.transfer.agent import NixlAgent

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
Pages = npt.NDArray[np.generic]


def populated_bytes(nbytes: int) -> tuple[mmap.mmap, npt.NDArray[np.uint8]]:
    """Page-aligned anonymous memory with every page already mapped: a READ into pages the
    kernel has yet to fault in ran 10x slower here (35 ms instead of 4 for 5.9 MB)."""
    populate = getattr(mmap, "MAP_POPULATE", 0)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    data = np.frombuffer(region, dtype=np.uint8)
    if not populate:
        data.fill(0)
    return region, data


def bytes_at(address: int, nbytes: int) -> npt.NDArray[np.uint8]:
    """Writable bytes of memory this process owns elsewhere (the engine's KV allocation)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


def pages_at(region: Region, elem_bytes: int) -> Pages:
    """A writable `[page, unit, unit elements]` view of an attention region's memory."""
    flat = bytes_at(region.base, region.num_pages * region.page_stride)
    pages = np.lib.stride_tricks.as_strided(
        flat, (region.num_pages, region.page_len), (region.page_stride, 1), writeable=True)
    return pages.view(_UINT[elem_bytes]).reshape(region.num_pages, region.units, -1)


def layer_stack(regions: Sequence[Region], elem_bytes: int) -> Pages | None:
    """One `[layer, page, unit, elements]` view when the layers sit equally spaced with packed
    pages (vLLM's one allocation); None otherwise."""
    first = regions[0]
    if len(regions) < 2 or first.page_stride != first.page_len:
        return None
    step = regions[1].base - first.base
    same = all(r.page_len == first.page_len and r.page_stride == first.page_stride
               and r.num_pages == first.num_pages and r.units == first.units for r in regions)
    if not same or step < first.num_pages * first.page_len or step % elem_bytes or any(
            r.base != first.base + i * step for i, r in enumerate(regions)):
        return None
    span = step * (len(regions) - 1) + first.num_pages * first.page_len
    flat = bytes_at(first.base, span).view(_UINT[elem_bytes])
    unit = first.unit_bytes // elem_bytes
    e = elem_bytes
    return np.lib.stride_tricks.as_strided(
        flat, (len(regions), first.num_pages, first.units, unit),
        (step, first.page_len, first.unit_bytes, e), writeable=True)


class LocalPages:
    """The reader's attention pages as numpy views, built once at the first staged read."""

    def __init__(self, geometry: WorkerGeometry) -> None:
        e = geometry.model.dtype_bytes
        regions = geometry.attention_regions
        self.groups = [r.group for r in regions]  # each attention layer's group
        self.stack = layer_stack(regions, e)
        self.layers = [] if self.stack is not None else [pages_at(r, e) for r in regions]


class StagingPool:
    """`slots` staging pages of one P kernel block size, for every layer: the attention
    layers' areas first (one `[layer, slot, unit, elements]` array), then the SSM layers'."""

    def __init__(self, local: WorkerGeometry, remote_kernel_block_size: int, capacity_bytes: int,
                 agent: NixlAgent) -> None:
        slot_bytes = staging_page_bytes(local, remote_kernel_block_size)
        self.slots = capacity_bytes // slot_bytes
        if self.slots < 1:
            raise ValueError(f"staging area of {capacity_bytes} bytes holds no staging page of "
                             f"{remote_kernel_block_size} tokens ({slot_bytes} bytes over all layers); "
                             f"raise staging_mib")
        self.kernel_block_size = remote_kernel_block_size
        self.slot_bytes = slot_bytes
        sizes = [self.slots * b for b in staging_layer_bytes(local, remote_kernel_block_size)]
        total = sum(sizes)
        self._map, self.data = populated_bytes(total)
        start = self.base = int(self.data.ctypes.data)
        order = sorted(range(len(sizes)), key=lambda i: local.regions[i].kind == "ssm")  # attention first
        offsets = [0] * len(sizes)
        cursor = 0
        for i in order:
            offsets[i] = cursor
            cursor += sizes[i]
        self.geometry = staging_geometry(local, remote_kernel_block_size, self.slots,
                                         [start + offset for offset in offsets])
        agent.register_regions([(start, total)])
        e = local.model.dtype_bytes
        regions = self.geometry.attention_regions
        attention_bytes = sum(sizes[i] for i in order if local.regions[i].kind != "ssm")
        self.pages = self.data[:attention_bytes].view(_UINT[e]).reshape(
            len(regions), self.slots, regions[0].units, -1)
        self._free: deque[int] = deque(range(self.slots))
        self._held: list[tuple[float, tuple[int, ...]]] = []

    @property
    def capacity_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, count: int, now: float) -> tuple[int, ...] | None:
        """`count` free slots, or None when fewer are free now (quarantined ones return in time)."""
        self._expire(now)
        if count > len(self._free):
            return None
        return tuple(self._free.popleft() for _ in range(count))

    def give(self, slots: Sequence[int]) -> None:
        self._free.extend(slots)

    def quarantine(self, slots: Sequence[int], until: float) -> None:
        self._held.append((until, tuple(slots)))

    def _expire(self, now: float) -> None:
        keep = []
        for until, slots in self._held:
            if until <= now:
                self._free.extend(slots)
            else:
                keep.append((until, slots))
        self._held = keep

    def relayout(self, local: LocalPages, local_kernel_block_size: int, order: str, head_dim: int,
                 runs: Sequence[RunArray]) -> None:
        """Copy a finished load's tokens from its staging slots into the reader's pages:
        `runs[g]` for every attention layer of group g."""
        if local.stack is not None and len(runs) == 1:
            copy_token_runs(self.pages, self.kernel_block_size, local.stack, local_kernel_block_size,
                            order, head_dim, runs[0])
            return
        for layer, group in enumerate(local.groups):
            if not runs[group].size:
                continue
            pages = local.stack[layer] if local.stack is not None else local.layers[layer]
            copy_token_runs(self.pages[layer], self.kernel_block_size, pages, local_kernel_block_size,
                            order, head_dim, runs[group])
