"""`kvlink bench layerwise`: TTFT of classic pull, classic push and layerwise across two hosts.

P and D run in two network namespaces (`bench.two_hosts`), the KV over UCX TCP on a veth
pair that `tc` limits to each rate in turn; kvlink's proxy runs in the root namespace.
Every request has a fresh random prompt (no prefix hit anywhere) and asks for one token,
so its wall time through the proxy is its time to first token. P's own time for each
request (queue + prefill, from its log line) gives the part of TTFT that P/D adds on top
("past P"): the router's second leg, the KV transfer left after P's prefill, D's first
step. That part does not carry P's run-to-run spread. Modes are interleaved run by run.
"""

from __future__ import annotations

import json
import random
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvlink.bench.cluster import ClusterSpec, running_cluster
from kvlink.bench.serve_client import Answer, stream
from kvlink.bench.two_hosts import TwoHosts, limit_link, netns_unavailable, two_hosts

MODES = ("pull", "push", "layerwise")
VOCAB_LOW, VOCAB_HIGH = 100, 49000  # SmolLM2 ids that are ordinary tokens


@dataclass(frozen=True)
class LayerwiseConfig:
    tokens: tuple[int, ...] = (256, 512, 1024, 2048)
    rates: tuple[str | None, ...] = ("1gbit", "10gbit", None)  # None: no limit
    runs: int = 5
    modes: tuple[str, ...] = MODES
    num_blocks: int = 320
    log_dir: Path | None = None
    seed: int = 0


@dataclass
class Sample:
    rate: str
    tokens: int
    mode: str
    run: int
    ttft_s: float
    prefill_s: float | None
    kv_transfer_s: float | None
    kv_bytes: int | None
    request_id: str = ""
    p_s: float | None = None  # P's own time for the request (its log line): queue + prefill


@dataclass
class Result:
    config: dict[str, Any]
    machine: str
    transport: str
    samples: list[Sample] = field(default_factory=list)


def rate_name(rate: str | None) -> str:
    return rate or "none"


def _prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(tokens)]


def _ask(client: httpx.Client, proxy: str, prompt: list[int], mode: str | None, request_id: str,
         model: str | None = None) -> Answer:
    """One fresh prompt, one token, through the proxy (`mode` None: no transfer mode asked)."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 1}
    if mode is not None:
        body["kv_transfer_params"] = {"transfer_mode": mode}
    if model is not None:
        body |= {"model": model, "temperature": 0.0}
    started = time.monotonic()
    answer = stream(client, proxy, "/v1/completions", body, headers={"X-Request-Id": request_id})
    answer.ttft_s = time.monotonic() - started  # one token: the whole answer is the first token
    return answer


_P_LINE = re.compile(r"request (\S+) role=prefill .* total=([0-9.]+)ms")


def seconds_by_request(log: Path, pattern: re.Pattern[str]) -> dict[str, float]:
    """Request id -> seconds, from the log lines `pattern` matches (groups: id, milliseconds)."""
    out: dict[str, float] = {}
    if log.exists():
        for line in log.read_text(errors="replace").splitlines():
            match = pattern.search(line)
            if match:
                out[match.group(1)] = float(match.group(2)) / 1e3
    return out


def p_times(log: Path) -> dict[str, float]:
    """P's own time per request id (arrival to its prefill's end), from its one log line each."""
    return seconds_by_request(log, _P_LINE)


def spec_for(hosts: TwoHosts, config: LayerwiseConfig) -> ClusterSpec:
    return ClusterSpec(
        model="smollm2-135m", num_blocks=config.num_blocks, load_failure_policy="fail",
        request_timeout_s=300.0, router_timeout_s=300.0, lease_s=120.0,
        prefill_host=hosts.p_addr, decode_host=hosts.d_http_addr,
        prefill_netns=hosts.ns_p, decode_netns=hosts.ns_d, env={"UCX_TLS": "tcp"},
        prefill_env={"UCX_NET_DEVICES": hosts.link_p}, decode_env={"UCX_NET_DEVICES": hosts.link_d},
        decode_args=("--kv-host", hosts.d_addr))  # P reaches D's side channel over the P-D link


def run_bench(config: LayerwiseConfig, machine: str, progress: Callable[[str], None] = print) -> Result:
    why = netns_unavailable("lwb")
    if why is not None:
        raise RuntimeError(f"kvlink bench layerwise needs two network namespaces, but {why}")
    result = Result(asdict(config) | {"log_dir": str(config.log_dir or "")}, machine,
                    "UCX_TLS=tcp on a veth pair between two network namespaces")
    rng = random.Random(config.seed)
    with two_hosts("lwb", octet=236) as hosts, running_cluster(
            spec_for(hosts, config), config.log_dir, progress, timeout_s=300) as cluster, \
            httpx.Client(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        assert cluster.proxy is not None
        proxy = cluster.proxy.url
        total = len(config.rates) * len(config.tokens) * config.runs * len(config.modes)
        done = 0
        for rate in config.rates:
            limit_link(hosts, rate)
            for mode in config.modes:  # warm: handshakes, first-use allocations
                _ask(client, proxy, _prompt(rng, 64), mode, f"warm-{rate_name(rate)}-{mode}")
            for tokens in config.tokens:
                for run in range(config.runs):
                    for mode in config.modes:
                        rid = f"lw-{rate_name(rate)}-{tokens}-{mode}-{run}"
                        answer = _ask(client, proxy, _prompt(rng, tokens), mode, rid)
                        sample = Sample(rate_name(rate), tokens, mode, run, answer.ttft_s,
                                        answer.prefill_s if mode != "layerwise" else None,
                                        answer.kv_transfer_s, answer.kv_bytes, rid)
                        result.samples.append(sample)
                        done += 1
                        progress(f"[{done}/{total}] rate {rate_name(rate)} {tokens} tokens {mode} run {run}: "
                                 f"TTFT {answer.ttft_s * 1e3:.0f} ms"
                                 + (f", transfer {answer.kv_transfer_s * 1e3:.0f} ms"
                                    if answer.kv_transfer_s is not None else ""))
        limit_link(hosts, None)
        times = p_times(cluster.log_dir / "prefill.log")
        for sample in result.samples:
            sample.p_s = times.get(sample.request_id)
    return result


def _mean(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.fmean(kept) if kept else None


def _sd(values: Sequence[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def rows(result: Result) -> list[dict[str, Any]]:
    """Per (rate, tokens, mode): means over the runs."""
    out = []
    rate_order = list(dict.fromkeys(s.rate for s in result.samples))  # as run: the config's order
    keys = sorted({(s.rate, s.tokens, s.mode) for s in result.samples},
                  key=lambda k: (rate_order.index(k[0]), k[1], MODES.index(k[2]) if k[2] in MODES else 9))
    for rate, tokens, mode in keys:
        picked = [s for s in result.samples if (s.rate, s.tokens, s.mode) == (rate, tokens, mode)]
        ttfts = [s.ttft_s for s in picked]
        out.append({"rate": rate, "tokens": tokens, "mode": mode, "runs": len(picked),
                    "ttft_ms": statistics.fmean(ttfts) * 1e3, "ttft_sd_ms": _sd(ttfts) * 1e3,
                    "prefill_ms": _ms(_mean([s.prefill_s for s in picked])),
                    "kv_transfer_ms": _ms(_mean([s.kv_transfer_s for s in picked])),
                    "kv_mib": None if (mib := _mean([s.kv_bytes for s in picked])) is None else mib / 2**20,
                    "p_ms": _ms(_mean([s.p_s for s in picked])),
                    # what the request waited past P's own work: the part P/D adds to TTFT
                    "after_p_ms": _ms(_mean([s.ttft_s - s.p_s for s in picked if s.p_s is not None])),
                    "after_p_sd_ms": _sd([s.ttft_s - s.p_s for s in picked if s.p_s is not None]) * 1e3})
    return out


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1e3


def targets(result: Result) -> list[str]:
    """The issue's two targets, judged on this run."""
    table = {(r["rate"], r["tokens"], r["mode"]): r for r in rows(result)}
    lines = []
    longest = max((s.tokens for s in result.samples), default=0)
    pull, layer = table.get(("1gbit", longest, "pull")), table.get(("1gbit", longest, "layerwise"))
    transfer, how = (pull or {}).get("kv_transfer_ms"), "transfer"
    free = table.get(("none", longest, "pull"))
    if pull and transfer is None and free and pull["after_p_ms"] is not None and free["after_p_ms"] is not None:
        # No figures from D (a vLLM D): what the limited link added to pull's time past P
        transfer, how = pull["after_p_ms"] - free["after_p_ms"], "transfer (pull past P, 1gbit - no limit)"
    if pull and layer and transfer is not None:
        bound = pull["ttft_ms"] - 0.6 * transfer
        verdict = "met" if layer["ttft_ms"] <= bound else "missed"
        lines.append(f"1gbit, {longest} tokens: layerwise TTFT {layer['ttft_ms']:.0f} ms vs bound "
                     f"{bound:.0f} ms (pull {pull['ttft_ms']:.0f} - 0.6 x {how} {transfer:.0f}): "
                     f"{verdict}")
        if pull["after_p_ms"] is not None and layer["after_p_ms"] is not None:
            # The same target on the time past P's own prefill, which P's run-to-run spread leaves out.
            bound = pull["after_p_ms"] - 0.6 * transfer
            verdict = "met" if layer["after_p_ms"] <= bound else "missed"
            lines.append(f"1gbit, {longest} tokens, time past P's prefill: layerwise {layer['after_p_ms']:.0f} ms "
                         f"vs bound {bound:.0f} ms (pull {pull['after_p_ms']:.0f} - 0.6 x transfer): {verdict}")
    nixl = table.get(("1gbit", longest, "nixl"))
    if nixl and layer:
        lines.append(f"1gbit, {longest} tokens: layerwise TTFT {layer['ttft_ms']:.0f} ms vs NixlConnector "
                     f"{nixl['ttft_ms']:.0f} ms")
    for tokens in sorted({s.tokens for s in result.samples}):
        pull, layer = table.get(("none", tokens, "pull")), table.get(("none", tokens, "layerwise"))
        if pull and layer:
            noise = max(pull["ttft_sd_ms"], layer["ttft_sd_ms"], 0.05 * pull["ttft_ms"])
            verdict = "met" if layer["ttft_ms"] <= pull["ttft_ms"] + noise else "missed"
            lines.append(f"no limit, {tokens} tokens: layerwise {layer['ttft_ms']:.0f} ms vs pull "
                         f"{pull['ttft_ms']:.0f} ms (noise {noise:.0f}): {verdict}")
    return lines


def table(result: Result) -> str:
    head = ("| rate | tokens | mode | TTFT ms (sd) | P's own ms | past P ms (sd) | D's KV wait ms | KV MiB |\n"
            "|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows(result):
        own = "-" if r["p_ms"] is None else f"{r['p_ms']:.0f}"
        past = "-" if r["after_p_ms"] is None else f"{r['after_p_ms']:.0f} ({r['after_p_sd_ms']:.0f})"
        transfer = "-" if r["kv_transfer_ms"] is None else f"{r['kv_transfer_ms']:.0f}"
        mib = "-" if r["kv_mib"] is None else f"{r['kv_mib']:.1f}"
        lines.append(f"| {r['rate']} | {r['tokens']} | {r['mode']} | {r['ttft_ms']:.0f} ({r['ttft_sd_ms']:.0f}) "
                     f"| {own} | {past} | {transfer} | {mib} |")
    return "\n".join(lines)


def write_json(result: Result, path: Path) -> None:
    data = {"config": result.config, "machine": result.machine, "transport": result.transport,
            "rows": rows(result), "targets": targets(result), "samples": [asdict(s) for s in result.samples]}
    path.write_text(json.dumps(data, indent=1))


def plot(result: Result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table_rows = rows(result)
    rates = list(dict.fromkeys(r["rate"] for r in table_rows))
    fig, axes = plt.subplots(2, len(rates), figsize=(4.5 * len(rates), 6.6), squeeze=False)
    for column, rate in enumerate(rates):
        for row, (key, sd, label) in enumerate((("ttft_ms", "ttft_sd_ms", "TTFT (ms)"),
                                                ("after_p_ms", "after_p_sd_ms", "TTFT past P's own time (ms)"))):
            ax = axes[row][column]
            for mode in dict.fromkeys(r["mode"] for r in table_rows):
                picked = [r for r in table_rows if r["rate"] == rate and r["mode"] == mode and r[key] is not None]
                if picked:
                    ax.errorbar([r["tokens"] for r in picked], [r[key] for r in picked],
                                yerr=[r[sd] for r in picked], marker="o", capsize=3, label=mode)
            ax.set_title(f"P-D link: {rate}")
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend()
    engine = "vLLM P and D" if result.config.get("engine") == "vllm" else "kvlink"
    fig.suptitle(f"{engine} 1P1D, SmolLM2-135M fp32, UCX TCP across two namespaces ({result.machine})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
