"""`kvlink bench serve`: TTFT, inter-token latency and throughput, 1P1D through the proxy vs colocated."""

from __future__ import annotations

import argparse
import sys

from kvlink.cli.argtypes import output_dir, output_file, png_file
from kvlink.cli.ranges import ranged
from kvlink.engine.models import MODEL_NAMES
from kvlink.layout.limits import CONCURRENCY, COUNT, MAX_TOKENS, NUM_BLOCKS, TOKENS, int_range


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=MODEL_NAMES, default="smollm2-135m")
    parser.add_argument("--prompt-len", type=ranged(int_range(2, MAX_TOKENS)), default=256,
                        help="prompt tokens per request")
    parser.add_argument("--requests", type=ranged(COUNT), default=12, help="measured requests per setup")
    parser.add_argument("--concurrency", type=ranged(CONCURRENCY), default=2,
                        help="requests in flight at once")
    parser.add_argument("--max-tokens", type=ranged(TOKENS), default=16, help="tokens to generate per request")
    parser.add_argument("--num-blocks", type=ranged(NUM_BLOCKS), default=128)
    parser.add_argument("--no-pin", action="store_true",
                        help="do not pin processes to cores (default: P core 0, D core 1, "
                             "colocated both, on machines with at least 2 cores)")
    parser.add_argument("--no-progress-thread", action="store_true",
                        help="start P and D without NIXL's progress thread (kvlink serve runs it by default); "
                             "then D's READs wait while P runs a forward pass")
    parser.add_argument("--json", type=output_file, default=None, help="write the results here")
    parser.add_argument("--plot", type=png_file, default=None, help="write a PNG chart here")
    parser.add_argument("--log-dir", type=output_dir, default=None, help="server logs (default: temporary)")


def run(args: argparse.Namespace) -> int:
    from kvlink.bench.placement import Placement
    from kvlink.bench.serve_bench import BenchConfig, plot, run_bench, table, write_json

    placement = Placement() if args.no_pin else Placement.pinned()
    config = BenchConfig(args.model, args.prompt_len, args.requests, args.concurrency,
                         args.max_tokens, args.num_blocks, placement=placement, log_dir=args.log_dir,
                         progress_thread=not args.no_progress_thread)
    try:
        report = run_bench(config, progress=lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        print("interrupted; every process was stopped")
        return 130
    except (RuntimeError, TimeoutError) as error:
        print(f"kvlink bench serve: {error}", file=sys.stderr)
        return 1
    print()
    print(f"CPU placement: {report['placement']}; NIXL progress thread "
          f"{'on' if report['progress_thread'] else 'off'}")
    print(table(report))
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0
