"""What vLLM allocated, in kvlink's terms: model spec, page order, and per-layer regions.

Pure over plain values (no vLLM import), so the checks are unit-tested without an engine.
The integration reads the numbers off vLLM's config and tensors and calls these.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvlink.layout.spec import DTYPE_BYTES, FullAttention, ModelSpec

# vLLM CPU attention ISA -> kvlink page order (the element order inside one head's unit).
ISA_PAGE_ORDERS = {"vec": "vllm_cpu_vec", "vec16": "vllm_cpu_vec", "amx": "vllm_cpu_amx"}
SUPPORTED_LAYOUT = "LBHNC"


class UnsupportedVllmLayout(ValueError):
    """kvlink cannot move this engine's KV exactly; the message says what was seen."""


def page_order_for(isa: str, dtype: str, block_size: int, head_dim: int) -> str:
    order = ISA_PAGE_ORDERS.get(isa)
    if order is None:
        raise UnsupportedVllmLayout(
            f"kvlink: vLLM's CPU attention uses the {isa!r} kernel layout for dtype {dtype}, block "
            f"size {block_size}, head size {head_dim}; kvlink knows the element order of "
            f"{sorted(ISA_PAGE_ORDERS)} only (x86: fp32/fp16 'vec', bf16 'amx' with AMX)")
    return order


@dataclass(frozen=True)
class LayerTensor:
    """One layer's KV view as vLLM handed it over: `[blocks, heads, block_size, 2*head_dim]`."""

    name: str
    data_ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    element_size: int
    dtype: str


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(name: str) -> int:
    match = _LAYER_INDEX.search(name)
    if match is None:
        raise UnsupportedVllmLayout(f"kvlink: cannot tell the layer index of KV cache {name!r}")
    return int(match.group(1))


def order_layers(tensors: Sequence[LayerTensor]) -> list[LayerTensor]:
    """Layer order, one entry per distinct memory (layers sharing another's KV are dropped)."""
    seen: set[int] = set()
    out = []
    for t in sorted(tensors, key=lambda t: layer_index(t.name)):
        if t.data_ptr in seen:
            continue
        seen.add(t.data_ptr)
        out.append(t)
    return out


def check_layer_tensors(
    tensors: Sequence[LayerTensor], *, num_kv_heads: int, block_size: int, head_dim: int, dtype: str,
) -> tuple[list[int], list[int], int]:
    """(base addresses, byte sizes, num_blocks) of the layers, refusing views kvlink would
    misread: not 4-D `[B, H, N, 2D]`, not contiguous, another dtype, or different pool sizes."""
    if not tensors:
        raise UnsupportedVllmLayout("kvlink: vLLM registered no KV cache tensors")
    expected_tail = (num_kv_heads, block_size, 2 * head_dim)
    num_blocks = tensors[0].shape[0] if tensors[0].shape else 0
    bases, sizes = [], []
    for t in tensors:
        seen = f"layer {t.name!r}: shape {list(t.shape)}, strides {list(t.strides)}, dtype {t.dtype}"
        if len(t.shape) != 4 or tuple(t.shape[1:]) != expected_tail:
            raise UnsupportedVllmLayout(
                f"kvlink: {seen}; expected [num_blocks, {num_kv_heads}, {block_size}, {2 * head_dim}] "
                f"(vLLM CPU attention, {SUPPORTED_LAYOUT} layout). Supported: full-attention "
                "models on vLLM's CPU_ATTN backend")
        contiguous = (t.shape[1] * t.shape[2] * t.shape[3], t.shape[2] * t.shape[3], t.shape[3], 1)
        if tuple(t.strides) != contiguous:
            raise UnsupportedVllmLayout(f"kvlink: {seen}; expected contiguous strides {list(contiguous)}")
        if t.dtype != dtype or t.element_size != DTYPE_BYTES.get(dtype):
            raise UnsupportedVllmLayout(f"kvlink: {seen}; expected dtype {dtype}")
        if t.shape[0] != num_blocks:
            raise UnsupportedVllmLayout(f"kvlink: {seen}; other layers have {num_blocks} blocks")
        bases.append(t.data_ptr)
        sizes.append(t.shape[0] * contiguous[0] * t.element_size)
    return bases, sizes, num_blocks


def attention_model_spec(name: str, num_kv_heads: int, head_dim: int, dtype: str, num_layers: int) -> ModelSpec:
    if dtype not in DTYPE_BYTES:
        raise UnsupportedVllmLayout(
            f"kvlink: KV cache dtype {dtype} is not supported; supported: {sorted(DTYPE_BYTES)}")
    return ModelSpec(name=name, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                     groups=(FullAttention(),), layer_groups=(0,) * num_layers)
