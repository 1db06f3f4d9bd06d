"""Registered memory for KV digests: P's digest table, and D's slots that READs land slices in.

P seals a request's blocks into its table (`kvlink.layout.digests` lays it out) when the
request's KV is final; D reads the slices of the blocks it loads right after the KV,
into slots of its own, and checks them once the READ is done. Neither side posts more
than integers per request: the descriptor lists below are built once per remote engine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvlink.connector.integrity import Memory, seal
from kvlink.connector.staging import populated_bytes
from kvlink.layout.digests import (
    ENTRY_BYTES,
    DigestLayout,
    block_seeds,
    digest_geometry,
    digest_layout,
)
from kvlink.layout.geometry import WorkerGeometry
from kvlink.plan.descriptors import DescArray, IntArray
from kvlink.transfer.agent import NixlAgent


class DigestTable:
    """P side: one row of digest slices per logical block, registered for peers to read."""

    def __init__(self, geometry: WorkerGeometry, agent: NixlAgent) -> None:
        self.geometry = geometry
        self.digests = digest_geometry(geometry)
        self.layout = self.digests.layout
        self._map, data = populated_bytes(max(self.layout.nbytes, ENTRY_BYTES))
        self.base = int(data.ctypes.data)
        self.table = data[:self.layout.nbytes].view(np.uint64).reshape(self.layout.num_blocks,
                                                                          self.layout.row_entries)
        agent.register_regions([(self.base, max(self.layout.nbytes, ENTRY_BYTES))])

    def seal(self, memory: Memory, block_ids: Sequence[Sequence[int]], token_ids: Sequence[int],
             num_tokens: int) -> int:
        """Digest a finished request's shipped units; bytes hashed."""
        if num_tokens <= 0:
            return 0
        seeds = block_seeds(token_ids, self.geometry.block_size, num_tokens)
        return seal(self.table, self.digests, memory, block_ids, num_tokens, seeds)


def table_descs(remote: WorkerGeometry, base: int) -> DescArray:
    """Descriptors of every slice of a remote digest table: id `group * num_blocks + block`."""
    layout = digest_layout(remote)
    blocks = np.arange(layout.num_blocks, dtype=np.uint64)
    rows = []
    for group in range(len(layout.group_units)):
        addrs = base + blocks * layout.row_entries * ENTRY_BYTES + layout.group_offsets[group] * ENTRY_BYTES
        rows.append(np.stack([addrs, np.full_like(addrs, layout.slice_bytes(group)),
                              np.full_like(addrs, remote.device_id)], axis=1))
    return np.concatenate(rows).astype(np.uint64) if rows else np.zeros((0, 3), dtype=np.uint64)


class DigestSlots:
    """D side, per remote engine: `slots` rows shaped like that engine's table rows, where a
    load's READ puts the slices of its blocks."""

    def __init__(self, layout: DigestLayout, slots: int, agent: NixlAgent, device_id: int) -> None:
        self.layout = layout
        self.slots = slots
        self.slice_bytes = np.array([layout.slice_bytes(g) for g in range(len(layout.group_units))], dtype=np.int64)
        nbytes = max(slots * layout.row_entries * ENTRY_BYTES, ENTRY_BYTES)
        self._map, data = populated_bytes(nbytes)
        self.base = int(data.ctypes.data)
        self.rows = data[:slots * layout.row_entries * ENTRY_BYTES].view(np.uint64).reshape(
            slots, layout.row_entries)
        self.device_id = device_id
        agent.register_regions([(self.base, nbytes)])
        self._free: deque[int] = deque(range(slots))
        # `slices` gathers a landed slice as one padded row: column k of group g's slice is
        # entry `group_offsets[g] + k` of its row while k < 1 + group_units[g], else 0.
        width = 1 + max(layout.group_units, default=0)
        k = np.arange(width, dtype=np.int64)
        sizes = 1 + np.array(layout.group_units, dtype=np.int64)
        self._valid = k[None, :] < sizes[:, None]
        self._padded = not bool(self._valid.all())
        self._cols = np.where(self._valid, np.array(layout.group_offsets, dtype=np.int64)[:, None] + k, 0)

    def descs(self) -> DescArray:
        """Local descriptors, id `group * slots + slot`, paired in length with `table_descs`."""
        layout = self.layout
        slots = np.arange(self.slots, dtype=np.uint64)
        rows = []
        for group in range(len(layout.group_units)):
            addrs = self.base + slots * layout.row_entries * ENTRY_BYTES + layout.group_offsets[group] * ENTRY_BYTES
            rows.append(np.stack([addrs, np.full_like(addrs, layout.slice_bytes(group)),
                                  np.full_like(addrs, self.device_id)], axis=1))
        return np.concatenate(rows).astype(np.uint64) if rows else np.zeros((0, 3), dtype=np.uint64)

    def take(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        return [self._free.popleft() for _ in range(count)]

    def give(self, slots: Sequence[int]) -> None:
        self._free.extend(slots)

    @property
    def free(self) -> int:
        return len(self._free)

    def slices(self, groups: IntArray, slots: Sequence[int]) -> npt.NDArray[np.uint64]:
        """The slices that landed, one per (group, slot) pair, padded to one width."""
        if not len(slots):
            return np.zeros((0, self._cols.shape[1]), dtype=np.uint64)
        out: npt.NDArray[np.uint64] = self.rows[np.asarray(slots, dtype=np.int64)[:, None], self._cols[groups]]
        if self._padded:
            out[~self._valid[groups]] = 0
        return out


class DigestSlotPools:
    """A reader worker's slot pools, one per source layout (sources of one engine share it)."""

    def __init__(self, agent: NixlAgent, device_id: int, slots: int) -> None:
        self.agent, self.device_id, self.slots = agent, device_id, slots
        self._pools: dict[tuple[tuple[int, ...], tuple[int, ...]], DigestSlots] = {}

    def __call__(self, remote: WorkerGeometry) -> DigestSlots:
        layout = digest_layout(remote)
        key = (layout.group_offsets, layout.group_units)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = DigestSlots(layout, self.slots, self.agent, self.device_id)
        return pool
