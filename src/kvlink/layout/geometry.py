"""Byte geometry of one worker's KV memory: one region per layer tensor, cut into pages.

Computed once at registration and frozen. `to_wire()` / `from_wire()` carry it to
the peer, which rebuilds the same object and plans against it.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvlink.layout.limits import NUM_BLOCKS, TP, check, int_range
from kvlink.layout.page_order import (
    DEFAULT_PAGE_ORDER,
    PAGE_ORDERS,
    Segment,
    check_page_order,
    unit_segments,
)
from kvlink.layout.spec import GDN, MLA, Mamba2, ModelSpec, ShardedPart, is_ssm
from kvlink.layout.tensors import TensorSpec, check_block_sizes, kv_tensor_specs, ssm_part_bytes

RegionKind = Literal["attention", "mla", "ssm"]
WIRE_VERSION = 1
ADDRESS_LIMIT = 2**64
DEVICE_ID = int_range(0, 2**31 - 1)


@dataclass(frozen=True)
class SubPart:
    """One sharded piece of an SSM page on this worker, in bytes from the page start."""

    name: str
    offset: int
    length: int
    unit_bytes: int
    part: ShardedPart


@dataclass(frozen=True)
class Region:
    """One layer tensor: `num_pages` pages of `page_len` bytes, `page_stride` apart.

    Attention and MLA pages are `[units, kernel_block_size, token_bytes]` (units = KV heads
    on this rank, or 1 for MLA), indexed by kernel block. SSM pages are indexed by logical
    block and made of `sub_parts` (conv parts, then the temporal state).
    """

    layer: int
    group: int
    kind: RegionKind
    base: int
    page_len: int
    page_stride: int
    num_pages: int
    units: int = 1
    token_bytes: int = 0
    sub_parts: tuple[SubPart, ...] = ()

    @property
    def end(self) -> int:
        return self.base + self.num_pages * self.page_stride

    @property
    def unit_bytes(self) -> int:
        """Bytes of one head (or the MLA latent) in one attention page."""
        return self.page_len // self.units


@dataclass(frozen=True)
class WorkerGeometry:
    """Everything a peer needs to address this worker's KV memory; built by `build_worker_geometry`."""

    model: ModelSpec
    tp_size: int
    tp_rank: int
    block_size: int
    kernel_block_size: int
    num_blocks: int
    device_id: int
    regions: tuple[Region, ...]
    page_order: str = DEFAULT_PAGE_ORDER
    # SSM pages `ssm_page_stride` bytes apart (an engine that pads them to its attention page);
    # None: packed. `aliased`: layers of different groups share memory, one block id being
    # used by one group at a time (vLLM's hybrid KV cache); layers of one group never overlap.
    ssm_page_stride: int | None = None
    aliased: bool = False

    @property
    def physical_per_logical(self) -> int:
        return self.block_size // self.kernel_block_size

    @property
    def kernel_blocks(self) -> int:
        return self.num_blocks * self.physical_per_logical

    @property
    def attention_regions(self) -> tuple[Region, ...]:
        """Attention and MLA regions in layer order: the first part of every descriptor list."""
        return tuple(r for r in self.regions if r.kind != "ssm")

    @property
    def ssm_regions(self) -> tuple[Region, ...]:
        return tuple(r for r in self.regions if r.kind == "ssm")

    def token_segments(self, region: Region) -> tuple[Segment, ...]:
        """Segments of one unit of an attention or MLA region (see `kvlink.layout.page_order`)."""
        if region.kind == "attention":
            return unit_segments(self.page_order, self.kernel_block_size, self.model.head_dim,
                                 self.model.dtype_bytes)
        if region.kind == "mla":
            return (Segment(0, 1, region.token_bytes),)
        raise ValueError(f"layer {region.layer} is an SSM region: its pages have no token segments")

    def to_wire(self) -> dict[str, Any]:
        """Plain ints, strs, lists and dicts; `from_wire` rebuilds an equal geometry."""
        return {
            "version": WIRE_VERSION,
            "model": self.model.to_dict(),
            "compat_hash": self.model.compat_hash(),
            "tp_size": self.tp_size,
            "tp_rank": self.tp_rank,
            "block_size": self.block_size,
            "kernel_block_size": self.kernel_block_size,
            "num_blocks": self.num_blocks,
            "device_id": self.device_id,
            "base_addrs": [r.base for r in self.regions],
            "page_order": self.page_order,
            "ssm_page_stride": self.ssm_page_stride,
            "aliased": self.aliased,
        }

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> WorkerGeometry:
        """Rebuild a peer's geometry; raises ValueError naming what is malformed."""
        if wire.get("version") != WIRE_VERSION:
            raise ValueError(f"geometry wire version {wire.get('version')!r}, expected {WIRE_VERSION}")
        try:
            model = ModelSpec.from_dict(dict(wire["model"]))
            ints = {k: wire[k] for k in ("tp_size", "tp_rank", "block_size", "kernel_block_size",
                                         "num_blocks", "device_id")}
            bases = list(wire["base_addrs"])
            claimed_hash = wire["compat_hash"]
            page_order = wire.get("page_order", DEFAULT_PAGE_ORDER)  # peers before page orders
            ssm_page_stride = wire.get("ssm_page_stride")
            aliased = wire.get("aliased", False)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed geometry wire: missing or bad field {exc}") from exc
        bad = [k for k, v in ints.items() if type(v) is not int]
        bad += ["base_addrs"] if any(type(b) is not int for b in bases) else []
        if bad:
            raise ValueError(f"malformed geometry wire: fields {bad} must be integers")
        if claimed_hash != model.compat_hash():
            raise ValueError("geometry wire compat_hash does not match its model spec")
        if not isinstance(page_order, str):
            raise ValueError(f"malformed geometry wire: page_order must be a string, got {page_order!r}")
        if ssm_page_stride is not None and type(ssm_page_stride) is not int:
            raise ValueError(f"malformed geometry wire: ssm_page_stride must be an integer, got {ssm_page_stride!r}")
        if not isinstance(aliased, bool):
            raise ValueError(f"malformed geometry wire: aliased must be a boolean, got {aliased!r}")
        return build_worker_geometry(
            model, ints["tp_size"], ints["tp_rank"], ints["block_size"], ints["kernel_block_size"],
            ints["num_blocks"], bases, device_id=ints["device_id"], page_order=page_order,
            ssm_page_stride=ssm_page_stride, aliased=aliased,
        )


def ssm_sub_parts(group: Mamba2 | GDN, tp_size: int, dtype_bytes: int) -> tuple[SubPart, ...]:
    """Byte offsets and lengths of an SSM page's parts (conv x|B|C or Q|K|V, then state)."""
    parts = (*group.conv_parts(), group.state_part())
    return tuple(
        SubPart(
            name=part.name,
            offset=offset,
            length=length,
            unit_bytes=length // part.units_on_rank(tp_size),
            part=part,
        )
        for part, (offset, length) in zip(parts, ssm_part_bytes(group, tp_size, dtype_bytes), strict=True)
    )


def remote_sub_part_slice(sub_part: SubPart, first_unit_slot: int, count: int) -> tuple[int, int]:
    """(offset, length) in bytes of `count` units starting at slot `first_unit_slot` of a part.

    Use with the sub-parts of a peer's geometry (its own TP size) to find where a
    head-sharded piece of its SSM page lies.
    """
    if first_unit_slot < 0 or (first_unit_slot + count) * sub_part.unit_bytes > sub_part.length:
        raise ValueError(
            f"units [{first_unit_slot}, {first_unit_slot + count}) outside part {sub_part.name!r} "
            f"of {sub_part.length // sub_part.unit_bytes} units"
        )
    return sub_part.offset + first_unit_slot * sub_part.unit_bytes, count * sub_part.unit_bytes


def _region_for(spec: TensorSpec, model: ModelSpec, tp_size: int, base: int,
                ssm_page_stride: int | None = None) -> Region:
    dtype_bytes = model.dtype_bytes
    page_elems = 1
    for dim in spec.shape[1:]:
        page_elems *= dim
    page_len = page_elems * dtype_bytes
    num_pages = spec.shape[0]
    group = model.groups[spec.group]
    if spec.kind == "ssm":
        assert is_ssm(group) and isinstance(group, (Mamba2, GDN))
        parts = ssm_sub_parts(group, tp_size, dtype_bytes)
        stride = page_len if ssm_page_stride is None else ssm_page_stride
        if stride < page_len:
            raise ValueError(f"ssm_page_stride {stride} is smaller than the SSM page of layer "
                             f"{spec.layer} ({page_len} bytes)")
        return Region(spec.layer, spec.group, "ssm", base, page_len, stride, num_pages, sub_parts=parts)
    if spec.kind == "mla":
        assert isinstance(group, MLA)
        return Region(spec.layer, spec.group, "mla", base, page_len, page_len, num_pages,
                      units=1, token_bytes=group.latent_dim * dtype_bytes)
    heads = spec.shape[1]
    return Region(spec.layer, spec.group, "attention", base, page_len, page_len, num_pages,
                  units=heads, token_bytes=2 * model.head_dim * dtype_bytes)


def build_worker_geometry(
    model: ModelSpec,
    tp_size: int,
    tp_rank: int,
    block_size: int,
    kernel_block_size: int,
    num_blocks: int,
    base_addrs: Sequence[int],
    device_id: int = 0,
    page_order: str = DEFAULT_PAGE_ORDER,
    ssm_page_stride: int | None = None,
    aliased: bool = False,
) -> WorkerGeometry:
    """The geometry of the tensors `kv_tensor_specs` describes, placed at `base_addrs` (one per layer).

    `page_order` is the element order inside each head's unit of an attention page
    (`kvlink.layout.page_order.PAGE_ORDERS`); MLA and SSM pages are only token-major.
    """
    check_worker_sizes(tp_size, tp_rank, block_size, kernel_block_size, num_blocks)
    check("device_id", device_id, DEVICE_ID)
    check_model_page_order(model, kernel_block_size, page_order)
    if len(base_addrs) != model.num_layers:
        raise ValueError(f"expected {model.num_layers} base addresses (one per layer), got {len(base_addrs)}")
    bad = [(i, b) for i, b in enumerate(base_addrs) if isinstance(b, bool) or not isinstance(b, numbers.Integral)]
    if bad:
        raise ValueError(f"base address of layer {bad[0][0]} must be an integer, got "
                         f"{type(bad[0][1]).__name__} {bad[0][1]!r}"[:200])
    specs = kv_tensor_specs(model, tp_size, block_size, kernel_block_size, num_blocks)
    if ssm_page_stride is not None:
        check("ssm_page_stride", ssm_page_stride, int_range(1, 2**40))
    regions = tuple(_region_for(s, model, tp_size, int(b), ssm_page_stride)
                    for s, b in zip(specs, base_addrs, strict=True))
    if aliased:
        for group in range(len(model.groups)):
            _check_no_overlap([r for r in regions if r.group == group])
    _check_no_overlap(regions if not aliased else [])
    _check_address_range(regions)
    return WorkerGeometry(model, tp_size, tp_rank, block_size, kernel_block_size, num_blocks,
                          device_id, regions, page_order, ssm_page_stride, aliased)


def check_model_page_order(model: ModelSpec, kernel_block_size: int, page_order: str) -> None:
    """ValueError unless `model`'s attention pages can use `page_order` (MLA only token-major)."""
    if page_order in PAGE_ORDERS and page_order != DEFAULT_PAGE_ORDER and any(
            isinstance(g, MLA) for g in model.groups):
        raise ValueError(f"page order {page_order!r} is for attention heads; MLA latent pages are "
                         f"only supported in {DEFAULT_PAGE_ORDER!r}")
    check_page_order(page_order, kernel_block_size, model.head_dim, model.dtype)


def check_worker_sizes(tp_size: int, tp_rank: int, block_size: int, kernel_block_size: int,
                       num_blocks: int) -> None:
    """ValueError naming the first size out of range (see `kvlink.layout.limits`)."""
    check("tp_size", tp_size, TP)
    check("tp_rank", tp_rank, int_range(0, tp_size - 1))
    check_block_sizes(block_size, kernel_block_size)
    check("num_blocks", num_blocks, NUM_BLOCKS)


def _check_address_range(regions: Sequence[Region]) -> None:
    ordered = sorted(regions, key=lambda r: r.base)
    if ordered and ordered[0].base < 0:
        raise ValueError(f"negative base address {ordered[0].base} for layer {ordered[0].layer}")
    last = max(regions, key=lambda r: r.end, default=None)
    if last is not None and last.end > ADDRESS_LIMIT:
        raise ValueError(f"layer {last.layer} tensor [{last.base:#x}, {last.end:#x}) ends past the "
                         f"64-bit address space; check its base address and the model's sizes")


def _check_no_overlap(regions: Sequence[Region]) -> None:
    ordered = sorted(regions, key=lambda r: r.base)
    if ordered and ordered[0].base < 0:
        raise ValueError(f"negative base address {ordered[0].base} for layer {ordered[0].layer}")
    if ordered and ordered[-1].end > ADDRESS_LIMIT:
        last = ordered[-1]
        raise ValueError(f"layer {last.layer} tensor [{last.base:#x}, {last.end:#x}) ends past the "
                         f"64-bit address space; check its base address and the model's sizes")
    for prev, cur in itertools.pairwise(ordered):
        if cur.base < prev.end:
            raise ValueError(
                f"layer {cur.layer} tensor at {cur.base:#x} overlaps layer {prev.layer} "
                f"[{prev.base:#x}, {prev.end:#x})"
            )


def packed_base_addrs(
    model: ModelSpec, tp_size: int, block_size: int, kernel_block_size: int, num_blocks: int,
    start: int, align: int = 4096,
) -> list[int]:
    """Deterministic base addresses that pack a worker's tensors back to back (for tools and tests)."""
    addrs = []
    cursor = start
    for spec in kv_tensor_specs(model, tp_size, block_size, kernel_block_size, num_blocks):
        addrs.append(cursor)
        size = model.dtype_bytes
        for dim in spec.shape:
            size *= dim
        cursor += -(-size // align) * align
    return addrs
