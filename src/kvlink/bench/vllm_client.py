"""vLLM's own benchmark client (`vllm.benchmarks.serve`, random dataset, fixed seed) run
through the proxy for `kvlink bench vllm`, and the scalar figures of its result JSON."""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvlink.bench.vllm_config import VllmBenchConfig
from kvlink.procs.launcher import run_logged

# Client figures shown, as (result JSON key, label, higher is better).
CLIENT_FIGURES: tuple[tuple[str, str, bool], ...] = (
    ("mean_ttft_ms", "TTFT mean ms", False),
    ("p99_ttft_ms", "TTFT p99 ms", False),
    ("mean_tpot_ms", "TPOT mean ms", False),
    ("p99_tpot_ms", "TPOT p99 ms", False),
    ("mean_itl_ms", "ITL mean ms", False),
    ("p99_itl_ms", "ITL p99 ms", False),
    ("request_throughput", "req/s", True),
    ("output_throughput", "out tok/s", True),
)


def run_client(config: VllmBenchConfig, proxy_url: str, out_dir: Path, name: str,
               log_dir: Path) -> dict[str, Any]:
    """vLLM's benchmark client through the proxy; its result JSON (raises RuntimeError on failure)."""
    code = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
            "from vllm.benchmarks.serve import add_cli_args, main; p=P(); add_cli_args(p); "
            "main(p.parse_args(sys.argv[1:]))")
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-c", code, "--backend", "openai", "--base-url", proxy_url,
            "--endpoint", "/v1/completions", "--model", str(config.model_dir),
            "--tokenizer", str(config.model_dir), "--dataset-name", "random",
            "--random-input-len", str(config.input_len), "--random-output-len", str(config.output_len),
            "--num-prompts", str(config.num_prompts), "--max-concurrency", str(config.concurrency),
            "--seed", str(config.seed), "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out_dir),
            "--result-filename", f"{name}.json"]
    result_path = out_dir / f"{name}.json"
    with contextlib.suppress(FileNotFoundError):
        result_path.unlink()
    try:  # from the temp dir: vLLM must never start from inside a vllm source tree
        client = run_logged(f"client-{name}", argv, log_dir, config.client_timeout_s,
                            cwd=Path(tempfile.gettempdir()))
    except TimeoutError:
        raise RuntimeError(f"benchmark client timed out after {config.client_timeout_s:.0f} s") from None
    if client.proc.returncode != 0 or not result_path.exists():
        raise RuntimeError(f"benchmark client exited {client.proc.returncode}: {client.log_tail(6)}")
    data: dict[str, Any] = json.loads(result_path.read_text())
    return clean_client(data)


def clean_client(data: dict[str, Any]) -> dict[str, Any]:
    """The scalar figures of a client result; latency and throughput None when nothing completed.

    vLLM's client reports 0.0 ms latencies when every request failed, which would read as
    the best possible figure.
    """
    keep: dict[str, Any] = {k: v for k, v in data.items()
                            if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
    if data.get("completed") is not None and data.get("num_prompts") not in (None, data["completed"]):
        keep["client_note"] = f"{data['completed']} of {data['num_prompts']} requests completed"
    errors = [e for e in data.get("errors", []) if e]
    if errors:
        keep["client_errors"] = errors[:3]
    if data.get("completed", 1) == 0:
        for key, _, _ in CLIENT_FIGURES:
            keep[key] = None
    return keep
