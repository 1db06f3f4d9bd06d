"""Byte-level simulator: lay a known KV out in every P worker's memory, run the plan of
every D rank as byte copies, and read D's KV back through D's own geometry."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvlink.layout.geometry import Region, WorkerGeometry, build_worker_geometry, packed_base_addrs
from kvlink.layout.page_order import element_index
from kvlink.layout.spec import ModelSpec, is_ssm
from kvlink.plan.request import ReadSpec
from kvlink.plan.tp_mapping import model_parts
from kvlink.plan.transfer_plan import TransferPlan

Bytes = npt.NDArray[np.uint8]
Ints = npt.NDArray[np.int64]
MEMORY_STRIDE = 1 << 32


@dataclass
class WorkerMemory:
    """One worker's registered memory as a flat byte buffer starting at `start`."""

    geometry: WorkerGeometry
    start: int
    data: Bytes
    writes: npt.NDArray[np.int32]

    def offsets(self, addrs: npt.NDArray[np.uint64]) -> Ints:
        return addrs.astype(np.int64) - self.start


def make_worker(model: ModelSpec, tp: int, rank: int, block_size: int, kernel_block_size: int,
                num_blocks: int, side: int, rng: np.random.Generator,
                page_order: str = "token_major") -> WorkerMemory:
    start = MEMORY_STRIDE * (1 + side * 16 + rank)
    bases = packed_base_addrs(model, tp, block_size, kernel_block_size, num_blocks, start, align=64)
    geometry = build_worker_geometry(model, tp, rank, block_size, kernel_block_size, num_blocks, bases,
                                     device_id=rank, page_order=page_order)
    size = max(r.end for r in geometry.regions) - start
    data = rng.integers(0, 256, size=size, dtype=np.uint8)
    return WorkerMemory(geometry, start, data, np.zeros(size, dtype=np.int32))


@dataclass(frozen=True)
class LogicalKV:
    """The request's true state: attention/MLA rows `[token, global unit, bytes]` per layer and
    SSM parts `[global unit, bytes]` per (layer, part name)."""

    rows: dict[int, Bytes]
    ssm: dict[tuple[int, str], Bytes]


def make_logical(model: ModelSpec, num_tokens: int, rng: np.random.Generator) -> LogicalKV:
    geometry = build_worker_geometry(model, 1, 0, 1, 1, 1, packed_base_addrs(model, 1, 1, 1, 1, 0))
    rows: dict[int, Bytes] = {}
    ssm: dict[tuple[int, str], Bytes] = {}
    for region in geometry.regions:
        if region.kind == "ssm":
            for sub in region.sub_parts:
                ssm[(region.layer, sub.name)] = rng.integers(
                    0, 256, (sub.part.units, sub.unit_bytes), dtype=np.uint8)
        else:
            rows[region.layer] = rng.integers(
                0, 256, (num_tokens, region.units, region.token_bytes), dtype=np.uint8)
    return LogicalKV(rows, ssm)


def in_conv_layouts(logical: LogicalKV, model: ModelSpec, other: ModelSpec) -> LogicalKV:
    """The same state keyed by `other`'s SSM parts: `model` and `other` differ only in their
    conv layouts (a DS part `conv_x` of units `(channels, rows)` is the SD parts `conv_x.r`)."""
    e = model.dtype_bytes
    ssm = dict(logical.ssm)
    for layer, g in enumerate(model.layer_groups):
        mine, theirs = model.groups[g], other.groups[g]
        if not is_ssm(mine) or mine == theirs:
            continue
        rows = mine.conv_kernel - 1  # type: ignore[union-attr]
        for part in mine.conv_parts():  # type: ignore[union-attr]
            if mine.conv_layout == "DS":  # type: ignore[union-attr]
                units = ssm.pop((layer, part.name)).reshape(part.units, -1, rows, e)
                for r in range(rows):
                    ssm[(layer, f"{part.name}.{r}")] = units[:, :, r, :].reshape(part.units, -1).copy()
        if mine.conv_layout == "SD":  # type: ignore[union-attr]
            for part in theirs.conv_parts():  # type: ignore[union-attr]
                per_row = [ssm.pop((layer, f"{part.name}.{r}")).reshape(part.units, -1, 1, e) for r in range(rows)]
                ssm[(layer, part.name)] = np.concatenate(per_row, axis=2).reshape(part.units, -1)
    return LogicalKV(logical.rows, ssm)


def _row_offsets(region: Region, geometry: WorkerGeometry, ids: Ints, tokens: Ints, first_token: int,
                 start: int) -> Ints:
    """Buffer offsets `[token, row byte]` of each token's logical row for unit slot 0 of an
    attention/MLA region. A logical attention row is K (head_dim elements) then V; where its
    bytes lie inside the unit follows the geometry's page order through `element_index`."""
    logical = ids[(tokens - first_token) // geometry.block_size]
    assert (logical >= 0).all(), "simulator addressed a null block"
    in_block = tokens % geometry.block_size
    kernel = logical * geometry.physical_per_logical + in_block // geometry.kernel_block_size
    in_kernel = in_block % geometry.kernel_block_size
    page = (region.base - start) + kernel * region.page_stride
    row_byte = np.arange(region.token_bytes, dtype=np.int64)
    if region.kind == "mla":
        return page[:, None] + in_kernel[:, None] * region.token_bytes + row_byte[None, :]
    e = geometry.model.dtype_bytes
    head_dim = geometry.model.head_dim
    elem = row_byte // e
    index = element_index(geometry.page_order, geometry.kernel_block_size, head_dim,
                          (elem // head_dim)[None, :], in_kernel[:, None], (elem % head_dim)[None, :])
    return page[:, None] + index * e + (row_byte % e)[None, :]


def _global_units(region: Region, geometry: WorkerGeometry) -> list[int]:
    key = "kv" if region.kind == "attention" else f"g{region.group}.latent"
    part = model_parts(geometry.model)[key]
    first = part.first_unit(geometry.tp_rank, geometry.tp_size)
    return [first + s for s in range(region.units)]


def _span(offsets: Ints, length: int) -> Ints:
    return (offsets[:, None] + np.arange(length, dtype=np.int64)[None, :]).reshape(-1)


def _state_page(region: Region, mem: WorkerMemory, ids: Ints) -> int:
    return region.base - mem.start + int(ids[-1]) * region.page_stride


def store(mem: WorkerMemory, logical: LogicalKV, ids: Sequence[Ints], tokens: Sequence[Ints]) -> None:
    """Write the logical KV of `tokens[g]` (list starting at token 0) into the worker's blocks."""
    geometry = mem.geometry
    for region in geometry.regions:
        if region.kind == "ssm":
            page = _state_page(region, mem, ids[region.group])
            for sub in region.sub_parts:
                part = sub.part
                first = part.first_unit(geometry.tp_rank, geometry.tp_size)
                count = part.units_on_rank(geometry.tp_size)
                values = logical.ssm[(region.layer, sub.name)][first:first + count].reshape(-1)
                mem.data[page + sub.offset: page + sub.offset + sub.length] = values
            continue
        toks = tokens[region.group]
        base = _row_offsets(region, geometry, ids[region.group], toks, 0, mem.start)
        for slot, unit in enumerate(_global_units(region, geometry)):
            offsets = base + slot * region.unit_bytes
            mem.data[offsets.reshape(-1)] = logical.rows[region.layer][toks, unit].reshape(-1)


def load(mem: WorkerMemory, ids: Sequence[Ints], tokens: Sequence[Ints], first_token: int) -> LogicalKV:
    """Read this worker's units of `tokens[g]` back (list `ids[g]` starts at `first_token`)."""
    geometry = mem.geometry
    rows: dict[int, Bytes] = {}
    ssm: dict[tuple[int, str], Bytes] = {}
    for region in geometry.regions:
        if region.kind == "ssm":
            page = _state_page(region, mem, ids[region.group])
            for sub in region.sub_parts:
                raw = mem.data[page + sub.offset: page + sub.offset + sub.length]
                ssm[(region.layer, sub.name)] = raw.reshape(-1, sub.unit_bytes)
            continue
        toks = tokens[region.group]
        base = _row_offsets(region, geometry, ids[region.group], toks, first_token, mem.start)
        out = np.empty((toks.size, region.units, region.token_bytes), dtype=np.uint8)
        for slot in range(region.units):
            out[:, slot] = mem.data[(base + slot * region.unit_bytes).reshape(-1)].reshape(
                toks.size, region.token_bytes)
        rows[region.layer] = out
    return LogicalKV(rows, ssm)


def expected_for(mem: WorkerMemory, logical: LogicalKV, tokens: Sequence[Ints]) -> LogicalKV:
    """What `load` must return on this worker for a correct transfer."""
    geometry = mem.geometry
    rows = {}
    ssm = {}
    for region in geometry.regions:
        if region.kind == "ssm":
            for sub in region.sub_parts:
                first = sub.part.first_unit(geometry.tp_rank, geometry.tp_size)
                count = sub.part.units_on_rank(geometry.tp_size)
                ssm[(region.layer, sub.name)] = logical.ssm[(region.layer, sub.name)][first:first + count]
            continue
        units = _global_units(region, geometry)
        rows[region.layer] = logical.rows[region.layer][tokens[region.group]][:, units]
    return LogicalKV(rows, ssm)


def destination_mask(mem: WorkerMemory, ids: Sequence[Ints]) -> npt.NDArray[np.bool_]:
    """Bytes of every page of the reader's listed blocks (what a transfer may change)."""
    geometry = mem.geometry
    mask = np.zeros(mem.data.size, dtype=bool)
    for region in geometry.regions:
        group_ids = ids[region.group]
        group_ids = group_ids[group_ids >= 0]
        if region.kind == "ssm":
            pages = group_ids[-1:]
        else:
            ppl = geometry.physical_per_logical
            pages = (group_ids[:, None] * ppl + np.arange(ppl)[None, :]).reshape(-1)
        for page in pages:
            start = region.base - mem.start + int(page) * region.page_stride
            mask[start:start + region.page_len] = True
    return mask


def touched_blocks(mem: WorkerMemory, offsets: Ints) -> dict[int, set[int]]:
    """Group → logical blocks containing the given buffer offsets."""
    geometry = mem.geometry
    found: dict[int, set[int]] = {}
    for region in geometry.regions:
        lo = region.base - mem.start
        inside = offsets[(offsets >= lo) & (offsets < lo + region.num_pages * region.page_stride)]
        pages = (inside - lo) // region.page_stride
        logical = pages if region.kind == "ssm" else pages // geometry.physical_per_logical
        found.setdefault(region.group, set()).update(int(b) for b in np.unique(logical))
    return found


def execute(plan: TransferPlan, specs: Sequence[ReadSpec], reader: WorkerMemory,
            sources: dict[int, WorkerMemory]) -> None:
    """Copy bytes as NIXL would; check each ReadSpec's lengths, nbytes and reported blocks."""
    for spec in specs:
        source_plan = plan.source(spec.src_rank)
        local = source_plan.local_descs[spec.local_idx]
        remote = source_plan.remote_descs[spec.remote_idx]
        assert np.array_equal(local[:, 1], remote[:, 1]), "paired descriptors differ in length"
        assert int(local[:, 1].sum()) == spec.nbytes
        assert (local[:, 2] == reader.geometry.device_id).all()
        assert (remote[:, 2] == sources[spec.src_rank].geometry.device_id).all()
        src = sources[spec.src_rank]
        dst_offsets = reader.offsets(local[:, 0])
        src_offsets = src.offsets(remote[:, 0])
        written: list[Ints] = []
        for length in np.unique(local[:, 1]):
            same = local[:, 1] == length
            dst = _span(dst_offsets[same], int(length))
            reader.data[dst] = src.data[_span(src_offsets[same], int(length))]
            np.add.at(reader.writes, dst, 1)
            written.append(dst_offsets[same])
        if written:
            for group, blocks in touched_blocks(reader, np.concatenate(written)).items():
                assert blocks <= set(spec.local_blocks[group].tolist()), (group, blocks)


def group_is_ssm(model: ModelSpec, group: int) -> bool:
    return is_ssm(model.groups[group])
