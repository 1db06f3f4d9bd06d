"""Causal GQA attention over one sequence's packed paged cache, with rotate-half RoPE.

The cache of a layer is `[kernel_blocks, kv_heads, kernel_block_size, 2*head_dim]`,
K in the first half of the last axis and V in the second: the layout every kvlink
worker registers, so what a model writes here is exactly what a transfer moves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Apply RoPE (first half / second half pairing) to `x[tokens, heads, head_dim]`."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(positions.to(torch.float32), inv_freq).repeat(1, 2)[:, None, :]
    first, second = x.chunk(2, dim=-1)
    return x * angles.cos() + torch.cat([-second, first], dim=-1) * angles.sin()


def write_tokens(
    cache: torch.Tensor, kernel_table: torch.Tensor, positions: torch.Tensor,
    key: torch.Tensor, value: torch.Tensor,
) -> None:
    """Store `key`/`value[tokens, kv_heads, head_dim]` at their positions' slots."""
    kernel_block_size = cache.shape[2]
    blocks, offsets = kernel_table[positions // kernel_block_size], positions % kernel_block_size
    cache[blocks, :, offsets] = torch.cat([key, value], dim=-1).to(cache.dtype)


def read_tokens(cache: torch.Tensor, kernel_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Packed K|V of positions `[0, num_tokens)` as `[kv_heads, num_tokens, 2*head_dim]`."""
    _, heads, kernel_block_size, packed = cache.shape
    num_pages = -(-num_tokens // kernel_block_size)
    if num_pages > kernel_table.numel():
        raise ValueError(
            f"{num_tokens} tokens need {num_pages} kernel blocks but the block table has "
            f"{kernel_table.numel()}; the engine must allocate blocks before the forward"
        )
    pages = cache[kernel_table[:num_pages]].transpose(0, 1)  # [heads, pages, kbs, packed]
    return pages.reshape(heads, num_pages * kernel_block_size, packed)[:, :num_tokens]


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
    kernel_table: torch.Tensor, cache: torch.Tensor,
) -> torch.Tensor:
    """Write the new K/V, then attend causally over the whole sequence. Returns `[T, q_heads*head_dim]`.

    `q[T, q_heads, d]`, `k, v[T, kv_heads, d]` are already rotated; q heads are
    grouped over kv heads (q head i reads kv head `i // (q_heads // kv_heads)`).
    """
    write_tokens(cache, kernel_table, positions, k, v)
    total = int(positions[-1]) + 1
    packed = read_tokens(cache, kernel_table, total).to(q.dtype)
    keys, values = packed.chunk(2, dim=-1)
    mask = torch.arange(total) <= positions.unsqueeze(1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
        attn_mask=mask, enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1).reshape(q.shape[0], -1)
