"""Llama decoder over a paged, packed KV cache, optionally one tensor-parallel shard of it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from kvlink.engine.model.config import LlamaConfig
from kvlink.engine.model.paged_batch import PagedBatch, PagedSequence
from kvlink.engine.model.paged_kv import read_kv, write_kv
from kvlink.engine.model.rope import RotaryEmbedding

AllReduce = Callable[[torch.Tensor], None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class LlamaLayer(torch.nn.Module):
    """One decoder block holding this rank's slice of heads and MLP columns."""

    attn_norm: torch.Tensor
    wqkv: torch.Tensor
    wo: torch.Tensor
    ffn_norm: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor

    def __init__(
        self,
        config: LlamaConfig,
        weights: dict[str, torch.Tensor],
        prefix: str,
        tp_rank: int,
        tp_size: int,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        head_dim = config.head_dim
        self.num_heads = config.num_heads // tp_size
        self.num_kv_heads = config.num_kv_heads // tp_size
        self.head_dim = head_dim
        self.eps = config.rms_norm_eps
        q_size = self.num_heads * head_dim
        kv_size = self.num_kv_heads * head_dim
        self.qkv_sizes = [q_size, kv_size, kv_size]
        self.ffn_size = config.intermediate_size // tp_size

        def rows(name: str, per_rank: int) -> torch.Tensor:
            start = tp_rank * per_rank
            return weights[prefix + name][start : start + per_rank].to(dtype)

        def columns(name: str, per_rank: int) -> torch.Tensor:
            start = tp_rank * per_rank
            return weights[prefix + name][:, start : start + per_rank].to(dtype).contiguous()

        # q, k, v (and gate, up) are fused into one matmul each: decode is overhead-bound on CPU.
        qkv_parts = [
            rows("attn_q.weight", q_size),
            rows("attn_k.weight", kv_size),
            rows("attn_v.weight", kv_size),
        ]
        gate_up_parts = [
            rows("ffn_gate.weight", self.ffn_size),
            rows("ffn_up.weight", self.ffn_size),
        ]
        self.register_buffer("attn_norm", weights[prefix + "attn_norm.weight"].to(dtype))
        self.register_buffer("wqkv", torch.cat(qkv_parts))
        self.register_buffer("wo", columns("attn_output.weight", q_size))
        self.register_buffer("ffn_norm", weights[prefix + "ffn_norm.weight"].to(dtype))
        self.register_buffer("w_gate_up", torch.cat(gate_up_parts))
        self.register_buffer("w_down", columns("ffn_down.weight", self.ffn_size))

    def attention(
        self, x: torch.Tensor, batch: PagedBatch, rope: RotaryEmbedding, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """This rank's partial attention output for every row of the batch (before all-reduce)."""
        rows = x.shape[0]
        h = rms_norm(x, self.attn_norm, self.eps)
        q, k, v = torch.split(F.linear(h, self.wqkv), self.qkv_sizes, dim=-1)
        q = rope.apply(q.view(rows, self.num_heads, self.head_dim), batch.positions)
        k = rope.apply(k.view(rows, self.num_kv_heads, self.head_dim), batch.positions)
        v = v.view(rows, self.num_kv_heads, self.head_dim)
        write_kv(kv_cache, batch.slot_blocks, batch.slot_offsets, k, v)
        out = torch.cat([self._attend(q[seq.rows], seq, kv_cache) for seq in batch.sequences])
        return F.linear(out, self.wo)

    def _attend(self, q: torch.Tensor, seq: PagedSequence, kv_cache: torch.Tensor) -> torch.Tensor:
        keys, values = read_kv(kv_cache, seq.kernel_block_table, seq.num_tokens)
        mask = None
        if seq.num_new > 1:
            # The query at position p sees keys [0, p]; the cached prefix is visible to all.
            query_positions = torch.arange(seq.start_pos, seq.num_tokens).unsqueeze(1)
            mask = torch.arange(seq.num_tokens) <= query_positions
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0).to(q.dtype),
            values.unsqueeze(0).to(q.dtype),
            attn_mask=mask,
            enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1).reshape(seq.num_new, self.num_heads * self.head_dim)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial MLP output (before all-reduce)."""
        h = rms_norm(x, self.ffn_norm, self.eps)
        gate, up = torch.split(F.linear(h, self.w_gate_up), self.ffn_size, dim=-1)
        return F.linear(F.silu(gate) * up, self.w_down)


class LlamaModel(torch.nn.Module):
    """Llama forward that reads and writes KV in kvlink's packed paged layout.

    With `tp_size > 1` this module is rank `tp_rank`'s shard: q heads, kv heads
    and MLP columns are split evenly, and `all_reduce` (an in-place sum over
    ranks) is called after the attention output projection and after the MLP
    down projection, in the same order on every rank. Embedding and LM head
    are replicated.
    """

    embedding: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor

    def __init__(
        self,
        config: LlamaConfig,
        weights: dict[str, torch.Tensor],
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype = torch.float32,
        all_reduce: AllReduce | None = None,
    ) -> None:
        super().__init__()
        config.check_tp_size(tp_size)
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
        if tp_size > 1 and all_reduce is None:
            raise ValueError(
                f"tp_size={tp_size} needs an all_reduce callable to sum partial outputs"
            )
        self.config = config
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.dtype = dtype
        self._all_reduce = all_reduce
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.max_position)
        self.register_buffer("embedding", weights["token_embd.weight"].to(dtype))
        self.register_buffer("final_norm", weights["output_norm.weight"].to(dtype))
        lm_head = weights.get("output.weight", weights["token_embd.weight"])
        self.register_buffer("lm_head", lm_head.to(dtype))
        self.layers = torch.nn.ModuleList(
            LlamaLayer(config, weights, f"blk.{i}.", tp_rank, tp_size, dtype)
            for i in range(config.num_layers)
        )

    def forward_sequence(
        self,
        input_ids: torch.Tensor,
        start_pos: int,
        kernel_block_table: torch.Tensor,
        kv_caches: list[torch.Tensor],
        *,
        last_token_only: bool = False,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run `input_ids[T]` at positions `[start_pos, start_pos + T)` of one sequence.

        Positions before `start_pos` must already hold K/V in the pages named by
        `kernel_block_table` (position p → block `table[p // kbs]`, offset
        `p % kbs`); the new tokens' K/V are written there too. Returns float32
        logits `[T, vocab]`, or `[1, vocab]` for the last token when
        `last_token_only` is set (a prefill only needs that row).
        """
        return self.forward_batch(
            [input_ids],
            [start_pos],
            [kernel_block_table],
            kv_caches,
            last_token_only=last_token_only,
            on_layer=on_layer,
        )

    @torch.inference_mode()
    def forward_batch(
        self,
        input_ids: Sequence[torch.Tensor],
        start_positions: Sequence[int],
        kernel_block_tables: Sequence[torch.Tensor],
        kv_caches: list[torch.Tensor],
        *,
        last_token_only: bool = False,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """`forward_sequence` for several sequences in one pass (continuous batching).

        Sequence i brings `input_ids[i]` at `start_positions[i]` with its own
        block table; decode steps and prefill chunks can be mixed. The matmuls
        run once over all rows, which is what makes batched decode cheaper than
        one call per sequence. Returns logits for all rows back to back
        `[sum T_i, vocab]`, or `[num_sequences, vocab]` (each sequence's last
        row) when `last_token_only` is set.
        """
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(
                f"expected {self.config.num_layers} KV tensors (one per layer), got {len(kv_caches)}"
            )
        num_new = [int(ids.shape[0]) for ids in input_ids]
        kernel_block_size = kv_caches[0].shape[2]
        for count, start, table in zip(num_new, start_positions, kernel_block_tables, strict=True):
            self._check_request(count, start, table, kv_caches[0])
        batch = PagedBatch.build(num_new, start_positions, kernel_block_tables, kernel_block_size)
        x = self.embedding[torch.cat(list(input_ids))]
        layers: list[LlamaLayer] = list(self.layers)  # type: ignore[arg-type]
        for index, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            x = x + self._reduce(layer.attention(x, batch, self.rope, kv_cache))
            if on_layer is not None:  # this layer's K/V are in the pages: they may leave now
                on_layer(index)
            x = x + self._reduce(layer.mlp(x))
        if last_token_only:
            x = x[batch.last_rows]
        x = rms_norm(x, self.final_norm, self.config.rms_norm_eps)
        return F.linear(x, self.lm_head).float()

    def _check_request(
        self, num_new: int, start_pos: int, kernel_block_table: torch.Tensor, kv_cache: torch.Tensor
    ) -> None:
        if num_new < 1 or start_pos < 0:
            raise ValueError(
                f"need at least one new token at start_pos >= 0, got {num_new} at {start_pos}"
            )
        _, heads, block_size, packed_dim = kv_cache.shape
        expected = (self.config.num_kv_heads // self.tp_size, 2 * self.config.head_dim)
        if (heads, packed_dim) != expected:
            raise ValueError(
                f"KV tensor has (kv_heads, 2*head_dim) = {(heads, packed_dim)}, this rank needs "
                f"{expected}; allocate it with allocate_kv_caches(config, ..., tp_size={self.tp_size})"
            )
        total = start_pos + num_new
        if total > self.config.max_position:
            raise ValueError(
                f"positions up to {total} exceed the model's context of "
                f"{self.config.max_position} tokens; shorten the prompt or max_tokens"
            )
        needed = -(-total // block_size)
        if kernel_block_table.numel() < needed:
            raise ValueError(
                f"{total} tokens need {needed} kernel blocks of {block_size}, "
                f"but the block table holds {kernel_block_table.numel()}"
            )

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if self._all_reduce is not None:
            self._all_reduce(partial)
        return partial
