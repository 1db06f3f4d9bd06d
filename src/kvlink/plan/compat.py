"""Refuse P/D pairs that cannot be planned, with a message naming every mismatch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvlink.layout.conv_state import conv_layouts, with_conv_layouts
from kvlink.layout.geometry import WorkerGeometry
from kvlink.layout.spec import ModelSpec
from kvlink.plan.tp_mapping import model_parts

SUPPORTED = (
    "Supported: P and D run the same model spec (name, KV cache dtype and scales, head_dim, KV "
    "heads, layers and group kinds); each side's TP size either divides every sharded part's unit count (KV "
    "heads, SSM heads and groups) or is a multiple of it; each side's kernel block size "
    "divides its block size; both sides use the same intra-page element order (page order). "
    "P and D TP sizes and block sizes may otherwise differ freely, in either direction (block sizes: "
    "not for groups that share memory, as vLLM's hybrid KV cache does, with a page order that is not "
    "token-major)."
)


class IncompatibleLayout(ValueError):
    """P and D cannot exchange KV; `mismatches` lists each reason."""

    def __init__(self, mismatches: Sequence[str]) -> None:
        self.mismatches = tuple(mismatches)
        lines = "\n".join(f"  - {m}" for m in self.mismatches)
        super().__init__(f"incompatible P/D layout:\n{lines}\n{SUPPORTED}")


def side_problems(label: str, model: ModelSpec, tp_size: int, block_size: int,
                  kernel_block_size: int) -> list[str]:
    """Reasons one side's TP size and block sizes cannot hold `model` (empty when fine)."""
    problems: list[str] = []
    if tp_size <= 0:
        problems.append(f"{label}: TP size must be positive, got {tp_size}")
    else:
        for key, part in model_parts(model).items():
            try:
                part.units_on_rank(tp_size)
            except ValueError:
                problems.append(
                    f"{label}: TP {tp_size} cannot shard {key} ({part.units} units); "
                    f"use a TP that divides {part.units} or a multiple of it"
                )
    if block_size <= 0 or kernel_block_size <= 0 or block_size % kernel_block_size:
        problems.append(
            f"{label}: kernel block size {kernel_block_size} does not divide block size {block_size}"
        )
    return problems


def model_mismatches(p_model: ModelSpec, d_model: ModelSpec) -> list[str]:
    """Each field where the two model specs differ (empty when their compat hashes agree)."""
    if p_model is d_model or p_model.compat_hash() == d_model.compat_hash():
        return []
    found = [
        f"{field}: P has {getattr(p_model, field)!r}, D has {getattr(d_model, field)!r}"
        for field in ("name", "dtype", "head_dim", "num_kv_heads", "num_layers")
        if getattr(p_model, field) != getattr(d_model, field)
    ]
    p_kinds = [g.kind for g in p_model.groups]
    d_kinds = [g.kind for g in d_model.groups]
    if p_kinds != d_kinds or p_model.layer_groups != d_model.layer_groups:
        found.append(f"group kinds per layer: P has {_layer_kinds(p_model)}, D has {_layer_kinds(d_model)}")
    elif p_model.groups != d_model.groups:
        p_conv, d_conv = _conv_layouts(p_model), _conv_layouts(d_model)
        if with_conv_layouts(p_model, conv_layouts(d_model)).groups != d_model.groups:
            found.append(f"group parameters: P has {p_model.groups}, D has {d_model.groups}")
        elif p_conv != d_conv:
            # The connector plans such a pair through `kvlink.layout.conv_state.planning_view`
            # and re-lays the conv state out on D; a plan between the raw geometries cannot.
            found.append(f"SSM conv state layout: P has {p_conv!r}, D has {d_conv!r}; plan against the "
                         "reader's planning_view of the source's layout, then re-lay the conv state out "
                         "(kvlink.layout.conv_state)")
    if p_model.kv_scales != d_model.kv_scales:
        found.append(f"KV cache scales (k_scale, v_scale): P has {_scales(p_model)}, D has {_scales(d_model)}; "
                     "quantized KV bytes decode only with the scales they were written with")
    return found or ["model spec hash differs"]


def _conv_layouts(model: ModelSpec) -> str:
    return ",".join(sorted(set(conv_layouts(model).values())))


def _scales(model: ModelSpec) -> str:
    if not model.kv_scales:
        return "none (unquantized cache)"
    if len(set(model.kv_scales)) == 1:
        return f"{model.kv_scales[0]} on all {len(model.kv_scales)} layers"
    return str(list(model.kv_scales))


def page_order_mismatches(p_order: str, d_order: str) -> list[str]:
    """The reason P's and D's intra-page element orders cannot be paired (empty when equal)."""
    if p_order == d_order:
        return []
    return [f"page order: P has {p_order!r}, D has {d_order!r}; kvlink moves KV only between "
            f"equal intra-page orders"]


def _layer_kinds(model: ModelSpec) -> list[str]:
    return [model.groups[g].kind for g in model.layer_groups]


def check_configuration(
    p_model: ModelSpec, d_model: ModelSpec, p_tp: int, d_tp: int,
    p_block_size: int, p_kernel_block_size: int, d_block_size: int, d_kernel_block_size: int,
) -> None:
    """Raise IncompatibleLayout unless a D engine can read this P engine's KV."""
    problems = model_mismatches(p_model, d_model)
    problems += side_problems("P", p_model, p_tp, p_block_size, p_kernel_block_size)
    problems += side_problems("D", d_model, d_tp, d_block_size, d_kernel_block_size)
    if problems:
        raise IncompatibleLayout(problems)


def _as_geometry(side: str, item: WorkerGeometry | Mapping[str, Any]) -> WorkerGeometry:
    if isinstance(item, WorkerGeometry):
        return item
    try:
        return WorkerGeometry.from_wire(item)
    except ValueError as exc:
        raise IncompatibleLayout([f"{side} geometry unusable: {exc}"]) from exc


def check_compatible(
    p_side: WorkerGeometry | Mapping[str, Any], d_side: WorkerGeometry | Mapping[str, Any],
) -> None:
    """Compare a P worker and a D worker (geometries or their wire dicts)."""
    p_geometry, d_geometry = _as_geometry("P", p_side), _as_geometry("D", d_side)
    problems = model_mismatches(p_geometry.model, d_geometry.model)
    problems += page_order_mismatches(p_geometry.page_order, d_geometry.page_order)
    if problems:
        raise IncompatibleLayout(problems)
