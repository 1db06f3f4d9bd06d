"""Shapes of the KV tensors one worker allocates, and the element layout of an SSM state page."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvlink.layout.limits import BLOCK_SIZE, NUM_BLOCKS, TP, check
from kvlink.layout.spec import DTYPE_BYTES, GDN, MLA, GroupSpec, Mamba2, ModelSpec, is_ssm

TensorKind = Literal["attention", "mla", "ssm"]


@dataclass(frozen=True)
class TensorSpec:
    """One layer's cache tensor on one worker. Row 0 of `shape` is the block axis."""

    layer: int
    group: int
    kind: TensorKind
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class PageSlice:
    """A named piece of an SSM page, in elements from the page start."""

    name: str
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def check_block_sizes(block_size: int, kernel_block_size: int) -> int:
    """Return `physical_per_logical`, refusing sizes out of range or that do not nest."""
    check("block_size", block_size, BLOCK_SIZE)
    check("kernel_block_size", kernel_block_size, BLOCK_SIZE)
    if block_size % kernel_block_size:
        raise ValueError(
            f"block_size {block_size} is not a multiple of kernel_block_size {kernel_block_size}"
        )
    return block_size // kernel_block_size


def ssm_page_slices(group: Mamba2 | GDN, tp_size: int) -> tuple[PageSlice, ...]:
    """The conv state's parts in storage order, then the temporal state.

    DS: each sub-projection `[channels, conv_kernel-1]`. SD: `[channels]` per sub-projection
    per row (`conv_x.0, conv_B.0, ..., conv_x.1, ...`), together the `[rows, channels]` array.
    """
    rows = group.conv_kernel - 1
    slices = []
    offset = 0
    for part in group.conv_parts():
        numel = part.units_on_rank(tp_size) * part.unit_elems
        shape = (numel // rows, rows) if group.conv_layout == "DS" else (numel,)
        slices.append(PageSlice(part.name, offset, shape))
        offset += numel
    state = group.state_part()
    heads = state.units_on_rank(tp_size)
    if isinstance(group, Mamba2):
        state_shape = (heads, group.head_dim, group.d_state)
    else:
        state_shape = (heads, group.head_v_dim, group.head_k_dim)
    slices.append(PageSlice(state.name, offset, state_shape))
    return tuple(slices)


def ssm_page_elems(group: Mamba2 | GDN, tp_size: int) -> int:
    """Elements of one SSM page when the state has the model's dtype (`state_dtype` "")."""
    last = ssm_page_slices(group, tp_size)[-1]
    return last.offset + last.numel


def ssm_part_bytes(group: Mamba2 | GDN, tp_size: int, dtype_bytes: int) -> tuple[tuple[int, int], ...]:
    """(byte offset, byte length) of each page slice: conv parts in the model's dtype, then the
    state in `state_dtype` (the model's when "")."""
    state_bytes = DTYPE_BYTES[group.state_dtype] if group.state_dtype else dtype_bytes
    out, offset = [], 0
    slices = ssm_page_slices(group, tp_size)
    for index, page_slice in enumerate(slices):
        length = page_slice.numel * (state_bytes if index == len(slices) - 1 else dtype_bytes)
        out.append((offset, length))
        offset += length
    return tuple(out)


def ssm_page_bytes(group: Mamba2 | GDN, tp_size: int, dtype_bytes: int) -> int:
    offset, length = ssm_part_bytes(group, tp_size, dtype_bytes)[-1]
    return offset + length


def _tensor_for(
    model: ModelSpec, layer: int, group: GroupSpec, tp_size: int,
    kernel_block_size: int, kernel_blocks: int, logical_blocks: int,
) -> TensorSpec:
    gi = model.layer_groups[layer]
    if isinstance(group, MLA):
        return TensorSpec(layer, gi, "mla", (kernel_blocks, kernel_block_size, group.latent_dim), model.dtype)
    if is_ssm(group):
        assert isinstance(group, (Mamba2, GDN))
        page_bytes = ssm_page_bytes(group, tp_size, model.dtype_bytes)
        if page_bytes % model.dtype_bytes:
            raise ValueError(f"{group.kind} page of {page_bytes} bytes ({group.state_dtype} state) is not a whole "
                             f"number of {model.dtype} elements")
        return TensorSpec(layer, gi, "ssm", (logical_blocks, page_bytes // model.dtype_bytes), model.dtype)
    heads = model.attention_part().units_on_rank(tp_size)
    shape = (kernel_blocks, heads, kernel_block_size, 2 * model.head_dim)
    return TensorSpec(layer, gi, "attention", shape, model.dtype)


def kv_tensor_specs(
    model: ModelSpec, tp_size: int, block_size: int, kernel_block_size: int, num_blocks: int,
) -> tuple[TensorSpec, ...]:
    """Every cache tensor of one worker, in layer order.

    `num_blocks` counts logical blocks. Attention and MLA tensors are indexed by kernel
    block (`num_blocks * physical_per_logical` rows); SSM tensors by logical block.
    """
    check("tp_size", tp_size, TP)
    check("num_blocks", num_blocks, NUM_BLOCKS)
    ppl = check_block_sizes(block_size, kernel_block_size)
    return tuple(
        _tensor_for(model, layer, model.groups[g], tp_size, kernel_block_size, num_blocks * ppl, num_blocks)
        for layer, g in enumerate(model.layer_groups)
    )


def kv_pool_bytes(
    model: ModelSpec, tp_size: int, block_size: int, kernel_block_size: int, num_blocks: int,
) -> int:
    """Bytes of every cache tensor of one worker: what a pool of `num_blocks` allocates per rank."""
    total = 0
    for spec in kv_tensor_specs(model, tp_size, block_size, kernel_block_size, num_blocks):
        elems = 1
        for dim in spec.shape:
            elems *= dim
        total += elems * model.dtype_bytes
    return total
