"""Builds what `kvlink serve` runs: the model, its tokenizer, and the engine over them.

`build_engine(args)` takes the parsed `kvlink serve` arguments. Role `both` is a
plain colocated engine. Roles `prefill` and `decode` need a connector, attached at
the one marked place below.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Progress = Callable[[str], None]
MODEL_NAMES = ("smollm2-135m", "tiny-hybrid")


@dataclass
class ServedEngine:
    """Everything the HTTP layer needs from the engine side."""

    engine: Any  # kvlink.engine.engine.LLMEngine
    tokenizer: Any  # kvlink.engine.tokenizer.Tokenizer
    model_name: str
    max_model_len: int
    connector_metrics: Callable[[], str] | None = None  # Prometheus text of the connector
    close: Callable[[], None] | None = None  # releases connector resources (agent, sockets)


def load_model(name: str, tp_rank: int, tp_size: int, progress: Progress) -> tuple[Any, int]:
    """The `PagedModel` named `name` and the longest sequence it supports."""
    from kvlink.engine.model import LlamaModel, load_config, load_weights, smollm2_gguf_path
    from kvlink.engine.model.base import LlamaPagedModel
    from kvlink.engine.model.tiny_hybrid import TinyHybridModel

    if name == "smollm2-135m":
        path = smollm2_gguf_path()
        progress(f"reading SmolLM2-135M weights from {path}")
        config = load_config(path)
        model = LlamaModel(config, load_weights(path), tp_rank=tp_rank, tp_size=tp_size)
        return LlamaPagedModel(model), config.max_position
    if name == "tiny-hybrid":
        progress("building tiny-hybrid (attention + Mamba2, seeded random weights)")
        return TinyHybridModel(tp_rank=tp_rank, tp_size=tp_size), 1 << 30
    raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODEL_NAMES)}")


def build_engine(args: argparse.Namespace, progress: Progress = print) -> ServedEngine:
    """Model + tokenizer + engine for `args.role`; prints progress while the model loads."""
    from kvlink.engine.engine import LLMEngine
    from kvlink.engine.model import smollm2_gguf_path
    from kvlink.engine.tokenizer import Tokenizer

    started = time.monotonic()
    if args.tp != 1:
        raise ValueError(
            f"--tp {args.tp}: this build serves one worker rank per process; use --tp 1"
        )
    model, model_max_len = load_model(args.model, 0, args.tp, progress)
    progress("loading the tokenizer")
    tokenizer = Tokenizer.from_gguf(smollm2_gguf_path())
    kernel_block_size = args.kernel_block_size or args.block_size
    connector_scheduler = connector_worker = None
    connector_metrics: Callable[[], str] | None = None
    close: Callable[[], None] | None = None
    if args.role != "both":
        # --- connector attachment point -------------------------------------------------
        # Roles prefill/decode build the connector here from args (engine_id, kv_port,
        # transfer_mode, lease_s, load_failure_policy) and set connector_scheduler,
        # connector_worker, connector_metrics (PrometheusExporter.render) and close.
        raise NotImplementedError(
            f"--role {args.role} needs the NIXL connector, which this build does not attach "
            "yet; run with --role both"
        )
    progress(f"allocating {args.num_blocks} KV blocks of {args.block_size} tokens")
    engine = LLMEngine(
        model, args.num_blocks, args.block_size, kernel_block_size,
        connector_scheduler, connector_worker, args.load_failure_policy,
    )
    max_model_len = min(model_max_len, args.num_blocks * args.block_size)
    if args.max_model_len:
        max_model_len = min(max_model_len, args.max_model_len)
    progress(f"model {args.model} ready in {time.monotonic() - started:.1f}s "
             f"(max_model_len={max_model_len})")
    return ServedEngine(engine, tokenizer, args.model, max_model_len, connector_metrics, close)
