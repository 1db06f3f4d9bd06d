"""Paged KV cache in kvlink's packed layout: `[kernel_blocks, kv_heads, block_size, 2*head_dim]`.

K lives in `[..., :head_dim]` and V in `[..., head_dim:]`, so one block of one
layer is one contiguous page, and one head's slice of it is contiguous too.
"""

from __future__ import annotations

import torch

from kvlink.engine.model.config import LlamaConfig


def allocate_kv_caches(
    config: LlamaConfig,
    num_kernel_blocks: int,
    kernel_block_size: int,
    tp_size: int = 1,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """One zeroed packed tensor per layer, holding this rank's `num_kv_heads // tp_size` heads."""
    config.check_tp_size(tp_size)
    shape = (
        num_kernel_blocks,
        config.num_kv_heads // tp_size,
        kernel_block_size,
        2 * config.head_dim,
    )
    return [torch.zeros(shape, dtype=dtype) for _ in range(config.num_layers)]


def write_kv(
    cache: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """Store `key`/`value[tokens, heads, head_dim]` at slots `(blocks[i], offsets[i])`."""
    cache[blocks, :, offsets] = torch.cat([key, value], dim=-1).to(cache.dtype)


def read_kv(
    cache: torch.Tensor, kernel_block_table: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions `[0, num_tokens)`, each `[heads, num_tokens, head_dim]`."""
    _, heads, block_size, packed_dim = cache.shape
    num_blocks = -(-num_tokens // block_size)
    pages = cache[kernel_block_table[:num_blocks]]  # [blocks, heads, block_size, 2*head_dim]
    tokens = pages.transpose(0, 1).reshape(heads, num_blocks * block_size, packed_dim)
    tokens = tokens[:, :num_tokens]
    head_dim = packed_dim // 2
    return tokens[..., :head_dim], tokens[..., head_dim:]
