"""`kvlink bench transfer`: P and D worker processes (loopback, or two network namespaces);
connector vs raw NIXL vs memcpy."""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvlink.bench.transfer import (
    MAX_GIB,
    MEMORY_KINDS,
    BenchOptions,
    cuda_unavailable,
    plan_sizes,
    run_bench,
)
from kvlink.bench.transfer_report import plot, table, verdicts
from kvlink.cli.argtypes import output_file, png_file
from kvlink.cli.ranges import ranged, ranged_list
from kvlink.connector.config import ConnectorConfig
from kvlink.layout.limits import (
    BLOCK_SIZE,
    COUNT,
    MODEL_DIM,
    SECONDS_OR_ZERO,
    TOKENS,
    TP,
)
from kvlink.layout.presets import PRESETS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS),
                        help="model preset (attention or MLA)")
    parser.add_argument("--tokens", type=ranged_list(TOKENS), default=[512, 4096, 32768],
                        help="comma-separated tokens per request (default 512,4096,32768)")
    parser.add_argument("--p-tp", type=ranged(TP), default=1, help="prefill TP size")
    parser.add_argument("--d-tp", type=ranged(TP), default=1, help="decode TP size")
    parser.add_argument("--mode", choices=("pull", "push"), default="pull")
    parser.add_argument("--block-size", type=ranged(BLOCK_SIZE), default=16)
    parser.add_argument("--verify-kv", default=None, metavar="MODE[,MODE...]",  # BenchOptions checks it
                        help="KV integrity check of every request (off, sample, full; default "
                             f"{ConnectorConfig.verify_kv}, the connector's; off with --memory cuda, "
                             "which takes no other). Several, comma-separated (off,sample,full): one D "
                             "engine per mode, each with its own pool, timed in the same rounds; "
                             "each mode's cost is its time over the first mode's, per round")
    parser.add_argument("--memory", choices=MEMORY_KINDS, default="cpu",
                        help="where P's and D's KV live: cpu (host memory, NIXL DRAM; default) or cuda "
                             "(torch tensors on CUDA device 0, NIXL VRAM; needs a GPU)")
    parser.add_argument("--repeats", type=ranged(COUNT), default=9,
                        help="minimum rounds per size and layout; each round times the connector, raw "
                             "NIXL and NIXL over the connector's descriptors (medians of per-round ratios)")
    parser.add_argument("--min-seconds", type=ranged(SECONDS_OR_ZERO), default=1.0,
                        help="add rounds (up to 60) until the connector's timed transfers add up to "
                             "about this long per size and layout (small transfers are noisy)")
    parser.add_argument("--max-gib", type=ranged(MAX_GIB), default=2.0,
                        help="cap one side's KV pool; layers are cut to fit (default 2 GiB, at most 1024)")
    parser.add_argument("--layers", type=ranged(MODEL_DIM), default=None, help="use at most this many layers")
    for side, name in (("p", "P"), ("d", "D")):
        parser.add_argument(f"--{side}-netns", metavar="NS", default=None,
                            help=f"run {name}'s worker processes in this network namespace (needs root; "
                                 f"UCX then uses only the interface of --{side}-host there)")
        parser.add_argument(f"--{side}-host", metavar="ADDR", default="127.0.0.1",
                            help=f"address {name}'s side channel listens on (with --{side}-netns: "
                                 "its address on the P-D link)")
    parser.add_argument("--json", type=output_file, metavar="FILE", help="write the results as JSON")
    parser.add_argument("--plot", type=png_file, metavar="FILE", help="write a PNG chart")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    verify_kv = args.verify_kv or ("off" if args.memory == "cuda" else ConnectorConfig.verify_kv)
    try:
        options = BenchOptions(preset=args.preset, tokens=args.tokens, p_tp=args.p_tp, d_tp=args.d_tp,
                               mode=args.mode, block_size=args.block_size, verify_kv=verify_kv, repeats=args.repeats,
                               min_seconds=args.min_seconds, max_gib=args.max_gib, layers=args.layers,
                               p_netns=args.p_netns, d_netns=args.d_netns, p_host=args.p_host,
                               d_host=args.d_host, memory=args.memory)
        plan_sizes(options)  # refuses presets the benchmark cannot fill
    except ValueError as exc:
        print(f"kvlink bench transfer: error: {exc}", file=sys.stderr)
        return 2
    if options.memory == "cuda" and (why := cuda_unavailable()) is not None:
        print(f"kvlink bench transfer: error: {why}", file=sys.stderr)
        return 2
    try:
        result = run_bench(options)
    except KeyboardInterrupt:
        print("interrupted; every process was stopped", file=sys.stderr)
        return 130
    except ValueError as exc:  # a host or namespace the peers cannot use
        print(f"kvlink bench transfer: error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError, TimeoutError) as exc:  # a peer failed (its log tail is in the message)
        print(f"kvlink bench transfer: failed: {exc}", file=sys.stderr)
        return 1
    print()
    print(table(result))
    print()
    result["verdicts"] = verdicts(result)
    for line in result["verdicts"]:
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
        print(f"wrote {args.json}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0
