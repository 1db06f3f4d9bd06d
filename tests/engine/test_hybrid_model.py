"""The tiny hybrid model: split prefill is exact, TP shards sum to the unsharded model."""

from __future__ import annotations

import threading

import pytest
import torch

from kvlink.engine.kv_cache import allocate_kv_caches
from kvlink.engine.model.tiny_hybrid import TINY_HYBRID, TinyHybridModel
from kvlink.layout.presets import TINY_HYBRID_SD

BLOCK, KERNEL_BLOCK, NUM_BLOCKS, VOCAB = 8, 4, 6, 512


def _tables(attention_blocks: list[int], state_block: int) -> list[torch.Tensor]:
    return [torch.tensor(attention_blocks), torch.tensor([state_block])]


def _run(model: TinyHybridModel, tokens: torch.Tensor, splits: list[int]) -> torch.Tensor:
    """Run `tokens` in consecutive calls of the given lengths; logits of every token."""
    caches = allocate_kv_caches(model.spec, model.tp_size, BLOCK, KERNEL_BLOCK, NUM_BLOCKS)
    tables = _tables([4, 1, 3], 2)
    start, logits = 0, []
    for length in splits:
        logits.append(model.forward(tokens[start : start + length], start, tables, caches, block_size=BLOCK))
        start += length
    return torch.cat(logits)


@pytest.fixture(scope="module")
def model() -> TinyHybridModel:
    return TinyHybridModel(vocab_size=VOCAB, seed=3)


def test_prompt_split_before_last_token_gives_same_logits(model: TinyHybridModel) -> None:
    tokens = torch.randint(0, VOCAB, (19,), generator=torch.Generator().manual_seed(0))
    whole = _run(model, tokens, [19])
    split = _run(model, tokens, [18, 1])
    torch.testing.assert_close(split, whole, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("splits", [[1] * 7, [2, 3, 2], [3, 1, 1, 2]])
def test_any_split_matches_one_call(model: TinyHybridModel, splits: list[int]) -> None:
    tokens = torch.randint(0, VOCAB, (sum(splits),), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_run(model, tokens, splits), _run(model, tokens, [sum(splits)]), atol=1e-4, rtol=1e-4)


def test_ssm_state_changes_the_output(model: TinyHybridModel) -> None:
    """A model that ignored its SSM page would pass the split tests; this one would not."""
    tokens = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(2))
    caches = allocate_kv_caches(model.spec, 1, BLOCK, KERNEL_BLOCK, NUM_BLOCKS)
    tables = _tables([0], 5)
    model.forward(tokens[:5], 0, tables, caches, block_size=BLOCK)
    reference = model.forward(tokens[5:], 5, tables, caches, block_size=BLOCK)
    model.forward(tokens[:5], 0, tables, caches, block_size=BLOCK)
    for layer in TINY_HYBRID.layers_of(1):  # the SSM pages are lost between the two calls
        caches[layer][5].zero_()
    state_lost = model.forward(tokens[5:], 5, tables, caches, block_size=BLOCK)
    assert not torch.allclose(reference, state_lost, atol=1e-3)


def test_sd_conv_layout_computes_the_same_and_stores_the_transpose(model: TinyHybridModel) -> None:
    """The row-first conv state is the same state: same logits, and its conv bytes are DS's transposed."""
    sd = TinyHybridModel(vocab_size=VOCAB, seed=3, spec=TINY_HYBRID_SD)
    tokens = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(5))
    caches = {}
    for name, m in (("DS", model), ("SD", sd)):
        caches[name] = allocate_kv_caches(m.spec, 1, BLOCK, KERNEL_BLOCK, NUM_BLOCKS)
        tables = _tables([4, 1], 2)
        first = m.forward(tokens[:12], 0, tables, caches[name], block_size=BLOCK)
        logits = torch.cat([first, m.forward(tokens[12:], 12, tables, caches[name], block_size=BLOCK)])
        caches[name + "_logits"] = logits
    torch.testing.assert_close(caches["SD_logits"], caches["DS_logits"], atol=1e-5, rtol=1e-5)
    mamba = TINY_HYBRID.groups[1]
    rows = mamba.conv_kernel - 1  # type: ignore[union-attr]
    for layer in TINY_HYBRID.layers_of(1):
        ds_page, sd_page = caches["DS"][layer][2], caches["SD"][layer][2]
        conv = ds_page.numel() - 8 * 16 * 16  # the SSM state (heads, head_dim, d_state) follows the conv rows
        torch.testing.assert_close(sd_page[:conv].view(rows, -1), ds_page[:conv].view(-1, rows).T)
        assert not torch.equal(sd_page[:conv], ds_page[:conv])
        torch.testing.assert_close(sd_page[conv:], ds_page[conv:])


class _ThreadAllReduce:
    """In-place sum across `world` threads, one per simulated rank."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list[torch.Tensor | None] = [None] * world

    def for_rank(self, rank: int):  # type: ignore[no-untyped-def]
        def all_reduce(tensor: torch.Tensor) -> None:
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            total = torch.stack([s for s in self.slots if s is not None]).sum(0)
            self.barrier.wait()
            tensor.copy_(total)

        return all_reduce


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_shards_match_unsharded(model: TinyHybridModel, tp_size: int) -> None:
    tokens = torch.randint(0, VOCAB, (11,), generator=torch.Generator().manual_seed(4))
    expected = _run(model, tokens, [10, 1])
    reduce = _ThreadAllReduce(tp_size)
    shards = [
        TinyHybridModel(vocab_size=VOCAB, seed=3, tp_rank=r, tp_size=tp_size, all_reduce=reduce.for_rank(r))
        for r in range(tp_size)
    ]
    results: list[torch.Tensor | BaseException | None] = [None] * tp_size

    def run_rank(rank: int) -> None:
        try:
            results[rank] = _run(shards[rank], tokens, [10, 1])
        except BaseException as exc:  # a failing rank must not leave the others at the barrier
            reduce.barrier.abort()
            results[rank] = exc

    threads = [threading.Thread(target=run_rank, args=(r,)) for r in range(tp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    errors = [r for r in results if isinstance(r, BaseException)]
    causes = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if errors:
        raise (causes or errors)[0]
    for rank_logits in results:
        assert isinstance(rank_logits, torch.Tensor)
        torch.testing.assert_close(rank_logits, expected, atol=1e-4, rtol=1e-4)


def test_shard_caches_hold_this_ranks_heads_only() -> None:
    caches = allocate_kv_caches(TINY_HYBRID, 4, BLOCK, KERNEL_BLOCK, NUM_BLOCKS)
    assert caches[0].shape == (NUM_BLOCKS * 2, 1, KERNEL_BLOCK, 64)
    # conv x: 2 heads * 16, conv B and C: 1 group * 16 each, all over 3 rows; state 2*16*16
    assert caches[1].shape == (NUM_BLOCKS, (32 + 16 + 16) * 3 + 2 * 16 * 16)


def test_tp_size_that_splits_a_kv_head_is_refused() -> None:
    with pytest.raises(ValueError, match="must divide num_kv_heads"):
        TinyHybridModel(vocab_size=VOCAB, tp_size=8, all_reduce=lambda t: None)


def test_last_token_only_returns_the_last_row_of_the_full_logits(model: TinyHybridModel) -> None:
    tokens = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(4))
    caches = allocate_kv_caches(model.spec, 1, BLOCK, KERNEL_BLOCK, NUM_BLOCKS)
    tables = _tables([0, 1], 5)
    full = model.forward(tokens, 0, tables, caches, block_size=BLOCK)
    last = model.forward(tokens, 0, tables, caches, block_size=BLOCK, last_token_only=True)
    assert last.shape == (1, VOCAB)
    torch.testing.assert_close(last, full[-1:], atol=1e-5, rtol=1e-5)
