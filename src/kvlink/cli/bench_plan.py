"""`kvlink bench plan`: time per-request planning (block transforms + descriptor ids) on one core."""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvlink.cli.argtypes import output_file
from kvlink.cli.ranges import ranged
from kvlink.layout.limits import COUNT, MAX_TOKENS, int_range
from kvlink.layout.presets import LLAMA3_8B
from kvlink.plan.descriptors import desc_ids_attention
from kvlink.plan.report import EngineConfig, fake_engine
from kvlink.plan.transfer_plan import build_transfer_plan

DEFAULT_TOKENS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
BLOCK_SIZE = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=output_file, metavar="FILE", help="also write the results to FILE")
    parser.add_argument("--tokens", type=ranged(int_range(2, MAX_TOKENS)), nargs="+",
                        default=list(DEFAULT_TOKENS), help=f"request lengths to time (2..{MAX_TOKENS})")
    parser.add_argument("--repeat", type=ranged(COUNT), default=50,
                        help="timed runs per size (median reported)")


def _median_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def measure(tokens_list: list[int], repeat: int) -> dict[str, Any]:
    """llama3-8b, TP 1 → 1, block 16: build the plan once, then time each request size."""
    num_blocks = max(tokens_list) // BLOCK_SIZE + 64
    config = EngineConfig(1, BLOCK_SIZE, BLOCK_SIZE)
    (p_worker,) = fake_engine(LLAMA3_8B, config, num_blocks, 0x10_0000_0000)
    (d_worker,) = fake_engine(LLAMA3_8B, config, num_blocks, 0x20_0000_0000)
    start = time.perf_counter()
    plan = build_transfer_plan(d_worker, {0: p_worker})
    build_ms = (time.perf_counter() - start) * 1e3
    rng = np.random.default_rng(0)
    rows = []
    for tokens in tokens_list:
        blocks = -(-tokens // BLOCK_SIZE)
        p_ids = [rng.permutation(num_blocks)[:blocks].tolist()]
        d_ids = [rng.permutation(num_blocks)[:blocks].tolist()]
        (spec,) = plan.request_ids(d_ids, p_ids, tokens - 1)
        descriptors = int(spec.local_idx.size)
        request_ms = _median_ms(functools.partial(plan.request_ids, d_ids, p_ids, tokens - 1), repeat)
        ids_array = np.asarray(d_ids[0], dtype=np.int64)
        ids_ms = _median_ms(functools.partial(desc_ids_attention, ids_array, len(d_worker.regions), num_blocks),
                            repeat)
        rows.append({
            "tokens": tokens, "descriptors_per_side": descriptors,
            "request_ids_ms": round(request_ms, 4),
            "desc_ids_ms": round(ids_ms, 4),
            "desc_ids_ms_per_10k": round(ids_ms * 1e4 / descriptors, 4),
        })
    return {
        "layout": "llama3-8b, TP 1->1, block 16 (kernel 16), bf16, 32 regions, random block ids",
        "plan_build_ms": round(build_ms, 2), "num_blocks": num_blocks,
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "python": platform.python_version(), "numpy": np.__version__, "machine": platform.machine(),
        "rows": rows,
    }


def run(args: argparse.Namespace) -> int:
    try:
        result = measure(args.tokens, args.repeat)
    except ValueError as exc:  # a plan over the memory bound, refused before it is built
        print(f"kvlink bench plan: {exc}", file=sys.stderr)
        return 2
    print(f"{result['layout']}; plan built once in {result['plan_build_ms']} ms")
    print(f"{'tokens':>8} {'descs/side':>11} {'request_ids ms':>15} {'desc ids ms':>12} {'ms/10k ids':>11}")
    for row in result["rows"]:
        print(f"{row['tokens']:>8} {row['descriptors_per_side']:>11} {row['request_ids_ms']:>15.4f} "
              f"{row['desc_ids_ms']:>12.4f} {row['desc_ids_ms_per_10k']:>11.4f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    return 0
