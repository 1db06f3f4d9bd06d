"""`kvlink bench load`: many requests through a router against a local NP MD; nothing may leak.

Starts `--prefills` P and `--decodes` D instances and a router (`--router`: kvlink's proxy,
vllm-router, or `both`, each pointing at the same instances; every process in its own
process group, stopped by PID), sends `--requests` streaming completions with mixed prompt
lengths and short outputs through each router in turn, of which `--cancel-fraction` are
abandoned by the client mid-flight, with bounded concurrency and a total time limit. After
each router's run it checks that no instance holds blocks, leases, loads or open transfers,
probes whether a client's disconnect reaches D, and reports throughput, TTFT p50/p99,
errors (only cancels are allowed) and aborts per side, side by side.
`--soak-minutes M` sends the same kind of stream at a low rate with idle gaps for M
minutes and reports how the resident memory of each process grows per 1000 requests and
per hour over the last 30 minutes; `--memory-json`/`--memory-plot` keep the curve.
`--engine vllm` runs the same kind of load against 2 vLLM P + 2 vLLM D servers with
kvlink's connector behind vllm-router, kills one P half way and starts it again, and checks
every answer against vLLM colocated (`kvlink.bench.load_vllm_run`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvlink.bench.cluster import INSTANCES
from kvlink.bench.load_routers import ROUTER_CHOICES
from kvlink.cli.argtypes import output_dir, output_file, png_file
from kvlink.cli.ranges import ranged
from kvlink.layout.limits import (
    CONCURRENCY,
    COUNT,
    FRACTION,
    MAX_SECONDS,
    NUM_BLOCKS,
    SECONDS,
    SECONDS_OR_ZERO,
    SEED,
    THREADS,
    TOKENS,
    float_range,
)
from kvlink.serve.factory import MODEL_NAMES

ENGINES = ("kvlink", "vllm")
# Per engine: requests, concurrency (vLLM's: 4 servers on 2 cores).
DEFAULTS = {"kvlink": (500, 8), "vllm": (300, 6)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=ENGINES, default="kvlink",
                        help="kvlink: `kvlink serve` instances; vllm: 2 vLLM P + 2 vLLM D with kvlink's "
                             "connector behind vllm-router, a P killed half way, answers checked "
                             "against vLLM colocated")
    parser.add_argument("--model", choices=MODEL_NAMES, default="smollm2-135m", help="kvlink engine's model")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="vllm engine: HF model dir (default: SmolLM2-135M from `kvlink vllm-models`)")
    parser.add_argument("--no-kill", action="store_true", help="vllm engine: no P killed")
    parser.add_argument("--verify-kv", choices=("off", "sample", "full"), default=None,
                        help="vllm engine: the connector's KV integrity checks (default: its own, sample)")
    parser.add_argument("--router", choices=ROUTER_CHOICES, default=None,
                        help="kvlink's proxy, vllm-router, or both in turn on the same instances "
                             "(default kvlink; the vllm engine runs behind vllm-router)")
    parser.add_argument("--prefills", type=ranged(INSTANCES), default=1, help="prefill instances")
    parser.add_argument("--decodes", type=ranged(INSTANCES), default=1, help="decode instances")
    parser.add_argument("--requests", type=ranged(COUNT), default=None, help="default 500 (vllm engine: 300)")
    parser.add_argument("--concurrency", type=ranged(CONCURRENCY), default=None, help="default 8 (vllm engine: 6)")
    parser.add_argument("--cancel-fraction", type=ranged(FRACTION), default=0.1)
    parser.add_argument("--max-prompt-words", type=ranged(TOKENS), default=300)
    parser.add_argument("--time-limit-s", type=ranged(SECONDS), default=1200.0,
                        help="stop launching requests after this long")
    parser.add_argument("--num-blocks", type=ranged(NUM_BLOCKS), default=256)
    parser.add_argument("--seed", type=ranged(SEED), default=0)
    parser.add_argument("--threads", type=ranged(THREADS), default=1, help="torch threads per instance")
    parser.add_argument("--soak-minutes", type=ranged(float_range(1 / 60, MAX_SECONDS / 60)), default=None,
                        help="soak mode: a low-rate stream with idle gaps for this many minutes")
    parser.add_argument("--soak-rate", type=ranged(float_range(1e-3, 1e4)), default=2.0,
                        help="requests per second while soaking")
    parser.add_argument("--soak-batch", type=ranged(COUNT), default=100, help="requests between idle gaps")
    parser.add_argument("--soak-gap-s", type=ranged(SECONDS_OR_ZERO), default=5.0,
                        help="idle gap between batches")
    parser.add_argument("--memory-interval-s", type=ranged(SECONDS), default=None,
                        help="soak mode and vllm engine: seconds between memory samples of every "
                             "process (default 5; vllm engine 2)")
    parser.add_argument("--memory-json", type=output_file, default=None,
                        help="soak mode and vllm engine: write the memory samples (RSS, glibc heap) here")
    parser.add_argument("--memory-plot", type=png_file, default=None,
                        help="soak mode and vllm engine: draw the memory curve to this PNG")
    parser.add_argument("--log-dir", type=output_dir, default=None)
    parser.add_argument("--json", type=output_file, default=None, help="write the summary here")


def check_args(args: argparse.Namespace) -> None:
    """Options each in range but wrong together; fills the per-engine defaults."""
    if args.engine == "vllm":
        if args.router not in (None, "vllm-router"):
            raise ValueError("--engine vllm runs behind vllm-router: leave --router out or give vllm-router")
        if args.soak_minutes:
            raise ValueError("--soak-minutes soaks `kvlink serve` instances: leave it out with --engine vllm")
        args.router = "vllm-router"
    elif args.model_dir is not None or args.no_kill or args.verify_kv is not None:
        raise ValueError("--model-dir, --no-kill and --verify-kv are for --engine vllm")
    requests, concurrency = DEFAULTS[args.engine]
    args.router = args.router or "kvlink"
    args.requests = args.requests or requests
    args.concurrency = args.concurrency or concurrency
    args.memory_interval_s = args.memory_interval_s or (2.0 if args.engine == "vllm" else 5.0)
    if args.engine != "vllm" and not args.soak_minutes and (args.memory_json or args.memory_plot):
        raise ValueError("--memory-json and --memory-plot keep the memory series of a soak (--soak-minutes) "
                         "or of --engine vllm; this run records none")
    if args.soak_minutes and args.router == "both":
        raise ValueError("--router both compares routers under load; --soak-minutes soaks through one: "
                         "give --router kvlink or --router vllm-router")


def spec_for(args: argparse.Namespace) -> Any:
    """The deployment of this run: the first router of `--router` is the cluster's own."""
    from kvlink.bench.cluster import ClusterSpec
    from kvlink.bench.load_routers import routers_to_run
    from kvlink.bench.placement import Placement

    return ClusterSpec(model=args.model, n_prefill=args.prefills, n_decode=args.decodes,
                       router=routers_to_run(args.router)[0], num_blocks=args.num_blocks, lease_s=30.0,
                       request_timeout_s=120.0, load_failure_policy="recompute",
                       placement=Placement(threads_per_rank=args.threads))


def run(args: argparse.Namespace) -> int:
    from kvlink.bench.cluster import Cluster

    if args.engine == "vllm":
        return _run_vllm(args)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvlink-bench-load-"))
    cluster = Cluster(spec_for(args), log_dir)
    print(f"kvlink bench load: model {args.model}, logs in {log_dir}")
    started = time.monotonic()
    try:
        try:
            cluster.start(timeout_s=300)
            print(f"{args.prefills}P{args.decodes}D + {cluster.spec.router} up in {time.monotonic() - started:.1f}s")
            summary = _soak(cluster, args) if args.soak_minutes else _load(cluster, args)
        finally:
            cluster.stop()
    except KeyboardInterrupt:
        print("interrupted; every process was stopped", file=sys.stderr)
        return 130
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if summary.get("passed") else 1


def _load(cluster: Any, args: argparse.Namespace) -> dict[str, Any]:
    from kvlink.bench.load_routers import routers_to_run, table

    results: dict[str, dict[str, Any]] = {}
    for k, router in enumerate(routers_to_run(args.router)):
        url = cluster.proxy.url if k == 0 else cluster.add_router(router).url
        # Seed + k: each router gets fresh prompts, so none rides on the other's prefix cache.
        results[router] = _load_through(cluster, router, url, args, args.seed + k)
    summary: dict[str, Any] = {"mode": "load", "model": args.model, "prefills": args.prefills,
                               "decodes": args.decodes, "concurrency": args.concurrency,
                               "routers": results, "passed": all(r["passed"] for r in results.values())}
    print(table(results))
    _print({k: v for k, v in summary.items() if k != "routers"})
    return summary


def _load_through(cluster: Any, router: str, url: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    from kvlink.bench.load import plan_requests, run_load
    from kvlink.bench.load_routers import OUTCOMES, delta, disconnect_probe, outcome_counts

    planned = plan_requests(args.requests, seed, args.cancel_fraction, args.max_prompt_words)
    cancels = sum(1 for p in planned if p.cancel_after_s is not None)
    print(f"{router}: sending {len(planned)} requests ({cancels} to be cancelled), concurrency {args.concurrency}")
    members = [m for m in cluster.members if m.role in ("prefill", "decode")]
    before = {m.name: outcome_counts([m.url]) for m in members}
    result = asyncio.run(run_load(url, planned, args.concurrency, args.time_limit_s))
    summary: dict[str, Any] = {**result.summary(), "timed_out": result.timed_out}
    summary.update(_leak_check(cluster))
    seen = {m.name: delta(outcome_counts([m.url]), before[m.name]) for m in members}
    for side in ("prefill", "decode"):
        for kind in OUTCOMES:
            count = sum(seen[m.name][kind] for m in members if m.role == side)
            summary[f"{side}_outcome_{kind}"] = count
    summary["requests_per_instance"] = {name: sum(counts.values()) for name, counts in seen.items()}
    summary.update(disconnect_probe(url, [m.url for m in cluster.roles("decode")]))
    summary["leaks_after_probe"] = _leak_check(cluster)["leaks"]  # nor may the probe leave anything
    errors = [o for o in result.outcomes if o.kind == "error"]
    for outcome in errors[:5]:
        print(f"  error on request {outcome.index}: {outcome.error}")
    summary["passed"] = (not errors and not summary["leaks"] and not summary["leaks_after_probe"]
                         and not result.timed_out)
    _print(summary)
    return summary


def _leak_check(cluster: Any) -> dict[str, Any]:
    from kvlink.bench.instance_state import leaks, wait_clean

    urls = {m.name: m.url for m in cluster.members if m.role in ("prefill", "decode")}
    try:
        took = wait_clean(list(urls.values()), cluster.spec.num_blocks, timeout_s=60)
        found: dict[str, list[str]] = {}
    except AssertionError:
        took = {}
        found = {name: leaks(cluster.state(name), cluster.spec.num_blocks) for name in urls}
    out: dict[str, Any] = {"leaks": {k: v for k, v in found.items() if v}}
    for name in urls:
        connector = cluster.state(name)["engine"].get("connector", {})
        for counter in ("leases", "loads_in_flight", "open_transfers"):
            out[f"{name}_{counter}"] = connector.get(counter, 0)
        out[f"{name}_clean_after_s"] = took.get(urls[name], math.nan)
    return out


def _soak(cluster: Any, args: argparse.Namespace) -> dict[str, Any]:
    from kvlink.bench import memory_series
    from kvlink.bench.load import plan_requests, run_load
    from kvlink.serve.memory import rss_kib

    procs = {"prefill": cluster.prefill.proc.pid, "decode": cluster.decode.proc.pid,
             "proxy": cluster.proxy.proc.pid}
    finished = 0

    def count_finished(_: object) -> None:
        nonlocal finished
        finished += 1

    sampler = memory_series.MemorySampler(
        procs, {"prefill": cluster.prefill.url, "decode": cluster.decode.url},
        lambda: finished, args.memory_interval_s)
    deadline = time.monotonic() + args.soak_minutes * 60
    batch_ends: list[tuple[int, dict[str, int]]] = []  # taken in the idle gaps
    sent = errors = 0
    batch = 0
    print(f"soaking for {args.soak_minutes:g} min at {args.soak_rate:g} req/s, "
          f"{args.soak_batch} requests then {args.soak_gap_s:g}s idle")
    sampler.start()
    try:
        while time.monotonic() < deadline:
            planned = plan_requests(args.soak_batch, args.seed + batch, args.cancel_fraction,
                                    args.max_prompt_words)
            left = deadline - time.monotonic()
            result = asyncio.run(run_load(cluster.proxy.url, planned, args.concurrency, left,
                                          rate_rps=args.soak_rate, progress=lambda _: None,
                                          on_outcome=count_finished))
            sent += len(result.outcomes)
            errors += result.count("error")
            batch += 1
            time.sleep(args.soak_gap_s)
            rss = {name: rss_kib(pid) for name, pid in procs.items()}
            batch_ends.append((sent, rss))
            print(f"  {sent} requests, {errors} errors, RSS MiB "
                  + ", ".join(f"{k} {v / 1024:.0f}" for k, v in rss.items()), flush=True)
    finally:
        sampler.stop()
    summary: dict[str, Any] = {"mode": "soak", "model": args.model, "minutes": args.soak_minutes,
                               "requests": sent, "errors": errors}
    # Growth per 1000 requests: least-squares slope over the idle-gap samples after the first
    # batch (warm-up).
    fit = batch_ends[1:] if len(batch_ends) > 2 else batch_ends
    for name in procs:
        summary[f"{name}_rss_mib_start"] = batch_ends[0][1][name] / 1024 if batch_ends else math.nan
        summary[f"{name}_rss_mib_end"] = batch_ends[-1][1][name] / 1024 if batch_ends else math.nan
        summary[f"{name}_rss_kib_per_1000_requests"] = memory_series.slope(
            [(float(n), float(rss[name])) for n, rss in fit]) * 1000
    summary.update({f"series_{k}": v for k, v in memory_series.figures(sampler.samples).items()})
    if args.memory_json:
        memory_series.write_json(sampler.samples, args.memory_json)
    if args.memory_plot and sampler.samples:
        memory_series.plot(sampler.samples, args.memory_plot,
                           f"kvlink bench load --soak-minutes {args.soak_minutes:g} ({args.model}): "
                           f"{sent} requests")
    summary.update(_leak_check(cluster))
    summary["passed"] = errors == 0 and not summary["leaks"]
    _print(summary)
    return summary


def _run_vllm(args: argparse.Namespace) -> int:
    from kvlink.bench.load_vllm import FleetConfig
    from kvlink.bench.load_vllm_run import LoadPlan, run_fleet_bench
    from kvlink.bench.vllm_config import default_model_dir

    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvlink-bench-load-vllm-"))
    model_dir = args.model_dir or default_model_dir()
    print(f"kvlink bench load --engine vllm: {model_dir.name}, logs in {log_dir}")
    plan = LoadPlan(requests=args.requests, concurrency=args.concurrency, cancel_fraction=args.cancel_fraction,
                    max_prompt_words=args.max_prompt_words, seed=args.seed,
                    kill=None if args.no_kill else "prefill0", time_limit_s=args.time_limit_s,
                    memory_interval_s=args.memory_interval_s)
    summary = run_fleet_bench(FleetConfig(model_dir=model_dir, log_dir=log_dir, verify_kv=args.verify_kv), plan,
                              memory_json=args.memory_json, memory_plot=args.memory_plot)
    summary = {"mode": "load", "engine": "vllm", "model_dir": model_dir.name, **summary}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    for key in ("wrong", "cancelled_not_prefix", "errors_unexpected", "errors_in_kill_window"):
        for item in summary[key][:5]:
            print(f"  {key}: {item}")
    _print({k: v for k, v in summary.items()
            if k not in ("wrong", "cancelled_not_prefix", "errors_unexpected", "errors_in_kill_window")}
           | {k: len(summary[k]) for k in ("wrong", "cancelled_not_prefix", "errors_unexpected",
                                           "errors_in_kill_window")},
           "PASSED: answers equal vLLM colocated, errors only from cancels and the kill, every instance idle")
    return 0 if summary["passed"] else 1


def _print(summary: dict[str, Any], verdict: str = "PASSED: no leaks, errors only from cancels") -> None:
    print("result:")
    for key, value in summary.items():
        shown = f"{value:.4g}" if isinstance(value, float) else value
        print(f"  {key}: {shown}")
    print(verdict if summary.get("passed") else "FAILED")
