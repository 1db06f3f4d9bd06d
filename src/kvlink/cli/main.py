"""`kvlink` entry point: dispatches to one module per subcommand."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> module defining `add_arguments(parser)` and `run(args) -> int`.
# Modules are imported only when their command runs, so `kvlink plan` never loads torch.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("kvlink.cli.demo_cmd", "start P, D, the proxy and a colocated instance; compare answers"),
    "plan": ("kvlink.cli.plan_cmd", "show the transfer plan between a P and a D configuration"),
    "serve": ("kvlink.cli.serve_cmd", "run an OpenAI-compatible prefill, decode or colocated instance"),
    "proxy": ("kvlink.cli.proxy_cmd", "route requests to prefill then decode instances"),
}

# `kvlink bench <name>`: one module per benchmark.
BENCHES: dict[str, tuple[str, str]] = {
    "plan": ("kvlink.cli.bench_plan", "time per-request planning arrays"),
    "serve": ("kvlink.cli.bench_serve", "TTFT, inter-token latency and throughput: 1P1D vs colocated"),
    "transfer": ("kvlink.cli.bench_transfer", "P/D worker processes: connector pull/push vs raw NIXL vs memcpy"),
    "load": ("kvlink.cli.bench_load", "500 requests through the proxy, 10% cancelled: no leaks, TTFT, errors"),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlink", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module, _parser=p)
        importlib.import_module(module).add_arguments(p)
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in BENCHES.items():
        p = bench_sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module, _parser=p)
        importlib.import_module(module).add_arguments(p)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check a command line; exits 2 (argparse's usage error) on any bad value.

    A command module may define `check_args(args)`, raising ValueError for values that are
    each in range but wrong together (a prefix hit longer than the prompt, say).
    """
    args = _build_parser().parse_args(argv)
    check_args = getattr(importlib.import_module(args._module), "check_args", None)
    if check_args is not None:
        try:
            check_args(args)
        except ValueError as error:
            args._parser.error(str(error))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    code: int = importlib.import_module(args._module).run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
