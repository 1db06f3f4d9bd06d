"""`kvlink` entry point: dispatches to one module per subcommand."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> module defining `add_arguments(parser)` and `run(args) -> int`.
# Only the module of the command being run is imported (for its options, then its run),
# and those modules keep heavy imports inside `run`, so `kvlink plan` never loads torch.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("kvlink.cli.demo_cmd", "start P, D, the proxy and a colocated instance; compare answers"),
    "plan": ("kvlink.cli.plan_cmd", "show the transfer plan between a P and a D configuration"),
    "serve": ("kvlink.cli.serve_cmd", "run an OpenAI-compatible prefill, decode or colocated instance"),
    "proxy": ("kvlink.cli.proxy_cmd", "route requests to prefill then decode instances"),
    "vllm-models": ("kvlink.cli.vllm_models_cmd", "build the HF model dirs served by vLLM in tests and benches"),
}

# `kvlink bench <name>`: one module per benchmark.
BENCHES: dict[str, tuple[str, str]] = {
    "plan": ("kvlink.cli.bench_plan", "time per-request planning arrays"),
    "digest": ("kvlink.cli.bench_digest", "hash throughput of candidate KV digests on KV-sized buffers"),
    "serve": ("kvlink.cli.bench_serve", "TTFT, inter-token latency and throughput: 1P1D vs colocated"),
    "transfer": ("kvlink.cli.bench_transfer", "P/D worker processes: connector pull/push vs raw NIXL vs memcpy"),
    "load": ("kvlink.cli.bench_load", "500 requests through a router (or two), 10%% cancelled: no leaks, TTFT, errors"),
    "layerwise": ("kvlink.cli.bench_layerwise", "TTFT of pull, push and layerwise across two hosts (netns, tc rates)"),
    "vllm": ("kvlink.cli.bench_vllm", "vLLM 1P1D: KvlinkConnector vs NixlConnector (latency, transfer, idle CPU, answers)"),
    "vllm-matrix": ("kvlink.cli.bench_vllm_matrix",
                    "vLLM P/D per support-matrix case (TP pairs, prefix hits, push, dtypes): exact, wrong, error, hang, crash"),
}


def _chosen(argv: Sequence[str]) -> str | None:
    """The first positional word: the (sub)command about to run, if any."""
    return next((word for word in argv if not word.startswith("-")), None)


def _add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser],
                  commands: dict[str, tuple[str, str]], chosen: str | None) -> None:
    """One subparser per command; only the chosen one imports its module to add its options."""
    for name, (module, help_text) in commands.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module, _parser=p)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)


def _build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlink", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    command = _chosen(argv)
    _add_commands(sub, COMMANDS, command)
    bench = sub.add_parser("bench", help="benchmarks")
    rest = argv[list(argv).index("bench") + 1:] if command == "bench" else []
    _add_commands(bench.add_subparsers(dest="bench", required=True), BENCHES, _chosen(rest))
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check a command line; exits 2 (argparse's usage error) on any bad value.

    A command module may define `check_args(args)`, raising ValueError for values that are
    each in range but wrong together (a prefix hit longer than the prompt, say).
    """
    words = sys.argv[1:] if argv is None else list(argv)
    args = _build_parser(words).parse_args(words)
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
