"""Next-token choice from last-position logits: greedy, or temperature + top-p with a per-request generator."""

from __future__ import annotations

import torch

from kvlink.engine.request import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from `logits[vocab]`.

    Works in float64 on logits shifted so that the largest is 0: dividing by any temperature
    above 0, however small (a request may send 1e-300), then gives values <= 0 or -inf, never
    inf or NaN, and the top token always keeps a probability of 1 before normalising."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    scaled = logits.double()
    scaled = (scaled - scaled.max()) / params.temperature
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p, and always the top token (a top_p
        # too small for any float to hold would otherwise drop every token).
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        outside[0] = False
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
