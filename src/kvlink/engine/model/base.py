"""The model contract the engine drives, and the adapter that puts the Llama model behind it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvlink.engine.model.config import LlamaConfig
from kvlink.layout.spec import FullAttention, ModelSpec

# (request id, layer, tokens of the request computed once this forward ends, block tables):
# called after each layer of a forward that carries a `LayerStream` (P in layerwise mode).
LayerSink = Callable[[str, int, int, list[torch.Tensor]], None]


@dataclass(frozen=True)
class LayerStream:
    """Tells a forward to report each finished layer to `sink`: the KV of positions `< end`
    of request `request_id` is in the caches for that layer once the call returns. (A TP
    engine sends it to the other ranks without the sink; each adds its own.)"""

    request_id: str
    end: int
    sink: LayerSink | None = None


def layer_callback(stream: LayerStream | None, block_tables: list[torch.Tensor]) -> Callable[[int], None] | None:
    if stream is None or stream.sink is None:
        return None
    sink, request_id, end = stream.sink, stream.request_id, stream.end
    return lambda layer: sink(request_id, layer, end, block_tables)


class PagedModel(Protocol):
    """A decoder over kvlink's paged KV memory, one TP rank of it.

    `caches` hold one tensor per layer with the shapes of `layout.kv_tensor_specs(spec,
    tp_size, block_size, kernel_block_size, num_blocks)`. `block_tables[g]` lists the
    LOGICAL block ids of KV-cache group g that cover the sequence; for an SSM group it
    is the request's state block (the state lives in the page of its last entry).

    Invariant: `forward` of tokens `[start_pos, start_pos + T)` reads only state written
    by earlier calls for positions `< start_pos`, and leaves the caches as if the whole
    sequence had been run in one call, so a prompt split at any point gives the same
    logits (up to float rounding).
    """

    spec: ModelSpec
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tp_rank: int
    tp_size: int

    def forward(
        self,
        input_ids: torch.Tensor,
        start_pos: int,
        block_tables: list[torch.Tensor],
        caches: list[torch.Tensor],
        *,
        block_size: int,
        last_token_only: bool = False,
        stream: LayerStream | None = None,
    ) -> torch.Tensor:
        """Logits `[T, vocab]` (float32) of `input_ids[T]` at positions from `start_pos`;
        `[1, vocab]` of the last token with `last_token_only` (all a sampler needs: the
        full matrix of a long prompt is tens of MiB of temporary memory per prefill).
        With `stream`, its sink hears of every layer as soon as its KV is written."""
        ...


def kernel_block_table(logical_blocks: torch.Tensor, physical_per_logical: int) -> torch.Tensor:
    """Kernel block ids of logical blocks: block b covers kernel blocks `b*ppl + [0, ppl)`."""
    offsets = torch.arange(physical_per_logical, dtype=torch.int64)
    return (logical_blocks.to(torch.int64)[:, None] * physical_per_logical + offsets).reshape(-1)


def physical_per_logical(caches: list[torch.Tensor], block_size: int) -> int:
    """Logical block size over the kernel block size of the packed attention caches."""
    kernel_block_size = caches[0].shape[2]
    if block_size % kernel_block_size:
        raise ValueError(
            f"block_size {block_size} is not a multiple of the caches' kernel block size "
            f"{kernel_block_size}; allocate the caches with layout.kv_tensor_specs"
        )
    return block_size // kernel_block_size


def llama_spec(config: LlamaConfig, dtype: str = "float32") -> ModelSpec:
    """A Llama decoder is one full-attention group holding every layer."""
    return ModelSpec(
        name=f"llama-{config.num_layers}l-{config.hidden_size}h",
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=dtype,
        groups=(FullAttention(),),
        layer_groups=(0,) * config.num_layers,
    )


class LlamaForwardSequence(Protocol):
    """What the adapter needs of `engine.model.llama.LlamaModel`."""

    config: LlamaConfig
    tp_rank: int
    tp_size: int

    def forward_sequence(
        self, input_ids: torch.Tensor, start_pos: int, kernel_block_table: torch.Tensor,
        kv_caches: list[torch.Tensor], *, last_token_only: bool = False,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor: ...


class LlamaPagedModel:
    """`LlamaModel` as a `PagedModel`: logical block ids become kernel block ids."""

    def __init__(self, model: LlamaForwardSequence, dtype: str = "float32") -> None:
        self.model = model
        self.spec = llama_spec(model.config, dtype)
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids: tuple[int, ...] = (model.config.eos_token_id,)
        self.tp_rank = model.tp_rank
        self.tp_size = model.tp_size

    def forward(
        self,
        input_ids: torch.Tensor,
        start_pos: int,
        block_tables: list[torch.Tensor],
        caches: list[torch.Tensor],
        *,
        block_size: int,
        last_token_only: bool = False,
        stream: LayerStream | None = None,
    ) -> torch.Tensor:
        table = kernel_block_table(block_tables[0], physical_per_logical(caches, block_size))
        return self.model.forward_sequence(input_ids, start_pos, table, caches, last_token_only=last_token_only,
                                           on_layer=layer_callback(stream, block_tables))
