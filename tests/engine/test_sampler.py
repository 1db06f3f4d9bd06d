"""The sampler takes every temperature and top_p a request may send: however small, the
choice stays a valid draw (the top token, in the limit), never NaN or an exception that would
stop the engine for every request."""

from __future__ import annotations

import pytest
import torch

from kvlink.engine.request import SamplingParams
from kvlink.engine.sampler import sample

LOGITS = torch.tensor([1.0, 3.5, -2.0, 3.25, float("-inf"), 0.0])


@pytest.mark.parametrize("temperature", [1e-8, 1e-40, 1e-300, 5e-324])
def test_tiny_temperatures_pick_the_top_token(temperature: float) -> None:
    for seed in range(20):
        params = SamplingParams(temperature=temperature, seed=seed)
        assert sample(LOGITS, params, torch.Generator().manual_seed(seed)) == 1


@pytest.mark.parametrize("top_p", [1e-8, 1e-40, 1e-300, 5e-324])
def test_tiny_top_p_keeps_the_top_token(top_p: float) -> None:
    for seed in range(20):
        params = SamplingParams(temperature=2.0, top_p=top_p, seed=seed)
        assert sample(LOGITS, params, torch.Generator().manual_seed(seed)) == 1


def test_ties_and_huge_logits_stay_finite() -> None:
    tied = torch.tensor([5.0, 5.0, -1.0])
    picks = {sample(tied, SamplingParams(temperature=1e-300), torch.Generator().manual_seed(s)) for s in range(40)}
    assert picks == {0, 1}  # both tops, never the third
    huge = torch.tensor([3e38, -3e38, 1e38], dtype=torch.float32)
    assert sample(huge, SamplingParams(temperature=0.5), torch.Generator().manual_seed(0)) == 0


def test_draws_follow_the_tempered_distribution() -> None:
    """The float64 path still samples softmax(logits / T) restricted to the top-p nucleus."""
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    params = SamplingParams(temperature=0.7, top_p=0.9)
    generator = torch.Generator().manual_seed(1)
    counts = torch.zeros(4)
    n = 4000
    for _ in range(n):
        counts[sample(logits, params, generator)] += 1
    probs = torch.softmax(logits.double() / 0.7, dim=-1)
    order = torch.argsort(probs, descending=True)
    kept = torch.zeros(4, dtype=torch.bool)
    mass = 0.0
    for i in order.tolist():  # the smallest prefix reaching top_p
        kept[i] = True
        mass += float(probs[i])
        if mass >= 0.9:
            break
    want = torch.where(kept, probs, torch.zeros_like(probs))
    want = want / want.sum()
    assert counts[~kept].sum() == 0
    assert torch.allclose(counts.double() / n, want, atol=0.03)
