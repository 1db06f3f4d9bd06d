"""Session fixtures for engine tests: the SmolLM2 GGUF, loaded once, and its transformers reference."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from kvlink.engine.model import LlamaConfig, load_config, load_weights, smollm2_gguf_path
from kvlink.engine.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_config(smollm2_path: Path) -> LlamaConfig:
    return load_config(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_weights(smollm2_path: Path) -> dict[str, torch.Tensor]:
    return load_weights(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path)


def _offline_transformers() -> Any:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    return pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_path: Path) -> Any:
    transformers = _offline_transformers()
    return transformers.AutoTokenizer.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name
    )


@pytest.fixture(scope="session")
def hf_model(smollm2_path: Path) -> Any:
    """Transformers' own GGUF loading of the same file: the numerical reference."""
    transformers = _offline_transformers()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    )
    return model.eval()
