"""A tiny attention + Mamba2 hybrid with seeded random weights, over kvlink's paged KV layout.

It exists to exercise hybrid KV transfer end to end: attention layers keep packed
paged K/V exactly like the Llama model, Mamba2 layers keep their whole recurrent
state (conv x | B | C dim-first, then the SSM state) in one page per request. The
vocabulary is SmolLM2's (49152 ids) so the SmolLM2 tokenizer drives it too; the
text it writes is noise, but it is deterministic noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvlink.engine.model.base import (
    LayerStream,
    kernel_block_table,
    layer_callback,
    physical_per_logical,
)
from kvlink.engine.paged_attention import paged_attention, rotate
from kvlink.layout.presets import TINY_HYBRID
from kvlink.layout.spec import FullAttention, Mamba2, ModelSpec
from kvlink.layout.tensors import PageSlice, ssm_page_slices

AllReduce = Callable[[torch.Tensor], None]
__all__ = ["TINY_HYBRID", "TinyHybridModel"]

SMOLLM2_VOCAB = 49152
SMOLLM2_EOS = 2  # <|im_end|>
EPS = 1e-5


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


class _Init:
    """Draws every full (unsharded) weight in a fixed order, so all ranks agree."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def linear(self, out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=self.generator) / math.sqrt(in_features)

    def uniform(self, size: int, low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(size, generator=self.generator)


class AttentionMixer:
    """GQA attention with RoPE; this rank's kv heads and the q heads that read them."""

    def __init__(self, init: _Init, spec: ModelSpec, hidden: int, q_heads: int, rank: int, tp: int) -> None:
        d = spec.head_dim
        kv_part = spec.attention_part()
        first, count = kv_part.first_unit(rank, tp), kv_part.units_on_rank(tp)
        q_per_kv = q_heads // spec.num_kv_heads
        q_rows = slice(first * q_per_kv * d, (first + count) * q_per_kv * d)
        kv_rows = slice(first * d, (first + count) * d)
        self.wq = init.linear(q_heads * d, hidden)[q_rows]
        self.wk = init.linear(spec.num_kv_heads * d, hidden)[kv_rows]
        self.wv = init.linear(spec.num_kv_heads * d, hidden)[kv_rows]
        self.wo = init.linear(hidden, q_heads * d)[:, q_rows]
        self.q_heads, self.kv_heads, self.head_dim = count * q_per_kv, count, d

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor, kernel_table: torch.Tensor, cache: torch.Tensor,
    ) -> torch.Tensor:
        num_new = x.shape[0]
        q = rotate(F.linear(x, self.wq).view(num_new, self.q_heads, self.head_dim), positions)
        k = rotate(F.linear(x, self.wk).view(num_new, self.kv_heads, self.head_dim), positions)
        v = F.linear(x, self.wv).view(num_new, self.kv_heads, self.head_dim)
        return F.linear(paged_attention(q, k, v, positions, kernel_table, cache), self.wo)


class StateViews:
    """Views of one SSM page: each conv sub-projection as `[channels, rows]` (strided for SD),
    and the state. The split is worked out once, from the page slices."""

    def __init__(self, slices: tuple[PageSlice, ...], conv_layout: str) -> None:
        self.state, conv = slices[-1], slices[:-1]
        self.ds = conv if conv_layout == "DS" else ()
        names = list(dict.fromkeys(s.name.rsplit(".", 1)[0] for s in conv))
        self.rows = len(conv) // len(names)
        self.columns: list[tuple[str, int, int]] = []  # SD: (sub-projection, first column, width)
        start = 0
        for name, s in zip(names, conv[: len(names)], strict=True) if not self.ds else ():
            self.columns.append((name, start, s.numel))
            start += s.numel

    def __call__(self, page: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.state
        views = {state.name: page[state.offset : state.offset + state.numel].view(state.shape)}
        views.update({s.name: page[s.offset : s.offset + s.numel].view(s.shape) for s in self.ds})
        if self.columns:
            conv = page[: state.offset].view(self.rows, -1)
            views.update({name: conv[:, start : start + width].T for name, start, width in self.columns})
        return views


class Mamba2Mixer:
    """Mamba2 mixer on this rank's heads and B/C groups; the state lives in one SSM page."""

    def __init__(self, init: _Init, group: Mamba2, hidden: int, rank: int, tp: int) -> None:
        heads, head_dim, n_groups, d_state, kernel = (
            group.num_heads, group.head_dim, group.n_groups, group.d_state, group.conv_kernel,
        )
        d_inner = heads * head_dim
        state_part, group_part = group.state_part(), group.conv_parts()[1]
        h0, hn = state_part.first_unit(rank, tp), state_part.units_on_rank(tp)
        g0, gn = group_part.first_unit(rank, tp), group_part.units_on_rank(tp)
        x_rows, bc_rows = slice(h0 * head_dim, (h0 + hn) * head_dim), slice(g0 * d_state, (g0 + gn) * d_state)
        self.w_z = init.linear(d_inner, hidden)[x_rows]
        self.w_x = init.linear(d_inner, hidden)[x_rows]
        self.w_b = init.linear(n_groups * d_state, hidden)[bc_rows]
        self.w_c = init.linear(n_groups * d_state, hidden)[bc_rows]
        self.w_dt = init.linear(heads, hidden)[h0 : h0 + hn]
        self.conv_x = init.linear(d_inner, kernel)[x_rows]
        self.conv_b = init.linear(n_groups * d_state, kernel)[bc_rows]
        self.conv_c = init.linear(n_groups * d_state, kernel)[bc_rows]
        dt = init.uniform(heads, 0.001, 0.1)
        self.dt_bias = (dt + torch.log(-torch.expm1(-dt)))[h0 : h0 + hn]  # softplus^-1(dt)
        self.a = -init.uniform(heads, 1.0, 16.0)[h0 : h0 + hn]
        self.d = init.uniform(heads, 0.5, 1.5)[h0 : h0 + hn]
        self.norm = init.uniform(d_inner, 0.8, 1.2)[x_rows].view(hn, head_dim)
        self.w_out = init.linear(hidden, d_inner)[:, x_rows]
        heads_per_group = heads // n_groups
        self.head_group = torch.arange(h0, h0 + hn) // heads_per_group - g0
        self.views = StateViews(ssm_page_slices(group, tp), group.conv_layout)
        self.heads, self.head_dim, self.d_state = hn, head_dim, d_state

    def _conv(self, new: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, fresh: bool) -> torch.Tensor:
        """Causal depthwise conv over [old state | new tokens]; keeps the last K-1 inputs."""
        previous = torch.zeros_like(state) if fresh else state.clone()
        sequence = torch.cat([previous, new.T], dim=1)  # [channels, K-1+T]
        out = (sequence.unfold(1, weight.shape[1], 1) * weight[:, None, :]).sum(-1)
        state.copy_(sequence[:, -state.shape[1] :])
        return F.silu(out.T)

    def __call__(self, x: torch.Tensor, page: torch.Tensor, fresh: bool) -> torch.Tensor:
        num_new = x.shape[0]
        views = self.views(page)
        xs = self._conv(F.linear(x, self.w_x), self.conv_x, views["conv_x"], fresh)
        b = self._conv(F.linear(x, self.w_b), self.conv_b, views["conv_B"], fresh)
        c = self._conv(F.linear(x, self.w_c), self.conv_c, views["conv_C"], fresh)
        dt = F.softplus(F.linear(x, self.w_dt) + self.dt_bias)  # [T, heads]
        xh = xs.view(num_new, self.heads, self.head_dim)
        bh = b.view(num_new, -1, self.d_state)[:, self.head_group]  # [T, heads, d_state]
        ch = c.view(num_new, -1, self.d_state)[:, self.head_group]
        state = torch.zeros_like(views["ssm_state"]) if fresh else views["ssm_state"].clone()
        outputs = []
        for t in range(num_new):
            decay = torch.exp(dt[t] * self.a)[:, None, None]
            state = state * decay + (dt[t][:, None, None] * xh[t][:, :, None]) * bh[t][:, None, :]
            outputs.append((state * ch[t][:, None, :]).sum(-1))
        views["ssm_state"].copy_(state)
        y = torch.stack(outputs) + self.d[:, None] * xh
        y = rms_norm(y * F.silu(F.linear(x, self.w_z).view_as(y)), self.norm)
        return F.linear(y.reshape(num_new, -1), self.w_out)


class TinyHybridModel:
    """Layers alternate attention and Mamba2 mixers (pre-norm, residual); a `PagedModel`.

    With `tp_size > 1` this is rank `tp_rank`'s shard: kv heads (with their q heads),
    SSM heads and B/C groups are split as `ShardedPart.first_unit/units_on_rank` say,
    and `all_reduce` (an in-place sum over ranks) runs after every out projection.
    Embedding and LM head are replicated. Weights depend only on `seed`.
    """

    def __init__(
        self,
        spec: ModelSpec = TINY_HYBRID,
        *,
        hidden_size: int = 256,
        num_q_heads: int = 8,
        vocab_size: int = SMOLLM2_VOCAB,
        eos_token_ids: tuple[int, ...] = (SMOLLM2_EOS,),
        seed: int = 0,
        tp_rank: int = 0,
        tp_size: int = 1,
        all_reduce: AllReduce | None = None,
    ) -> None:
        if tp_size > spec.num_kv_heads or spec.num_kv_heads % tp_size:
            raise ValueError(
                f"tp_size={tp_size} must divide num_kv_heads={spec.num_kv_heads}; "
                "replicated kv heads are not supported by this model"
            )
        if tp_size > 1 and all_reduce is None:
            raise ValueError(f"tp_size={tp_size} needs an all_reduce callable to sum partial outputs")
        self.spec, self.vocab_size, self.eos_token_ids = spec, vocab_size, eos_token_ids
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._all_reduce = all_reduce
        init = _Init(seed)
        self.embedding = torch.randn(vocab_size, hidden_size, generator=init.generator)
        self.mixers: list[AttentionMixer | Mamba2Mixer] = []
        for group_index in spec.layer_groups:
            group = spec.groups[group_index]
            if isinstance(group, Mamba2):
                if group.state_dtype not in ("", spec.dtype):
                    raise ValueError(f"tiny hybrid keeps its SSM state in the model's {spec.dtype}, "
                                     f"not {group.state_dtype}")
                self.mixers.append(Mamba2Mixer(init, group, hidden_size, tp_rank, tp_size))
            elif isinstance(group, FullAttention):
                self.mixers.append(AttentionMixer(init, spec, hidden_size, num_q_heads, tp_rank, tp_size))
            else:
                raise ValueError(f"tiny hybrid supports full attention and mamba2 groups, got {group.kind!r}")
        self.norms = [init.uniform(hidden_size, 0.8, 1.2) for _ in self.mixers]
        self.final_norm = init.uniform(hidden_size, 0.8, 1.2)
        # Untied: a tied head would mostly echo the current token, hiding the context's effect.
        self.lm_head = init.linear(vocab_size, hidden_size)
        self._attention_layer = next(
            i for i, m in enumerate(self.mixers) if isinstance(m, AttentionMixer)
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        start_pos: int,
        block_tables: list[torch.Tensor],
        caches: list[torch.Tensor],
        *,
        block_size: int,
        last_token_only: bool = False,
        stream: LayerStream | None = None,
    ) -> torch.Tensor:
        """Logits `[T, vocab]` (`[1, vocab]` with `last_token_only`); SSM state is read from
        (zeros at start_pos 0) and written to its page."""
        on_layer = layer_callback(stream, block_tables)
        positions = torch.arange(start_pos, start_pos + input_ids.shape[0])
        ppl = physical_per_logical([caches[self._attention_layer]], block_size)
        x = self.embedding[input_ids]
        for layer, mixer in enumerate(self.mixers):
            table = block_tables[self.spec.layer_groups[layer]]
            h = rms_norm(x, self.norms[layer])
            if isinstance(mixer, AttentionMixer):
                out = mixer(h, positions, kernel_block_table(table, ppl), caches[layer])
            else:
                out = mixer(h, caches[layer][int(table[-1])], fresh=start_pos == 0)
            if self._all_reduce is not None:
                self._all_reduce(out)
            if on_layer is not None:
                on_layer(layer)
            x = x + out
        if last_token_only:
            x = x[-1:]
        return F.linear(rms_norm(x, self.final_norm), self.lm_head)
