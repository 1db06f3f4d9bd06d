"""Named model specs: real-model KV geometries for planning, and the tiny hybrid test model."""

from __future__ import annotations

from dataclasses import replace

from kvlink.layout.spec import MLA, FullAttention, Mamba2, ModelSpec

LLAMA3_8B = ModelSpec(
    name="llama3-8b", num_kv_heads=8, head_dim=128, dtype="bfloat16",
    groups=(FullAttention(),), layer_groups=(0,) * 32,
)

SMOLLM2_135M = ModelSpec(
    name="smollm2-135m", num_kv_heads=3, head_dim=64, dtype="float32",
    groups=(FullAttention(),), layer_groups=(0,) * 30,
)

DEEPSEEK_MLA = ModelSpec(
    name="deepseek-mla", num_kv_heads=1, head_dim=576, dtype="bfloat16",
    groups=(MLA(latent_dim=576),), layer_groups=(0,) * 61,
)

_TINY_MAMBA2 = Mamba2(num_heads=8, head_dim=16, n_groups=2, d_state=16, conv_kernel=4)

# The reference engine's tiny hybrid model allocates exactly this geometry.
TINY_HYBRID = ModelSpec(
    name="hybrid-mamba2", num_kv_heads=4, head_dim=32, dtype="float32",
    groups=(
        FullAttention(),
        _TINY_MAMBA2,
    ),
    layer_groups=(0, 1, 0, 1),
)

# The same model with its conv state row-first ("SD", vLLM's default layout).
TINY_HYBRID_SD = replace(
    TINY_HYBRID, name="hybrid-mamba2-sd",
    groups=(FullAttention(), replace(_TINY_MAMBA2, conv_layout="SD")),
)

PRESETS: dict[str, ModelSpec] = {
    spec.name: spec for spec in (LLAMA3_8B, SMOLLM2_135M, DEEPSEEK_MLA, TINY_HYBRID, TINY_HYBRID_SD)
}


def preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
