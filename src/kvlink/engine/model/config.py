"""Shape and numerics of a Llama-family decoder, as read from a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LlamaConfig:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    vocab_size: int
    max_position: int
    bos_token_id: int
    eos_token_id: int
    tie_word_embeddings: bool = True

    def check_tp_size(self, tp_size: int) -> None:
        """Raise unless `tp_size` divides the kv heads, the q heads and the MLP width."""
        sharded = {
            "num_kv_heads": self.num_kv_heads,
            "num_heads": self.num_heads,
            "intermediate_size": self.intermediate_size,
        }
        bad = {name: size for name, size in sharded.items() if tp_size < 1 or size % tp_size}
        if bad:
            valid = [d for d in range(1, self.num_kv_heads + 1) if self.num_kv_heads % d == 0]
            raise ValueError(
                f"tp_size={tp_size} does not divide {bad}; "
                f"use a tp_size that divides num_kv_heads={self.num_kv_heads}: {valid}"
            )
