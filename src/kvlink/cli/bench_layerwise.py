"""`kvlink bench layerwise`: TTFT of pull, push and layerwise across two hosts at limited rates."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvlink.cli.ranges import ranged
from kvlink.layout.limits import COUNT, NUM_BLOCKS


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
        elif value.rstrip("gmkbit").replace(".", "", 1).isdigit() and value.endswith("bit"):
            out.append(value)
        else:
            raise argparse.ArgumentTypeError(f"rate {value!r}: expected a tc rate such as 1gbit or 500mbit, or none")
    return tuple(out)


def _modes(text: str) -> tuple[str, ...]:
    from kvlink.bench.layerwise import MODES

    values = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [v for v in values if v not in MODES]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"modes must be among {', '.join(MODES)}; got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=_tokens, default=(256, 512, 1024, 2048), help="prompt lengths, e.g. 256,2048")
    parser.add_argument("--rates", type=_rates, default=("1gbit", "10gbit", None),
                        help="tc rates of the P-D link, e.g. 1gbit,10gbit,none")
    parser.add_argument("--runs", type=ranged(COUNT), default=5, help="requests per (rate, length, mode)")
    parser.add_argument("--modes", type=_modes, default=("pull", "push", "layerwise"))
    parser.add_argument("--num-blocks", type=ranged(NUM_BLOCKS), default=320)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG chart here")
    parser.add_argument("--log-dir", type=Path, default=None, help="server logs (default: temporary)")


def run(args: argparse.Namespace) -> int:
    from kvlink.bench.layerwise import LayerwiseConfig, plot, run_bench, table, targets, write_json
    from kvlink.bench.load_vllm_plot import machine

    longest = max(args.tokens)
    needed = -(-(longest + 64) // 16)
    if args.num_blocks < needed:
        print(f"kvlink bench layerwise: --num-blocks {args.num_blocks} cannot hold a {longest}-token "
              f"prompt in blocks of 16; use at least {needed}")
        return 2
    config = LayerwiseConfig(args.tokens, args.rates, args.runs, args.modes, args.num_blocks, args.log_dir)
    where = machine()
    try:
        result = run_bench(config, where, progress=lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        print("interrupted; every process and namespace was removed")
        return 130
    except (RuntimeError, TimeoutError) as error:
        print(f"kvlink bench layerwise: {error}")
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
