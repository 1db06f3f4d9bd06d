"""Rotary position embedding in the rotate-half convention (first half / second half of a head)."""

from __future__ import annotations

import torch


class RotaryEmbedding:
    """Cos/sin tables for positions `[0, max_position)`, computed once in float32."""

    def __init__(self, head_dim: int, theta: float, max_position: int) -> None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        inv_freq = 1.0 / (theta**exponents)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos()
        self.sin = angles.sin()

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate `x[tokens, heads, head_dim]` by each token's position (`< max_position`)."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        x32 = x.float()
        first, second = x32.chunk(2, dim=-1)
        rotated = torch.cat([-second, first], dim=-1)
        return (x32 * cos + rotated * sin).to(x.dtype)
