"""Serving benchmark: the same requests through 1P1D (proxy) and through one colocated instance.

The two setups run one after the other, each alone on the machine, with a stated
CPU placement (`Placement`). Every request has its own random prompt of exactly
`prompt_len` tokens (no prefix-cache hits) and asks for `max_tokens` greedy tokens;
an answer may stop early at EOS, so throughput counts the tokens actually produced.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvlink.bench.cluster import ClusterSpec, running_cluster
from kvlink.bench.placement import Placement
from kvlink.bench.serve_client import Answer, stream_completion
from kvlink.layout.limits import (
    CONCURRENCY,
    COUNT,
    MAX_TOKENS,
    NUM_BLOCKS,
    SEED,
    TOKENS,
    bounded,
    check_fields,
    int_range,
)
from kvlink.procs.launcher import Progress


@dataclass(frozen=True)
class BenchConfig:
    model: str = "smollm2-135m"
    prompt_len: int = bounded(int_range(2, MAX_TOKENS), 256)
    requests: int = bounded(COUNT, 12)
    concurrency: int = bounded(CONCURRENCY, 2)
    max_tokens: int = bounded(TOKENS, 16)
    num_blocks: int = bounded(NUM_BLOCKS, 128)
    seed: int = bounded(SEED, 0)
    placement: Placement = field(default_factory=Placement.pinned)
    progress_thread: bool = True
    log_dir: Path | None = None

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass
class SetupResult:
    setup: str
    requests: int
    wall_s: float
    output_tokens: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float | None  # None: no answer had two tokens (no gap between tokens)
    itl_p99_ms: float | None
    output_tokens_per_s: float
    requests_per_s: float
    # P/D only: shares of the client's TTFT (summed over requests), KV per request
    kv_share_of_ttft: float | None = None
    prefill_share_of_ttft: float | None = None
    kv_bytes_per_request: float | None = None
    kv_transfer_p50_ms: float | None = None
    kv_transfer_p99_ms: float | None = None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def make_prompts(config: BenchConfig, vocab_size: int = 49152) -> list[list[int]]:
    """One random token-id prompt per request (plus one for warm-up), seeded."""
    rng = random.Random(config.seed)
    low = 100  # past the special tokens
    return [[rng.randrange(low, vocab_size) for _ in range(config.prompt_len)]
            for _ in range(config.requests + 1)]


def summarize(setup: str, answers: list[Answer], wall_s: float) -> SetupResult:
    ttfts = [a.ttft_s * 1e3 for a in answers]
    gaps = [g * 1e3 for a in answers for g in a.inter_token_s]
    tokens = sum(a.completion_tokens for a in answers)
    result = SetupResult(
        setup, len(answers), wall_s, tokens,
        percentile(ttfts, 50), percentile(ttfts, 99),
        percentile(gaps, 50) if gaps else None, percentile(gaps, 99) if gaps else None,
        tokens / wall_s if wall_s else 0.0, len(answers) / wall_s if wall_s else 0.0)
    moved = [a for a in answers if a.kv_bytes is not None and a.ttft_s > 0]
    if moved:
        # Shares of the summed TTFT: one slow request weighs by its time, not as one ratio in N.
        total_ttft = sum(a.ttft_s for a in moved)
        result.kv_share_of_ttft = sum(a.kv_transfer_s or 0 for a in moved) / total_ttft
        result.prefill_share_of_ttft = sum(a.prefill_s or 0 for a in moved) / total_ttft
        result.kv_bytes_per_request = statistics.fmean(float(a.kv_bytes or 0) for a in moved)
        moves = [(a.kv_transfer_s or 0) * 1e3 for a in moved]
        result.kv_transfer_p50_ms = percentile(moves, 50)
        result.kv_transfer_p99_ms = percentile(moves, 99)
    return result


def drive(url: str, prompts: list[list[int]], config: BenchConfig, label: str,
          progress: Progress) -> tuple[list[Answer], float]:
    """Send `prompts` with `config.concurrency` clients; returns the answers and the wall time."""
    done = 0
    lock = threading.Lock()
    last_report = [time.monotonic()]

    def one(prompt: list[int]) -> Answer:
        nonlocal done
        with httpx.Client(timeout=httpx.Timeout(300.0, connect=5.0)) as client:
            answer = stream_completion(client, url, prompt, config.max_tokens)
        with lock:
            done += 1
            now = time.monotonic()
            if now - last_report[0] >= 5.0 or done == len(prompts):
                last_report[0] = now
                progress(f"  {label}: {done}/{len(prompts)} requests done")
        return answer

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=config.concurrency) as pool:
        answers = list(pool.map(one, prompts))
    return answers, time.monotonic() - started


def run_setup(setup: str, config: BenchConfig, prompts: list[list[int]],
              progress: Progress) -> SetupResult:
    pd = setup == "1P1D"
    spec = ClusterSpec(model=config.model, num_blocks=config.num_blocks, pd=pd, colocated=not pd,
                       placement=config.placement, progress_thread=config.progress_thread)
    log_dir = config.log_dir / setup if config.log_dir else None
    with running_cluster(spec, log_dir, progress) as cluster:
        service = cluster.proxy if pd else cluster.colocated
        assert service is not None
        progress(f"{setup}: warm-up request")
        with httpx.Client(timeout=httpx.Timeout(300.0, connect=5.0)) as client:
            stream_completion(client, service.url, prompts[0], config.max_tokens)
        progress(f"{setup}: {config.requests} requests of {config.prompt_len} prompt tokens, "
                 f"concurrency {config.concurrency}")
        answers, wall_s = drive(service.url, prompts[1:], config, setup, progress)
    return summarize(setup, answers, wall_s)


def run_bench(config: BenchConfig, progress: Progress = print) -> dict[str, Any]:
    prompts = make_prompts(config)
    progress(f"CPU placement: {config.placement.describe()}; setups run one after the other; "
             f"NIXL progress thread {'on' if config.progress_thread else 'off'}")
    results = [run_setup(setup, config, prompts, progress) for setup in ("1P1D", "colocated")]
    skip = ("log_dir", "placement", "progress_thread")
    return {"config": {k: v for k, v in asdict(config).items() if k not in skip},
            "placement": config.placement.describe(), "progress_thread": config.progress_thread,
            "results": [asdict(r) for r in results]}


def table(report: dict[str, Any]) -> str:
    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    header = ("| setup | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | out tok/s | req/s "
              "| KV share of TTFT | P share of TTFT | KV MiB/req | KV move p50 / p99 ms |")
    lines = [header, "|---|" + "---:|" * 10]
    for r in report["results"]:
        kv_mib = None if r["kv_bytes_per_request"] is None else r["kv_bytes_per_request"] / 2**20
        kv_share = None if r["kv_share_of_ttft"] is None else 100 * r["kv_share_of_ttft"]
        p_share = None if r["prefill_share_of_ttft"] is None else 100 * r["prefill_share_of_ttft"]
        lines.append(
            f"| {r['setup']} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {_ms(r['itl_p50_ms'])} "
            f"| {_ms(r['itl_p99_ms'])} | {r['output_tokens_per_s']:.1f} | {r['requests_per_s']:.2f} "
            f"| {fmt(kv_share, '.1f')}% | {fmt(p_share, '.1f')}% | {fmt(kv_mib, '.2f')} "
            f"| {fmt(r['kv_transfer_p50_ms'], '.1f')} / {fmt(r['kv_transfer_p99_ms'], '.1f')} |")
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=2) + "\n")


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    names = [r["setup"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    width = 0.38
    xs = range(len(names))
    for ax, (metric, unit) in zip(axes[:2], (("ttft", "TTFT"), ("itl", "inter-token latency")),
                                  strict=True):
        ax.bar([x - width / 2 for x in xs], [r[f"{metric}_p50_ms"] or 0.0 for r in results], width, label="p50")
        ax.bar([x + width / 2 for x in xs], [r[f"{metric}_p99_ms"] or 0.0 for r in results], width, label="p99")
        ax.set_xticks(list(xs), names)
        ax.set_ylabel("ms")
        ax.set_title(unit)
        ax.legend()
    axes[2].bar(list(xs), [r["output_tokens_per_s"] for r in results], color="tab:green")
    axes[2].set_xticks(list(xs), names)
    axes[2].set_title("output tokens/s")
    cfg = report["config"]
    fig.suptitle(f"{cfg['model']}: {cfg['requests']} requests × {cfg['prompt_len']} prompt tokens, "
                 f"{cfg['max_tokens']} out, concurrency {cfg['concurrency']}")
    fig.text(0.5, 0.005, report["placement"], ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
