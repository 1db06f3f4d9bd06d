"""Between a P and a D whose SSM conv states lie in different layouts (DS and SD).

A rank's conv state is one `(channels, rows)` array ("DS") or its transpose `(rows,
channels)` ("SD") at the start of each SSM page (`kvlink.layout.spec.Mamba2`), so the two
layouts take the same bytes and the temporal state after them lies at the same offset.
A reader whose layout differs from its source's is planned as if its pages had the
source's layout (`planning_view`: the same memory, other sub-parts), so the transfer is a
plain byte copy; once the load is in (and checked against P's digests, which cover P's
layout), `ConvTranspose` turns the conv state of the pages it wrote into the reader's own
layout, in place, one small array per page and layer.

Computed once per (reader, source engine): a request turns its state blocks into a few
numpy transposes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from kvlink.layout.geometry import WorkerGeometry, build_worker_geometry
from kvlink.layout.spec import GDN, ConvLayout, GroupSpec, Mamba2, ModelSpec

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# (address, nbytes) -> those bytes, writable: the reader's memory (or a simulated one)
Memory = Callable[[int, int], np.ndarray]


def conv_layouts(model: ModelSpec) -> dict[int, ConvLayout]:
    """Each SSM group's conv layout, by group index."""
    return {g: group.conv_layout for g, group in enumerate(model.groups) if isinstance(group, (Mamba2, GDN))}


def with_conv_layouts(model: ModelSpec, layouts: Mapping[int, ConvLayout]) -> ModelSpec:
    """`model` with the conv layout of SSM group g set to `layouts[g]` (others unchanged)."""
    groups: list[GroupSpec] = [
        replace(group, conv_layout=layouts[g]) if isinstance(group, (Mamba2, GDN)) and g in layouts else group
        for g, group in enumerate(model.groups)
    ]
    new = tuple(groups)
    return model if new == model.groups else replace(model, groups=new)


def same_but_conv_layouts(a: ModelSpec, b: ModelSpec) -> bool:
    """True when the two specs differ in SSM conv layouts only (or not at all)."""
    if a.compat_hash() == b.compat_hash():
        return True
    if len(a.groups) != len(b.groups) or conv_layouts(a).keys() != conv_layouts(b).keys():
        return False
    return with_conv_layouts(a, conv_layouts(b)).compat_hash() == b.compat_hash()


def planning_view(local: WorkerGeometry, remote: ModelSpec) -> WorkerGeometry:
    """`local`'s memory described in `remote`'s conv layouts when that is all that differs
    (plans against `remote` then move the conv state as a plain copy); `local` otherwise."""
    if local.model.compat_hash() == remote.compat_hash() or not same_but_conv_layouts(local.model, remote):
        return local
    return build_worker_geometry(
        with_conv_layouts(local.model, conv_layouts(remote)), local.tp_size, local.tp_rank, local.block_size,
        local.kernel_block_size, local.num_blocks, [r.base for r in local.regions], device_id=local.device_id,
        page_order=local.page_order, ssm_page_stride=local.ssm_page_stride, aliased=local.aliased)


@dataclass(frozen=True)
class ConvRegion:
    """The conv state of one SSM layer on one rank: `channels` x `rows` elements of
    `elem_bytes` at the start of every page (`base + block * page_stride`)."""

    layer: int
    group: int
    base: int
    page_stride: int
    num_pages: int
    channels: int
    rows: int
    elem_bytes: int

    @property
    def nbytes(self) -> int:
        return self.channels * self.rows * self.elem_bytes


@dataclass(frozen=True)
class ConvTranspose:
    """Turns conv states written in `arrived` layouts (per SSM group) into the reader's."""

    arrived: Mapping[int, ConvLayout]
    regions: tuple[ConvRegion, ...]

    @property
    def groups(self) -> tuple[int, ...]:
        return tuple(sorted(self.arrived))

    def apply(self, blocks: Mapping[int, Iterable[int]], memory: Memory) -> int:
        """Re-lay out the conv state of `blocks[g]` (the state blocks a load wrote, per SSM
        group) in every layer of group g, reaching the pages through `memory`; returns the
        bytes re-laid out."""
        moved = 0
        for region in self.regions:
            ids = sorted({int(b) for b in blocks.get(region.group, ())})
            if not ids:
                continue
            if ids[0] < 0 or ids[-1] >= region.num_pages:
                raise ValueError(f"SSM state blocks {ids} of group {region.group} outside "
                                 f"[0, {region.num_pages})")
            for block in ids:
                page = memory(region.base + block * region.page_stride, region.nbytes)
                transpose_in_place(page, region.channels, region.rows, region.elem_bytes,
                                   self.arrived[region.group])
                moved += region.nbytes
        return moved


def transpose_in_place(data: np.ndarray, channels: int, rows: int, elem_bytes: int,
                       arrived: ConvLayout) -> None:
    """`data` (the conv state's bytes) holds `(channels, rows)` ("DS" arrived) or `(rows,
    channels)` ("SD" arrived) elements: rewrite it as the other one."""
    elems = data.view(_UINT[elem_bytes])
    shape = (channels, rows) if arrived == "DS" else (rows, channels)
    elems[:] = elems.reshape(shape).T.reshape(-1).copy()


def conv_transpose(local: WorkerGeometry, view: WorkerGeometry) -> ConvTranspose | None:
    """What turns pages written as `view` (see `planning_view`) into `local`'s layout; None
    when the two lay the conv state out alike."""
    own, arrived = conv_layouts(local.model), conv_layouts(view.model)
    differ = {g: arrived[g] for g in own if arrived.get(g, own[g]) != own[g]}
    if not differ:
        return None
    regions = []
    for region in local.ssm_regions:
        if region.group not in differ:
            continue
        conv = region.sub_parts[:-1]  # conv parts in the model's dtype, then the temporal state
        nbytes = sum(part.length for part in conv)
        group = local.model.groups[region.group]
        assert isinstance(group, (Mamba2, GDN))
        rows, e = group.conv_kernel - 1, local.model.dtype_bytes
        if conv[0].offset != 0 or nbytes % (rows * e):
            raise ValueError(f"layer {region.layer}: conv state of {nbytes} bytes at offset "
                             f"{conv[0].offset} is not {rows} rows of {local.model.dtype} elements")
        regions.append(ConvRegion(region.layer, region.group, region.base, region.page_stride,
                                  region.num_pages, nbytes // (rows * e), rows, e))
    return ConvTranspose(differ, tuple(regions))

