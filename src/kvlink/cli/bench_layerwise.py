"""`kvlink bench layerwise`: TTFT of pull, push and layerwise across two hosts at limited rates."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvlink.cli.argtypes import env_pair, json_object, output_dir, output_file, png_file
from kvlink.cli.ranges import ranged
from kvlink.layout.limits import COUNT, NUM_BLOCKS

if TYPE_CHECKING:
    from kvlink.bench.layerwise import Result


def _tokens(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(",") if v)
    if not values or any(not 2 <= v <= 4096 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated prompt lengths in [2, 4096], got {text!r}")
    return values


def _rates(text: str) -> tuple[str | None, ...]:
    out: list[str | None] = []
    for value in text.split(","):
        value = value.strip().lower()
        if value == "none":
            out.append(None)
        elif (match := re.fullmatch(r"(\d+(?:\.\d+)?)[kmg]?bit", value)) and float(match.group(1)) > 0:
            out.append(value)
        else:
            raise argparse.ArgumentTypeError(f"rate {value!r}: expected a tc rate above 0 such as 1gbit or 500mbit, or none")
    return tuple(out)


ALL_MODES = ("pull", "push", "layerwise", "nixl")


def _modes(text: str) -> tuple[str, ...]:
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [v for v in values if v not in ALL_MODES]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"modes must be among {', '.join(ALL_MODES)}; got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=_tokens, default=(256, 512, 1024, 2048), help="prompt lengths, e.g. 256,2048")
    parser.add_argument("--rates", type=_rates, default=("1gbit", "10gbit", None),
                        help="tc rates of the P-D link, e.g. 1gbit,10gbit,none")
    parser.add_argument("--runs", type=ranged(COUNT), default=5, help="requests per (rate, length, mode)")
    parser.add_argument("--engine", choices=("kvlink", "vllm"), default="kvlink",
                        help="P and D as kvlink's servers, or as vLLM (CPU build) with kvlink's connector "
                             "and, for mode nixl, with vLLM's NixlConnector")
    parser.add_argument("--modes", type=_modes, default=None,
                        help="pull,push,layerwise (and, with --engine vllm, nixl); default: all of them")
    parser.add_argument("--nixl-extra", type=json_object, default={}, metavar="JSON",
                        help="with --engine vllm: NixlConnector's kv_connector_extra_config, "
                             "e.g. '{\"num_threads\": 8}'")
    parser.add_argument("--nixl-env", type=env_pair, action="append", default=[], metavar="NAME=VALUE",
                        help="with --engine vllm: environment for NixlConnector's servers (repeatable; "
                             "over the bench's own, UCX_TLS=tcp included)")
    parser.add_argument("--num-blocks", type=ranged(NUM_BLOCKS), default=320)
    parser.add_argument("--json", type=output_file, default=None, help="write the results here")
    parser.add_argument("--plot", type=png_file, default=None, help="write a PNG chart here")
    parser.add_argument("--log-dir", type=output_dir, default=None, help="server logs (default: temporary)")


def run(args: argparse.Namespace) -> int:
    from kvlink.bench.layerwise import LayerwiseConfig, plot, run_bench, table, targets, write_json
    from kvlink.bench.load_vllm_plot import machine

    longest = max(args.tokens)
    needed = -(-(longest + 64) // 16)
    if args.num_blocks < needed:
        print(f"kvlink bench layerwise: --num-blocks {args.num_blocks} cannot hold a {longest}-token "
              f"prompt in blocks of 16; use at least {needed}", file=sys.stderr)
        return 2
    modes = args.modes or (ALL_MODES if args.engine == "vllm" else ALL_MODES[:3])
    if "nixl" in modes and args.engine != "vllm":
        print("kvlink bench layerwise: mode nixl is vLLM's NixlConnector; use it with --engine vllm",
              file=sys.stderr)
        return 2
    if (args.nixl_extra or args.nixl_env) and "nixl" not in modes:
        print("kvlink bench layerwise: --nixl-extra and --nixl-env set NixlConnector's servers; "
              "they need --engine vllm and mode nixl", file=sys.stderr)
        return 2
    where = machine()
    progress = lambda line: print(line, flush=True)  # noqa: E731
    try:
        if args.engine == "vllm":
            result = _run_vllm(args, modes, where, progress)
        else:
            config = LayerwiseConfig(args.tokens, args.rates, args.runs, modes, args.num_blocks, args.log_dir)
            result = run_bench(config, where, progress=progress)
    except KeyboardInterrupt:
        print("interrupted; every process and namespace was removed")
        return 130
    except (RuntimeError, TimeoutError) as error:
        print(f"kvlink bench layerwise: {error}", file=sys.stderr)
        return 1
    print()
    print(f"{where}; {result.transport}")
    print(table(result))
    for line in targets(result):
        print(f"target: {line}")
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _run_vllm(args: argparse.Namespace, modes: tuple[str, ...], where: str, progress: Callable[[str], None]) -> Result:
    import tempfile

    from kvlink.bench.layerwise_vllm import VllmLayerwiseConfig, run_vllm_bench
    from kvlink.bench.vllm_config import default_model_dir

    progress("preparing SmolLM2-135M as an HF directory for vLLM")
    config = VllmLayerwiseConfig(default_model_dir(), args.tokens, args.rates, args.runs, modes, log_dir=args.log_dir,
                                 nixl_extra=dict(args.nixl_extra), nixl_env=dict(args.nixl_env))
    if config.nixl_extra or config.nixl_env:
        progress(f"NixlConnector: kv_connector_extra_config {json.dumps(config.nixl_extra, sort_keys=True)}, "
                 f"environment {json.dumps(config.nixl_env, sort_keys=True)}")
    if args.log_dir is not None:
        return run_vllm_bench(config, where, args.log_dir, progress)
    with tempfile.TemporaryDirectory(prefix="kvlink-bench-layerwise-") as logs:
        return run_vllm_bench(config, where, Path(logs), progress)
