"""A colocated vLLM SmolLM2 server (no connector) against transformers' greedy generation."""

from __future__ import annotations

from typing import Any

import pytest

from kvlink.integrations.vllm.launch import greedy_completion
from kvlink.procs.launcher import Service

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"
NEW_TOKENS = 24


def test_greedy_completion_matches_transformers(smollm2_server: Service,
                                                smollm2_reference: tuple[Any, Any]) -> None:
    import torch

    tokenizer, model = smollm2_reference
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    # Plain argmax loop (the server ignores EOS, so no stop rule on either side).
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    expected = ids[len(prompt_ids):]

    answer = greedy_completion(smollm2_server.url, prompt_ids, NEW_TOKENS)
    choice = answer["choices"][0]
    got = choice.get("token_ids") or tokenizer(choice["text"], add_special_tokens=False)["input_ids"]
    assert got == expected, (f"vLLM: {choice['text']!r}\n"
                             f"transformers: {tokenizer.decode(expected)!r}")
    assert choice["text"] == tokenizer.decode(expected)
