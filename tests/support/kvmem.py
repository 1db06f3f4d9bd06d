"""Real memory for connector tests: a numpy buffer laid out by the simulator's geometry."""

from __future__ import annotations

import numpy as np
import sim

from kvlink.layout.geometry import build_worker_geometry, packed_base_addrs
from kvlink.layout.spec import ModelSpec

ALIGN = 4096


def real_worker(model: ModelSpec, tp: int, rank: int, block_size: int, kernel_block_size: int,
                num_blocks: int, seed: int, page_order: str = "token_major") -> sim.WorkerMemory:
    """A worker whose regions live in one real, page-aligned numpy buffer filled with noise."""
    probe = packed_base_addrs(model, tp, block_size, kernel_block_size, num_blocks, 0, align=ALIGN)
    probe_geo = build_worker_geometry(model, tp, rank, block_size, kernel_block_size, num_blocks, probe)
    size = max(r.end for r in probe_geo.regions)
    raw = np.random.default_rng(seed).integers(0, 256, size=size + ALIGN, dtype=np.uint8)
    shift = (-raw.ctypes.data) % ALIGN
    data = raw[shift:shift + size]
    start = data.ctypes.data
    bases = packed_base_addrs(model, tp, block_size, kernel_block_size, num_blocks, start, align=ALIGN)
    geometry = build_worker_geometry(model, tp, rank, block_size, kernel_block_size, num_blocks, bases,
                                     page_order=page_order)
    mem = sim.WorkerMemory(geometry, start, data, np.zeros(1, dtype=np.int32))
    mem.owner = raw  # type: ignore[attr-defined]  # keep the allocation alive
    return mem


def region_sizes(mem: sim.WorkerMemory) -> tuple[list[int], list[int]]:
    regions = mem.geometry.regions
    return [r.base for r in regions], [r.page_stride * r.num_pages for r in regions]
