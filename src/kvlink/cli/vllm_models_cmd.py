"""`kvlink vllm-models`: build (once) the HF model dirs the vLLM tests and benchmarks serve."""

from __future__ import annotations

import argparse

from kvlink.cli.argtypes import output_dir

MODELS = ("smollm2", "tiny-llama-tp", "tiny-granite-hybrid", "tiny-llama-head80", "tiny-gemma3-swa",
          "tiny-mistral-swa", "tiny-deepseek-mla")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=output_dir, default=None,
                        help="cache root (default: $KVLINK_CACHE or ~/.cache/kvlink/models)")
    parser.add_argument("--model", choices=MODELS, action="append",
                        help="build only this one (repeatable; default: all)")


def run(args: argparse.Namespace) -> int:
    from kvlink.integrations.vllm.models import BUILDERS

    for name in args.model or MODELS:
        print(f"{name}: {BUILDERS[name](args.out)}")
    return 0
