"""`kvlink plan`: show what moves between a P and a D configuration of a preset model."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable
from typing import Any

from kvlink.cli.ranges import ranged
from kvlink.layout.limits import (
    BLOCK_SIZE,
    MAX_BLOCK_SIZE,
    MAX_TOKENS,
    MAX_TP,
    SEED,
    TOKENS,
    TP,
    int_range,
)
from kvlink.layout.presets import PRESETS, preset
from kvlink.plan.compat import IncompatibleLayout
from kvlink.plan.report import EngineConfig, plan_report
from kvlink.plan.report_json import plan_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    block = ranged(BLOCK_SIZE)
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS), help="model KV geometry")
    parser.add_argument("--p-tp", type=ranged(TP), required=True, help=f"prefill engine TP size (1..{MAX_TP})")
    parser.add_argument("--d-tp", type=ranged(TP), required=True, help=f"decode engine TP size (1..{MAX_TP})")
    parser.add_argument("--p-block-size", type=block, default=16, help=f"1..{MAX_BLOCK_SIZE} tokens")
    parser.add_argument("--d-block-size", type=block, default=16, help=f"1..{MAX_BLOCK_SIZE} tokens")
    parser.add_argument("--p-kernel-block-size", type=block, help="default: the P block size")
    parser.add_argument("--d-kernel-block-size", type=block, help="default: the D block size")
    parser.add_argument("--tokens", type=ranged(TOKENS), default=1000,
                        help=f"prompt length of the sample request (1..{MAX_TOKENS})")
    parser.add_argument("--d-computed-tokens", type=ranged(int_range(0, MAX_TOKENS - 1)), default=0,
                        help="D prefix-cache hit (a multiple of the D block size, below --tokens)")
    parser.add_argument("--scatter", type=ranged(SEED), metavar="SEED",
                        help="shuffle the sample block ids with SEED (default: consecutive ids)")
    parser.add_argument("--json", action="store_true",
                        help="every region and every transfer as JSON (schema: docs/plan-json.md)")


def check_args(args: argparse.Namespace) -> None:
    if args.d_computed_tokens >= args.tokens:
        raise ValueError(f"--d-computed-tokens {args.d_computed_tokens} must be below --tokens "
                         f"{args.tokens}: D always recomputes the last prompt token")


def _kernel(kernel_block_size: int | None, block_size: int) -> int:
    return block_size if kernel_block_size is None else kernel_block_size


def run(args: argparse.Namespace) -> int:
    p = EngineConfig(args.p_tp, args.p_block_size, _kernel(args.p_kernel_block_size, args.p_block_size))
    d = EngineConfig(args.d_tp, args.d_block_size, _kernel(args.d_kernel_block_size, args.d_block_size))
    model = preset(args.preset)
    request = (model, p, d, args.tokens, args.d_computed_tokens, args.scatter)
    try:
        # Either checks everything before the first character is written; --json then streams.
        pieces: Iterable[str] = plan_json(*request) if args.json else [render(plan_report(*request)), "\n"]
    except IncompatibleLayout as exc:
        print(f"kvlink plan: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"kvlink plan: impossible request: {exc}", file=sys.stderr)
        return 2
    try:
        sys.stdout.writelines(pieces)
        sys.stdout.flush()
    except BrokenPipeError:  # the reader left (`kvlink plan --json | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError


def _engine_lines(label: str, engine: dict[str, Any]) -> list[str]:
    regions = engine["workers"][0]["regions"]
    kinds: dict[str, int] = {}
    for region in regions:
        kinds[region["kind"]] = kinds.get(region["kind"], 0) + 1
    pages = ", ".join(f"{n} {kind} (page {_size(next(r['page_len'] for r in regions if r['kind'] == kind))})"
                      for kind, n in kinds.items())
    lines = [
        f"{label}: TP {engine['tp']}, block {engine['block_size']} tokens "
        f"(kernel {engine['kernel_block_size']}), {engine['num_blocks']} blocks",
        f"   regions per rank: {len(regions)} = {pages}",
        f"   KV bytes per token per rank: {_size(engine['kv_bytes_per_token_per_rank'])}",
    ]
    if engine["ssm_state_bytes_per_rank"]:
        lines.append(f"   SSM state per request per rank: {_size(engine['ssm_state_bytes_per_rank'])}")
    return lines


def render(report: dict[str, Any]) -> str:
    request = report["request"]
    lines = [f"model {report['model']} ({report['dtype']})"]
    lines += _engine_lines("P", report["p"]) + _engine_lines("D", report["d"])
    state = " plus SSM state" if report["p"]["ssm_state_bytes_per_rank"] and request["tokens_shipped"] else ""
    first, end = request["d_computed_tokens"], request["tokens_shipped"]
    if end > first:
        tokens = f"ships tokens [{first}, {end})"
    elif end == 0:
        tokens = "ships no tokens (D computes the only prompt token)"
    else:
        tokens = f"ships no tokens (D has [0, {end}) cached)"
    lines.append(
        f"request: {request['prompt_tokens']}-token prompt, {tokens}{state}; "
        f"token chunk {report['d_ranks'][0]['chunk_tokens']} tokens"
    )
    for rank in report["d_ranks"]:
        lines.append(
            f"D rank {rank['rank']}: reads P {rank['source_ranks']}, notifies P {rank['notify_ranks']}; "
            f"{rank['descriptors']} descriptors, {rank['merged_descriptors']} after merging, "
            f"{_size(rank['bytes'])}"
        )
    waits = ", ".join(f"P{r}: {n}" for r, n in enumerate(report["consumers_per_producer"]))
    lines.append(f"notifications each P rank waits for per request: {waits}")
    return "\n".join(lines)
