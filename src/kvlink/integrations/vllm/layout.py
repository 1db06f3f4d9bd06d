"""What vLLM allocated, in kvlink's terms: model spec, page order, and per-layer regions.

Pure over plain values (no vLLM import), so the checks are unit-tested without an engine.
The integration reads the numbers off vLLM's config and tensors and calls these.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from kvlink.layout.spec import (
    CONV_LAYOUTS,
    DTYPE_BYTES,
    GDN,
    STATE_DTYPES,
    ConvLayout,
    FullAttention,
    GroupSpec,
    Mamba2,
    ModelSpec,
    SlidingWindow,
)
from kvlink.layout.tensors import ssm_page_bytes

# vLLM CPU attention ISA -> kvlink page order (the element order inside one head's unit).
# `vec16` (head dims or block sizes that are not multiples of 32) stores `vec`'s order: the
# same K-transposed, V-token-major unit, checked against vLLM's own cache-write kernel by
# tests/vllm/test_pd_kernels.py. A kernel with another order is a new page order there.
ISA_PAGE_ORDERS = {"vec": "vllm_cpu_vec", "vec16": "vllm_cpu_vec", "amx": "vllm_cpu_amx"}
SUPPORTED_LAYOUT = "LBHNC"
CPU_ATTENTION_BACKEND = "CPU_ATTN"
# vLLM's --kv-cache-dtype -> kvlink's KV dtype ("auto": the model dtype). The CPU build's
# "fp8" is e4m3; it views every fp8 cache as raw bytes (uint8 tensors and specs).
KV_CACHE_DTYPES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
_FP8_STORAGE = "torch.uint8"


class UnsupportedVllmLayout(ValueError):
    """kvlink cannot move this engine's KV exactly; the message says what was seen."""


def page_order_for(isa: str, dtype: str, block_size: int, head_dim: int) -> str:
    order = ISA_PAGE_ORDERS.get(isa)
    if order is None:
        raise UnsupportedVllmLayout(
            f"kvlink: vLLM's CPU attention uses the {isa!r} kernel layout for dtype {dtype}, block "
            f"size {block_size}, head size {head_dim}; kvlink knows the element order of the "
            f"{sorted(ISA_PAGE_ORDERS)} kernels only (x86: fp32/fp16 'vec', bf16 'amx' with AMX, "
            "'vec16' for head sizes that are not multiples of 32)")
    return order


def resolved_isa(layers: Mapping[str, tuple[str, object]]) -> str:
    """The kernel vLLM resolved for one attention group, from its layers' (backend name, `isa`)
    as vLLM's CPU_ATTN metadata builder set them; refuses another backend, a layer without an
    ISA, or layers that disagree."""
    if not layers:
        raise UnsupportedVllmLayout("kvlink: vLLM's attention group has no layers to read the kernel from")
    seen = {name: (backend, isa) for name, (backend, isa) in layers.items()}
    backends = {backend for backend, _ in seen.values()}
    if backends != {CPU_ATTENTION_BACKEND}:
        raise UnsupportedVllmLayout(
            f"kvlink: attention layers run the {sorted(backends)} backend(s); kvlink inside vLLM reads "
            f"the page order of vLLM's {CPU_ATTENTION_BACKEND} backend only")
    isas = {isa for _, isa in seen.values()}
    if len(isas) != 1 or not all(isinstance(isa, str) and isa for isa in isas):
        raise UnsupportedVllmLayout(
            f"kvlink: vLLM's attention layers of one group report the kernels "
            f"{', '.join(sorted(map(repr, isas)))} (first layer {next(iter(seen))!r}); expected one "
            "ISA, as vLLM's CPU_ATTN metadata builder sets it on every layer")
    return str(isas.pop())


def kv_dtype_for(cache_dtype: str | None, model_dtype: str) -> str:
    """kvlink's KV dtype for vLLM's `--kv-cache-dtype` on a model of `model_dtype`."""
    if cache_dtype in (None, "auto"):
        return model_dtype
    kv_dtype = KV_CACHE_DTYPES.get(cache_dtype)
    if kv_dtype is None:
        raise UnsupportedVllmLayout(
            f"kvlink: kv_cache_dtype {cache_dtype!r} is not supported; use 'auto' or one of "
            f"{sorted(KV_CACHE_DTYPES)} (vLLM's CPU attention caches)")
    return kv_dtype


def storage_dtype(dtype: str) -> str:
    """The dtype vLLM gives tensors and specs of a `dtype` cache (raw bytes for fp8)."""
    return _FP8_STORAGE if DTYPE_BYTES.get(dtype) == 1 else dtype


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
        if t.dtype != storage_dtype(dtype) or t.element_size != DTYPE_BYTES.get(dtype):
            raise UnsupportedVllmLayout(f"kvlink: {seen}; expected dtype {storage_dtype(dtype)} "
                                        f"({DTYPE_BYTES.get(dtype)}-byte {dtype})")
        if t.shape[0] != num_blocks:
            raise UnsupportedVllmLayout(f"kvlink: {seen}; other layers have {num_blocks} blocks")
        bases.append(t.data_ptr)
        sizes.append(t.shape[0] * contiguous[0] * t.element_size)
    return bases, sizes, num_blocks


@dataclass(frozen=True)
class GroupInfo:
    """One vLLM KV-cache group as kvlink needs it (numbers read off its KV-cache spec).

    Attention ("attention", or "sliding" for a group whose layers all see the last
    `sliding_window` tokens): `num_kv_heads` on this rank, `head_dim`, `block_size`. Mamba2: the per-rank
    conv state shape as vLLM gives it in its `conv_layout` (DS `(conv_dim, d_conv - 1)`, SD
    `(d_conv - 1, conv_dim)`), the SSM state shape `(heads, head_dim, d_state)`, and its page:
    `page_bytes` of content every `page_stride`.
    """

    kind: str  # "attention" | "sliding" | "mamba2" | "gdn"
    layer_names: tuple[str, ...]
    dtype: str
    num_kv_heads: int = 0
    head_dim: int = 0
    block_size: int = 0
    conv_shape: tuple[int, ...] = ()
    state_shape: tuple[int, ...] = ()
    page_bytes: int = 0
    page_stride: int = 0
    sliding_window: int = 0
    conv_layout: str = "DS"
    state_dtype: str = ""  # the SSM state's dtype when it differs from the conv state's (`dtype`)

    @property
    def is_attention(self) -> bool:
        return self.kind in ATTENTION_KINDS


ATTENTION_KINDS = ("attention", "sliding")
SSM_KINDS = ("mamba2", "gdn")


def attention_groups(groups: Sequence[GroupInfo]) -> list[GroupInfo]:
    return [g for g in groups if g.is_attention]


def _window_spec(g: GroupInfo) -> SlidingWindow:
    """kvlink's window for vLLM's: vLLM's position p attends to the `sliding_window` tokens
    ending at p itself, and D recomputes the last prompt token, so of the shipped tokens D
    needs the last `sliding_window - 1`. vLLM's D gives the earlier blocks no memory (they
    are its null block), so the window kvlink ships must not start any earlier."""
    if g.sliding_window < 2:
        raise UnsupportedVllmLayout(f"kvlink: sliding window of {g.sliding_window} tokens in the group of "
                                    f"{g.layer_names[0]!r}; expected at least 2")
    return SlidingWindow(window=g.sliding_window - 1)


def with_kv_dtype(groups: Sequence[GroupInfo], kv_dtype: str) -> list[GroupInfo]:
    """`groups` in kvlink's `kv_dtype` (vLLM's specs name only the model or storage dtype);
    a quantized cache moves for attention-only models, whose specs must say raw bytes."""
    if storage_dtype(kv_dtype) == kv_dtype:
        return list(groups)
    other = sorted({g.kind for g in groups if g.kind != "attention"})
    if other:
        raise UnsupportedVllmLayout(f"kvlink: a {kv_dtype} KV cache moves for attention-only models; this "
                                    f"model also has {other} groups")
    wrong = [g for g in groups if g.dtype != storage_dtype(kv_dtype)]
    if wrong:
        raise UnsupportedVllmLayout(f"kvlink: a {kv_dtype} KV cache has {storage_dtype(kv_dtype)} KV-cache specs; "
                                    f"the group of {wrong[0].layer_names[0]!r} has {wrong[0].dtype}")
    return [replace(g, dtype=kv_dtype) for g in groups]


def model_spec(name: str, groups: Sequence[GroupInfo], num_kv_heads_total: int, *, tp_size: int = 1,
               mamba_n_groups: int | None = None) -> ModelSpec:
    """kvlink's model spec for vLLM's groups, in vLLM's group order (block ids come per group):
    one full-attention group, alone or with Mamba2 groups, or attention groups of which some
    see a sliding window (all of one head count, head size and dtype). The connector builds
    it once, from vLLM's config, and hands it to its scheduler or worker side.

    vLLM's shapes are one rank's of `tp_size`: Mamba2 heads are split over the ranks, and B/C
    groups too, unless the model has one group, which every rank then holds (vLLM allows
    no other split). A rank with one group cannot tell the two apart, so at TP > 1 the
    model's own group count (`mamba_n_groups`, from its config) decides."""
    attention = attention_groups(groups)
    full = [g for g in attention if g.kind == "attention"]
    if not attention or (len(attention) != len(groups) and len(attention) != 1):
        raise UnsupportedVllmLayout(f"kvlink: expected attention groups, or one full-attention group with "
                                    f"Mamba2 groups; got {[g.kind for g in groups]}")
    if len(full) != 1 and len(attention) != len(groups):
        raise UnsupportedVllmLayout(f"kvlink: expected one full-attention group, got {len(full)}")
    if attention[0].dtype not in DTYPE_BYTES:
        raise UnsupportedVllmLayout(
            f"kvlink: KV cache dtype {attention[0].dtype} is not supported; supported: {sorted(DTYPE_BYTES)}")
    shapes = {(g.num_kv_heads, g.head_dim, g.dtype) for g in attention}
    if len(shapes) != 1:
        raise UnsupportedVllmLayout(f"kvlink: the attention groups differ in (KV heads, head size, dtype): "
                                    f"{sorted(shapes)}; kvlink moves groups of one attention shape")
    specs: list[GroupSpec] = []
    for g in groups:
        if g.kind == "attention":
            specs.append(FullAttention())
            continue
        if g.kind == "sliding":
            specs.append(_window_spec(g))
            continue
        specs.append(_ssm_spec(g, tp_size, mamba_n_groups))
    layer_groups: dict[int, int] = {}
    for gi, g in enumerate(groups):
        for layer in g.layer_names:
            layer_groups[layer_index(layer)] = gi
    att = attention[0]
    model = ModelSpec(name=name, num_kv_heads=num_kv_heads_total, head_dim=att.head_dim, dtype=att.dtype,
                      groups=tuple(specs), layer_groups=tuple(layer_groups[i] for i in sorted(layer_groups)))
    for g, spec in zip(groups, specs, strict=True):
        if isinstance(spec, (Mamba2, GDN)):
            if g.dtype != att.dtype:
                raise UnsupportedVllmLayout(
                    f"kvlink: {g.kind} conv state of {list(g.layer_names)} holds {g.dtype}, the attention KV "
                    f"{att.dtype}; kvlink moves conv states in the model's dtype")
            expected = ssm_page_bytes(spec, tp_size, DTYPE_BYTES[att.dtype])
            if g.page_bytes != expected:
                state = f", SSM state {g.state_dtype}" if g.state_dtype else ""
                raise UnsupportedVllmLayout(
                    f"kvlink: {g.kind} page of {list(g.layer_names)} holds {g.page_bytes} bytes ({g.dtype}{state}); "
                    f"kvlink's page for these shapes is {expected} bytes (conv state, then SSM state)")
    return model


def _ssm_spec(g: GroupInfo, tp_size: int, mamba_n_groups: int | None) -> Mamba2 | GDN:
    """kvlink's Mamba2 or GDN group for one rank's conv and state shapes (see `model_spec`)."""
    what = "Mamba2" if g.kind == "mamba2" else "GDN"
    if g.conv_layout not in CONV_LAYOUTS:
        raise UnsupportedVllmLayout(f"kvlink: {what} group {list(g.layer_names)}: conv state layout "
                                    f"{g.conv_layout!r}; kvlink moves {list(CONV_LAYOUTS)}")
    expected_conv = "(conv_dim, d_conv-1)" if g.conv_layout == "DS" else "(d_conv-1, conv_dim)"
    state = "(heads, head_dim, d_state)" if g.kind == "mamba2" else "(v_heads, head_v_dim, head_k_dim)"
    if len(g.conv_shape) != 2 or len(g.state_shape) != 3:
        raise UnsupportedVllmLayout(f"kvlink: {what} group {list(g.layer_names)}: conv state {g.conv_shape}, "
                                    f"SSM state {g.state_shape}; expected {expected_conv} ({g.conv_layout}) "
                                    f"and {state}")
    conv_dim, rows = g.conv_shape if g.conv_layout == "DS" else g.conv_shape[::-1]
    layout: ConvLayout = "DS" if g.conv_layout == "DS" else "SD"
    if g.state_dtype and g.state_dtype not in STATE_DTYPES:
        raise UnsupportedVllmLayout(f"kvlink: {what} group {list(g.layer_names)}: SSM state dtype {g.state_dtype}; "
                                    f"kvlink moves {list(STATE_DTYPES)}")
    if g.kind == "gdn":
        # conv over Q | K | V: 2 x k_heads x head_k_dim + v_heads x head_v_dim channels per rank.
        v_heads, head_v_dim, head_k_dim = g.state_shape
        k_heads, rest = divmod(conv_dim - v_heads * head_v_dim, 2 * head_k_dim)
        if rest or k_heads <= 0:
            raise UnsupportedVllmLayout(f"kvlink: GDN conv state of {conv_dim} channels does not split into "
                                        f"Q | K (key heads of {head_k_dim}) | V ({v_heads}x{head_v_dim})")
        return GDN(num_k_heads=k_heads * tp_size, num_v_heads=v_heads * tp_size, head_k_dim=head_k_dim,
                   head_v_dim=head_v_dim, conv_kernel=rows + 1, conv_layout=layout, state_dtype=g.state_dtype)
    heads, head_dim, d_state = g.state_shape
    rank_groups, rest = divmod(conv_dim - heads * head_dim, 2 * d_state)
    if rest or rank_groups <= 0:
        raise UnsupportedVllmLayout(f"kvlink: Mamba2 conv state of {conv_dim} channels does not split into "
                                    f"x ({heads}x{head_dim}) | B | C of groups of {d_state}")
    n_groups = _global_mamba_groups(g, rank_groups, tp_size, mamba_n_groups)
    return Mamba2(num_heads=heads * tp_size, head_dim=head_dim, n_groups=n_groups, d_state=d_state,
                  conv_kernel=rows + 1, conv_layout=layout, state_dtype=g.state_dtype)


def _global_mamba_groups(g: GroupInfo, rank_groups: int, tp_size: int, config_groups: int | None) -> int:
    """The model's B/C group count from one rank's, checked against the config's when given."""
    if tp_size == 1:
        found = rank_groups
    elif config_groups is None:
        if rank_groups == 1:
            raise UnsupportedVllmLayout(
                f"kvlink: Mamba2 group {list(g.layer_names)} holds 1 B/C group per rank at TP {tp_size}: the "
                f"model has {tp_size} groups or 1 held by every rank, and its config names neither "
                "(n_groups / mamba_n_groups)")
        found = rank_groups * tp_size
    else:
        found = config_groups
    expected_on_rank = found // tp_size if found % tp_size == 0 else (1 if found == 1 else 0)
    if expected_on_rank != rank_groups:
        raise UnsupportedVllmLayout(
            f"kvlink: Mamba2 group {list(g.layer_names)}: {rank_groups} B/C groups per rank at TP {tp_size}, "
            f"but the model has {found}; vLLM splits groups over the ranks or, for 1, gives it to every rank")
    return found


def check_hybrid_tensors(tensors: Sequence[LayerTensor], groups: Sequence[GroupInfo]
                         ) -> tuple[list[int], list[int], int, int | None]:
    """(base addresses, byte sizes, num_blocks, SSM page stride) in layer order, for a model
    whose groups alias one allocation (vLLM's hybrid KV cache)."""
    group_of = {name: g for g in groups for name in g.layer_names}
    by_name = {t.name: t for t in tensors}
    missing = sorted(set(group_of) - set(by_name))
    if missing:
        raise UnsupportedVllmLayout(f"kvlink: vLLM registered no KV cache for layers {missing}")
    bases, sizes, blocks, stride = [], [], set(), None
    for name in sorted(group_of, key=layer_index):
        t, g = by_name[name], group_of[name]
        if g.is_attention:
            b, s, n = check_layer_tensors([t], num_kv_heads=g.num_kv_heads, block_size=g.block_size,
                                          head_dim=g.head_dim, dtype=g.dtype)
        else:
            seen = f"layer {name!r}: shape {list(t.shape)}, strides {list(t.strides)}, dtype {t.dtype}"
            if (len(t.shape) != 4 or tuple(t.shape[1:]) != (1, 1, g.page_bytes) or t.element_size != 1
                    or t.strides[0] != g.page_stride or t.strides[3] != 1):
                raise UnsupportedVllmLayout(
                    f"kvlink: {seen}; expected an int8 view [num_blocks, 1, 1, {g.page_bytes}] with block "
                    f"stride {g.page_stride} (vLLM's Mamba page)")
            b, s, n = [t.data_ptr], [t.shape[0] * g.page_stride], t.shape[0]
            stride = g.page_stride
        bases += b
        sizes += s
        blocks.add(n)
    if len(blocks) != 1:
        raise UnsupportedVllmLayout(f"kvlink: the layers of this model have different block counts {sorted(blocks)}")
    return bases, sizes, blocks.pop(), stride
