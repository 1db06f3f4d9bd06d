"""The paged Llama forward on SmolLM2 agrees with transformers, across paging, chunking and TP."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from kvlink.engine.model import LlamaConfig, LlamaModel, allocate_kv_caches
from kvlink.engine.tokenizer import Tokenizer

PROMPT = [{"role": "user", "content": "Write a haiku about the sea."}]
NUM_BLOCKS = 32


@pytest.fixture(scope="module")
def model(smollm2_config: LlamaConfig, smollm2_weights: dict[str, torch.Tensor]) -> LlamaModel:
    return LlamaModel(smollm2_config, smollm2_weights)


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer: Tokenizer) -> list[int]:
    return smollm2_tokenizer.encode(smollm2_tokenizer.apply_chat_template(PROMPT))


def shuffled_table(num_blocks: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks, generator=generator)


def prefill(
    model: LlamaModel,
    ids: list[int],
    kernel_block_size: int,
    table: torch.Tensor,
    chunk_sizes: list[int] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits of every prompt position, computed in the given chunks."""
    kv = allocate_kv_caches(model.config, NUM_BLOCKS, kernel_block_size, model.tp_size)
    chunks = chunk_sizes or [len(ids)]
    assert sum(chunks) == len(ids)
    logits, start = [], 0
    for size in chunks:
        chunk = torch.tensor(ids[start : start + size])
        logits.append(model.forward_sequence(chunk, start, table, kv))
        start += size
    return torch.cat(logits), kv


def greedy(
    model: LlamaModel, ids: list[int], steps: int, kernel_block_size: int, table: torch.Tensor
) -> list[int]:
    logits, kv = prefill(model, ids, kernel_block_size, table)
    out = [int(logits[-1].argmax())]
    for position in range(len(ids), len(ids) + steps - 1):
        logits = model.forward_sequence(torch.tensor(out[-1:]), position, table, kv)
        out.append(int(logits[-1].argmax()))
    return out


def assert_logits_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    scale = float(reference.abs().max())
    assert ours.shape == reference.shape
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, reference, rtol=0.0, atol=1e-3 * scale)


def test_logits_match_transformers(model: LlamaModel, hf_model: Any, prompt_ids: list[int]) -> None:
    ours, _ = prefill(model, prompt_ids, 16, torch.arange(NUM_BLOCKS))
    with torch.no_grad():
        reference = hf_model(torch.tensor([prompt_ids])).logits[0].float()
    # Measured on SmolLM2-135M Q4_1: identical to transformers (max |diff| 0.0 at logit scale ~38).
    assert_logits_close(ours, reference)


@pytest.mark.parametrize(
    ("kernel_block_size", "seed", "chunk_sizes"),
    [(16, None, [5, 11, 1]), (32, 1, None), (16, 2, [17, 3]), (32, 3, [1, 31, 2])],
)
def test_paging_and_chunking_do_not_change_logits(
    model: LlamaModel,
    prompt_ids: list[int],
    kernel_block_size: int,
    seed: int | None,
    chunk_sizes: list[int] | None,
) -> None:
    baseline, _ = prefill(model, prompt_ids, 16, torch.arange(NUM_BLOCKS))
    table = torch.arange(NUM_BLOCKS) if seed is None else shuffled_table(NUM_BLOCKS, seed)
    if chunk_sizes is not None:
        chunk_sizes = [*chunk_sizes, len(prompt_ids) - sum(chunk_sizes)]
    logits, _ = prefill(model, prompt_ids, kernel_block_size, table, chunk_sizes)
    torch.testing.assert_close(logits, baseline, rtol=0.0, atol=1e-4 * float(baseline.abs().max()))


def test_kv_lands_in_the_pages_the_table_names(model: LlamaModel, prompt_ids: list[int]) -> None:
    table = shuffled_table(NUM_BLOCKS, seed=4)
    kernel_block_size = 16
    _, kv = prefill(model, prompt_ids, kernel_block_size, table)
    used = -(-len(prompt_ids) // kernel_block_size)
    untouched = table[used:]
    for layer_kv in kv:
        assert torch.all(layer_kv[untouched] == 0)
        last_block = layer_kv[table[used - 1]]
        filled = len(prompt_ids) - (used - 1) * kernel_block_size
        assert torch.all(last_block[:, filled:] == 0)
        assert torch.all(last_block[:, :filled].abs().sum(-1) > 0)


def test_greedy_generation_matches_transformers(
    model: LlamaModel, hf_model: Any, prompt_ids: list[int]
) -> None:
    steps = 20
    ours = greedy(model, prompt_ids, steps, 16, shuffled_table(NUM_BLOCKS, seed=5))
    with torch.no_grad():
        generated = hf_model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.int64),
            do_sample=False,
            max_new_tokens=steps,
        )
    theirs = generated[0, len(prompt_ids) :].tolist()
    assert len(theirs) == steps, "the prompt should not hit EOS within the compared steps"
    assert ours == theirs


def test_batched_step_matches_one_sequence_at_a_time(
    model: LlamaModel, prompt_ids: list[int]
) -> None:
    """A decode step and a prefill chunk of different sequences in one batch, over shared pages."""
    kernel_block_size, blocks_per_seq = 16, NUM_BLOCKS // 4
    tables = shuffled_table(NUM_BLOCKS, seed=7).split(blocks_per_seq)[:3]
    first, second = prompt_ids, prompt_ids[5:]
    split = 20

    kv = allocate_kv_caches(model.config, NUM_BLOCKS, kernel_block_size)
    model.forward_sequence(torch.tensor(first), 0, tables[0], kv)
    model.forward_sequence(torch.tensor(second[:split]), 0, tables[1], kv)
    inputs = [torch.tensor([7]), torch.tensor(second[split:]), torch.tensor(first[:9])]
    starts = [len(first), split, 0]
    batched = model.forward_batch(inputs, starts, tables, kv)
    last_only = model.forward_batch(inputs, starts, tables, kv, last_token_only=True)

    separate_kv = allocate_kv_caches(model.config, NUM_BLOCKS, kernel_block_size)
    model.forward_sequence(torch.tensor(first), 0, tables[0], separate_kv)
    model.forward_sequence(torch.tensor(second[:split]), 0, tables[1], separate_kv)
    separate = torch.cat(
        [
            model.forward_sequence(ids, start, table, separate_kv)
            for ids, start, table in zip(inputs, starts, tables, strict=True)
        ]
    )
    atol = 1e-4 * float(separate.abs().max())
    torch.testing.assert_close(batched, separate, rtol=0.0, atol=atol)
    last_rows = torch.tensor([len(ids) for ids in inputs]).cumsum(0) - 1
    torch.testing.assert_close(last_only, separate[last_rows], rtol=0.0, atol=atol)
    for layer_kv, separate_layer_kv in zip(kv, separate_kv, strict=True):
        kv_atol = 1e-4 * float(separate_layer_kv.abs().max())
        torch.testing.assert_close(layer_kv, separate_layer_kv, rtol=0.0, atol=kv_atol)


class ThreadAllReduce:
    """In-place sum across `world_size` threads; each thread passes its own tensor."""

    def __init__(self, world_size: int, timeout_s: float = 60.0) -> None:
        self._barrier = threading.Barrier(world_size, timeout=timeout_s)
        self._slots: list[torch.Tensor | None] = [None] * world_size

    def for_rank(self, rank: int) -> Any:
        def all_reduce(tensor: torch.Tensor) -> None:
            self._slots[rank] = tensor.clone()
            self._barrier.wait()
            total = torch.stack([t for t in self._slots if t is not None]).sum(0)
            self._barrier.wait()  # nobody overwrites a slot before every rank has summed
            tensor.copy_(total)

        return all_reduce


def test_three_tp_shards_match_one_rank(
    smollm2_config: LlamaConfig,
    smollm2_weights: dict[str, torch.Tensor],
    model: LlamaModel,
    prompt_ids: list[int],
) -> None:
    tp_size, decode_steps = 3, 3
    reduce = ThreadAllReduce(tp_size)
    shards = [
        LlamaModel(smollm2_config, smollm2_weights, rank, tp_size, all_reduce=reduce.for_rank(rank))
        for rank in range(tp_size)
    ]
    table = shuffled_table(NUM_BLOCKS, seed=6)
    results: list[list[int] | BaseException | None] = [None] * tp_size

    def run(rank: int) -> None:
        try:
            results[rank] = greedy(shards[rank], prompt_ids, decode_steps, 16, table)
        except BaseException as error:
            results[rank] = error
            reduce._barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(tp_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "TP shards did not finish in 120 s"
    for result in results:
        if isinstance(result, BaseException):
            raise result
    expected = greedy(model, prompt_ids, decode_steps, 16, table)
    assert results == [expected] * tp_size

    kv_shards = [allocate_kv_caches(smollm2_config, NUM_BLOCKS, 16, tp_size) for _ in shards]
    assert kv_shards[0][0].shape == (NUM_BLOCKS, 1, 16, 2 * smollm2_config.head_dim)
    logits: list[torch.Tensor | None] = [None] * tp_size

    def prefill_rank(rank: int) -> None:
        logits[rank] = shards[rank].forward_sequence(
            torch.tensor(prompt_ids), 0, table, kv_shards[rank]
        )

    threads = [
        threading.Thread(target=prefill_rank, args=(r,), daemon=True) for r in range(tp_size)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    reference, full_kv = prefill(model, prompt_ids, 16, table)
    for rank, rank_logits in enumerate(logits):
        assert rank_logits is not None, f"rank {rank} did not finish"
        assert_logits_close(rank_logits, reference)
        # Rank r's cache holds exactly kv head r of the single-rank cache.
        torch.testing.assert_close(
            kv_shards[rank][0], full_kv[0][:, rank : rank + 1], atol=1e-4, rtol=0
        )


def test_tp_size_must_divide_kv_heads(
    smollm2_config: LlamaConfig, smollm2_weights: dict[str, torch.Tensor]
) -> None:
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        LlamaModel(smollm2_config, smollm2_weights, 0, 2, all_reduce=lambda t: None)


def test_short_block_table_is_rejected(model: LlamaModel, prompt_ids: list[int]) -> None:
    kv = allocate_kv_caches(model.config, NUM_BLOCKS, 16)
    with pytest.raises(ValueError, match="block table holds 1"):
        model.forward_sequence(torch.tensor(prompt_ids), 0, torch.arange(1), kv)


def test_bfloat16_model_agrees_with_float32(
    smollm2_config: LlamaConfig,
    smollm2_weights: dict[str, torch.Tensor],
    model: LlamaModel,
    prompt_ids: list[int],
) -> None:
    bf16 = LlamaModel(smollm2_config, smollm2_weights, dtype=torch.bfloat16)
    kv = allocate_kv_caches(smollm2_config, NUM_BLOCKS, 16, dtype=torch.bfloat16)
    ours = bf16.forward_sequence(torch.tensor(prompt_ids), 0, torch.arange(NUM_BLOCKS), kv)
    reference, _ = prefill(model, prompt_ids, 16, torch.arange(NUM_BLOCKS))
    assert ours.dtype == torch.float32
    assert kv[0].dtype == torch.bfloat16
    assert int(ours[-1].argmax()) == int(reference[-1].argmax())
    # bf16 keeps 8 mantissa bits; over 30 layers the logits drift by a few percent of their range.
    assert float((ours - reference).abs().max()) < 0.1 * float(reference.abs().max())
