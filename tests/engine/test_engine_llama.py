"""The Llama adapter: logical block ids become kernel ids, and the engine generates like the model."""

from __future__ import annotations

import pytest
import torch

from kvlink.engine.engine import LLMEngine
from kvlink.engine.kv_cache import allocate_kv_caches
from kvlink.engine.model.base import LlamaPagedModel, kernel_block_table
from kvlink.engine.model.config import LlamaConfig
from kvlink.engine.model.llama import LlamaModel
from kvlink.engine.request import SamplingParams

BLOCK, KERNEL_BLOCK = 8, 4
CONFIG = LlamaConfig(
    num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
    rope_theta=10000.0, rms_norm_eps=1e-5, vocab_size=300, max_position=256, bos_token_id=1,
    eos_token_id=2,
)


def random_weights(config: LlamaConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, q, kv, ffn = (config.hidden_size, config.num_heads * config.head_dim,
                     config.num_kv_heads * config.head_dim, config.intermediate_size)
    weights = {"token_embd.weight": torch.randn(config.vocab_size, h, generator=g),
               "output_norm.weight": torch.ones(h)}
    shapes = {"attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
              "ffn_gate": (ffn, h), "ffn_up": (ffn, h), "ffn_down": (h, ffn)}
    for layer in range(config.num_layers):
        for name, shape in shapes.items():
            weights[f"blk.{layer}.{name}.weight"] = torch.randn(*shape, generator=g) / shape[1] ** 0.5
        weights[f"blk.{layer}.attn_norm.weight"] = torch.ones(h)
        weights[f"blk.{layer}.ffn_norm.weight"] = torch.ones(h)
    return weights


@pytest.fixture(scope="module")
def llama() -> LlamaModel:
    return LlamaModel(CONFIG, random_weights(CONFIG))


def test_kernel_block_table_expands_each_logical_block() -> None:
    assert kernel_block_table(torch.tensor([3, 1]), 2).tolist() == [6, 7, 2, 3]
    assert kernel_block_table(torch.tensor([5]), 1).tolist() == [5]


def test_adapter_describes_one_full_attention_group(llama: LlamaModel) -> None:
    model = LlamaPagedModel(llama)
    assert model.spec.layer_groups == (0, 0) and model.spec.groups[0].kind == "full"
    assert (model.spec.num_kv_heads, model.spec.head_dim) == (2, 16)
    assert model.eos_token_ids == (2,) and model.vocab_size == 300


def test_engine_generates_like_recomputing_from_scratch(llama: LlamaModel) -> None:
    prompt = [5, 17, 42, 99, 3, 7, 8, 120, 33, 61, 77]
    expected: list[int] = []
    for _ in range(6):
        caches = allocate_kv_caches(LlamaPagedModel(llama).spec, 1, KERNEL_BLOCK, KERNEL_BLOCK, 8)
        sequence = torch.tensor(prompt + expected)
        logits = llama.forward_sequence(sequence, 0, torch.arange(8), caches)
        expected.append(int(torch.argmax(logits[-1])))
    engine = LLMEngine(LlamaPagedModel(llama), num_blocks=6, block_size=BLOCK, kernel_block_size=KERNEL_BLOCK)
    engine.add_request("warm", [9, 9, 9, 9, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("x", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    generated: list[int] = []
    while engine.has_unfinished():
        generated += [t for o in engine.step() if o.request_id == "x" for t in o.new_token_ids]
        engine.check_integrity()
    assert generated == expected
    assert engine.stats()["free_blocks"] == [6]


def test_min_tokens_keeps_stop_tokens_out_until_then(llama: LlamaModel) -> None:
    """With `min_tokens`, a stop token cannot be sampled before that many tokens (vLLM's and
    transformers' `min_new_tokens` rule): its logit is ruled out, the rest of the choice is
    unchanged; afterwards it ends the answer again."""
    prompt = [5, 17, 42, 99, 3, 7, 8, 120, 33, 61, 77]

    def reference(stop: set[int], min_tokens: int, steps: int) -> list[int]:
        out: list[int] = []
        for _ in range(steps):
            caches = allocate_kv_caches(LlamaPagedModel(llama).spec, 1, KERNEL_BLOCK, KERNEL_BLOCK, 8)
            logits = llama.forward_sequence(torch.tensor(prompt + out), 0, torch.arange(8), caches)[-1].clone()
            if len(out) < min_tokens:
                logits[list(stop)] = float("-inf")
            out.append(int(torch.argmax(logits)))
            if out[-1] in stop and len(out) > min_tokens:
                break
        return out

    free = reference(set(), 0, 6)
    stop = free[0]  # the first greedy token as a stop token ends the answer at once ...

    def run(params: SamplingParams) -> tuple[list[int], str | None]:
        engine = LLMEngine(LlamaPagedModel(llama), num_blocks=6, block_size=BLOCK, kernel_block_size=KERNEL_BLOCK)
        engine.add_request("x", prompt, params)
        tokens, reason = [], None
        while engine.has_unfinished():
            for o in engine.step():
                tokens += o.new_token_ids
                reason = o.finish_reason if o.finished else reason
        return tokens, reason

    assert run(SamplingParams(max_tokens=6, stop_token_ids=(stop,), ignore_eos=True)) == (free[:1], "stop")
    # ... unless min_tokens keeps it out of the first 2
    expected = reference({stop}, 2, 6)
    assert expected[0] != stop
    tokens, reason = run(SamplingParams(max_tokens=6, stop_token_ids=(stop,), ignore_eos=True, min_tokens=2))
    assert tokens == expected and stop not in tokens[:2]
    assert reason == ("stop" if tokens[-1] == stop else "length")
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
