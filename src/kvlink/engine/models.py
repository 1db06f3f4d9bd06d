"""The models the reference engine serves, by name, as `PagedModel`s of one TP rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads only with a model, so CLI commands can list MODEL_NAMES cheaply
    import torch

    from kvlink.engine.model.base import PagedModel

MODEL_NAMES = ("smollm2-135m", "tiny-hybrid", "tiny-hybrid-sd")
Progress = Callable[[str], None]
AllReduce = Callable[["torch.Tensor"], None]


def load_model(
    name: str, tp_rank: int = 0, tp_size: int = 1, all_reduce: AllReduce | None = None,
    progress: Progress = print,
) -> tuple[PagedModel, int]:
    """The model `name` (rank `tp_rank` of `tp_size`) and the longest sequence it supports."""
    from kvlink.engine.model import LlamaModel, load_config, load_weights, smollm2_gguf_path
    from kvlink.engine.model.base import LlamaPagedModel
    from kvlink.engine.model.tiny_hybrid import TinyHybridModel

    if name == "smollm2-135m":
        path = smollm2_gguf_path()
        progress(f"reading SmolLM2-135M weights from {path} (rank {tp_rank}/{tp_size})")
        config = load_config(path)
        model = LlamaModel(config, load_weights(path), tp_rank=tp_rank, tp_size=tp_size,
                           all_reduce=all_reduce)
        return LlamaPagedModel(model), config.max_position
    if name in ("tiny-hybrid", "tiny-hybrid-sd"):
        from kvlink.layout.presets import TINY_HYBRID, TINY_HYBRID_SD

        spec = TINY_HYBRID_SD if name == "tiny-hybrid-sd" else TINY_HYBRID
        layout = spec.groups[1].conv_layout  # type: ignore[union-attr]
        progress(f"building {name}: attention + Mamba2 (conv state {layout}), seeded weights "
                 f"(rank {tp_rank}/{tp_size})")
        return TinyHybridModel(tp_rank=tp_rank, tp_size=tp_size, all_reduce=all_reduce, spec=spec), 1 << 30
    raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODEL_NAMES)}")
