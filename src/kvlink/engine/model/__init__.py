"""Reference models: a Llama-family decoder read from GGUF, over kvlink's paged KV layout."""

from kvlink.engine.model.config import LlamaConfig
from kvlink.engine.model.gguf_loader import (
    load_config,
    load_vocab,
    load_weights,
    smollm2_gguf_path,
)
from kvlink.engine.model.llama import LlamaModel
from kvlink.engine.model.paged_kv import allocate_kv_caches

__all__ = [
    "LlamaConfig",
    "LlamaModel",
    "allocate_kv_caches",
    "load_config",
    "load_vocab",
    "load_weights",
    "smollm2_gguf_path",
]
