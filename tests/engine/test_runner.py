"""The runner asks the model only for the logits it samples from: one row per run, not [T, vocab].

The full matrix of a 300-token prompt over SmolLM2's 49152-token vocabulary is 56 MiB
of temporary memory per prefill; freeing such blocks left P's malloc heap larger in
steps during the soak (RELIABILITY.md, "Memory over time").
"""

from __future__ import annotations

from typing import Any

import torch

from kvlink.engine.engine import LLMEngine
from kvlink.engine.model.tiny_hybrid import TinyHybridModel
from kvlink.engine.request import SamplingParams

VOCAB, BLOCK = 512, 8


class RowCounting:
    """A `PagedModel` that records how many logit rows each forward call returned."""

    def __init__(self, model: TinyHybridModel) -> None:
        self.model = model
        self.spec, self.vocab_size, self.eos_token_ids = model.spec, model.vocab_size, model.eos_token_ids
        self.tp_rank, self.tp_size = model.tp_rank, model.tp_size
        self.rows: list[int] = []

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        logits = self.model.forward(*args, **kwargs)
        self.rows.append(int(logits.shape[0]))
        return logits


def test_a_long_prefill_returns_one_logit_row() -> None:
    """Generation itself is checked against a full-logits reference in test_engine.py."""
    counting = RowCounting(TinyHybridModel(vocab_size=VOCAB, seed=5, eos_token_ids=()))
    engine = LLMEngine(counting, 16, BLOCK, BLOCK)  # type: ignore[arg-type]
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    engine.add_request("r", prompt, SamplingParams(max_tokens=3))
    tokens: list[int] = []
    while engine.has_unfinished():
        for output in engine.step():
            tokens += output.new_token_ids
    assert len(tokens) == 3
    assert counting.rows == [1, 1, 1]  # the 40-token prefill, then two decode steps
