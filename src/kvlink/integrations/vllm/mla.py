"""MLA (DeepSeek-V2/V3-like) models inside vLLM, in kvlink's terms.

vLLM's CPU MLA backends keep one latent vector per token (`kv_lora_rank` latent, then the
`qk_rope_head_dim` rope part: 576 elements for DeepSeek), the same on every TP rank. Each
layer's cache is `[num_blocks, block_size, latent]`, contiguous; both backends write token
`slot` at flat row `slot` of that view (AMX_MLA through its cache-write kernel, CPU_MLA by
indexing), so the page order is kvlink's `token_major` for both. They differ in the block
sizes they take: AMX_MLA multiples of 32 (default 128), CPU_MLA 16 only.

A backend is described by an entry in `MLA_BACKEND_PAGE_ORDERS`; one with another element
order is a new page order there, not a new code path. Pure over plain values (no vLLM import).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvlink.integrations.vllm.layout import (
    GroupInfo,
    LayerTensor,
    UnsupportedVllmLayout,
    layer_index,
)
from kvlink.layout.spec import DTYPE_BYTES, MLA, ModelSpec

# vLLM CPU MLA backend (its `get_name()`) -> kvlink page order of its latent pages.
# Checked against vLLM's own cache writers by tests/vllm/test_pd_mla.py.
MLA_BACKEND_PAGE_ORDERS = {"AMX_MLA": "token_major", "CPU_MLA": "token_major"}
MLA_KIND = "mla"


def mla_group(spec: Any, layer_names: Sequence[str], dtype: str) -> GroupInfo:
    """kvlink's view of vLLM's `MLAAttentionSpec` group; refuses what it cannot move exactly
    (a padded or multi-token page, a quantized latent, more than one latent per token)."""
    seen = (f"MLA group of {list(layer_names)[:1]}...: block {spec.block_size}, {spec.num_kv_heads} latent(s) "
            f"of {spec.head_size}, dtype {dtype}, page {spec.page_size_bytes} bytes")
    if int(spec.num_kv_heads) != 1:
        raise UnsupportedVllmLayout(f"kvlink: {seen}; expected one latent per token")
    if DTYPE_BYTES.get(dtype) is None or DTYPE_BYTES[dtype] == 1:
        raise UnsupportedVllmLayout(f"kvlink: {seen}; an MLA latent moves in bfloat16, float16 or float32 only")
    if getattr(spec, "cache_dtype_str", None) not in (None, "auto"):
        raise UnsupportedVllmLayout(f"kvlink: {seen}; kv_cache_dtype {spec.cache_dtype_str!r}: an MLA latent "
                                    "moves unquantized only")
    if int(getattr(spec, "tokens_per_state", 1)) != 1 or getattr(spec, "model_version", None):
        raise UnsupportedVllmLayout(f"kvlink: {seen}; tokens per state {getattr(spec, 'tokens_per_state', 1)}, "
                                    f"model version {getattr(spec, 'model_version', None)!r}: kvlink moves "
                                    "DeepSeek-V2/V3 latents (one per token)")
    expected = int(spec.block_size) * int(spec.head_size) * DTYPE_BYTES[dtype]
    if int(spec.page_size_bytes) != expected:
        raise UnsupportedVllmLayout(f"kvlink: {seen}; expected an unpadded page of {expected} bytes")
    return GroupInfo(MLA_KIND, tuple(layer_names), dtype, num_kv_heads=1, head_dim=int(spec.head_size),
                     block_size=int(spec.block_size))


def mla_model_spec(name: str, group: GroupInfo) -> ModelSpec:
    """The model spec of an MLA-only model: every layer in one MLA group."""
    return ModelSpec(name=name, num_kv_heads=1, head_dim=group.head_dim, dtype=group.dtype,
                     groups=(MLA(latent_dim=group.head_dim),), layer_groups=(0,) * len(group.layer_names))


def mla_page_order(backends: Mapping[str, str]) -> str:
    """The page order of an MLA group, from its layers' backend names as vLLM resolved them."""
    if not backends:
        raise UnsupportedVllmLayout("kvlink: vLLM's MLA group has no layers to read the backend from")
    names = set(backends.values())
    orders = {MLA_BACKEND_PAGE_ORDERS.get(n) for n in names}
    if len(names) != 1 or None in orders:
        raise UnsupportedVllmLayout(
            f"kvlink: MLA layers run the {sorted(names)} backend(s) (first layer {next(iter(backends))!r}); "
            f"kvlink knows the latent layout of {sorted(MLA_BACKEND_PAGE_ORDERS)}, one per group")
    return str(orders.pop())


def check_mla_tensors(tensors: Sequence[LayerTensor], *, block_size: int, latent_dim: int, dtype: str
                      ) -> tuple[list[int], list[int], int]:
    """(base addresses, byte sizes, num_blocks) of the layers' latent caches in layer order,
    refusing views kvlink would misread: not `[B, 1, block_size, latent]` (vLLM registers the
    latent as one KV head; `[B, block_size, latent]` is read too), not contiguous, another
    dtype, or different pool sizes."""
    if not tensors:
        raise UnsupportedVllmLayout("kvlink: vLLM registered no MLA latent caches")
    ordered = sorted(tensors, key=lambda t: layer_index(t.name))
    num_blocks = ordered[0].shape[0] if ordered[0].shape else 0
    bases, sizes = [], []
    for t in ordered:
        seen = f"layer {t.name!r}: shape {list(t.shape)}, strides {list(t.strides)}, dtype {t.dtype}"
        contiguous = (block_size * latent_dim, latent_dim, 1)
        shape, strides = tuple(t.shape), tuple(t.strides)
        if len(shape) == 4 and shape[1] == 1:  # the one "head" of the latent: no stride of its own
            shape, strides = shape[:1] + shape[2:], strides[:1] + strides[2:]
        if len(shape) != 3 or shape[1:] != (block_size, latent_dim) or strides != contiguous:
            raise UnsupportedVllmLayout(
                f"kvlink: {seen}; expected a contiguous MLA latent cache [num_blocks, 1, {block_size}, "
                f"{latent_dim}] with strides [{contiguous[0]}, any, {contiguous[1]}, 1]")
        if t.dtype != dtype or t.element_size != DTYPE_BYTES[dtype]:
            raise UnsupportedVllmLayout(f"kvlink: {seen}; expected dtype {dtype}")
        if t.shape[0] != num_blocks:
            raise UnsupportedVllmLayout(f"kvlink: {seen}; other layers have {num_blocks} blocks")
        bases.append(t.data_ptr)
        sizes.append(t.shape[0] * contiguous[0] * t.element_size)
    return bases, sizes, num_blocks
