"""`kvlink bench layerwise --engine vllm`: the same two-host TTFT bench with vLLM P and D.

vLLM (CPU build) P and D run in the two network namespaces of `bench.two_hosts`, the KV
over UCX TCP on the `tc`-limited veth pair, kvlink's proxy in the root namespace. Two
pairs of servers, one after the other: vLLM with kvlink's connector (pull, push and
layerwise, chosen per request), then vLLM with its own NixlConnector (classic: P first,
then D reads), started the same way on the same cores. P's leg of each request comes
from the proxy (its prefill header, or its log line for layerwise requests), so "past
P" is measured alike for every mode and both connectors.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvlink.bench.layerwise import Result, Sample, _ask, _prompt, rate_name, seconds_by_request
from kvlink.bench.two_hosts import TwoHosts, limit_link, netns_unavailable, two_hosts
from kvlink.bench.vllm_servers import _pythonpath
from kvlink.connector.secret import new_secret
from kvlink.integrations.vllm.launch import (
    VllmServerSpec,
    kvlink_transfer_config,
    served_model,
    server_argv,
    server_env,
    wait_ready,
)
from kvlink.procs import launcher
from kvlink.procs.launcher import Service

KVLINK_MODES = ("pull", "push", "layerwise")
NIXL = "nixl"  # vLLM's NixlConnector, classic flow (its only one)
HTTP_PORT, SIDE_PORT = 8100, 5600


@dataclass(frozen=True)
class VllmLayerwiseConfig:
    model_dir: Path
    tokens: tuple[int, ...] = (256, 512, 1024, 2048)
    rates: tuple[str | None, ...] = ("1gbit", "10gbit", None)
    runs: int = 5
    modes: tuple[str, ...] = (*KVLINK_MODES, NIXL)
    block_size: int = 128
    max_model_len: int = 4160  # the longest prompt (4096) and its token
    log_dir: Path | None = None
    seed: int = 0
    nixl_extra: dict[str, Any] = field(default_factory=dict)  # NixlConnector's kv_connector_extra_config
    nixl_env: dict[str, str] = field(default_factory=dict)  # and its servers' environment, over the bench's


def _server(config: VllmLayerwiseConfig, name: str, netns: str, host: str, core: int, kv: dict[str, Any],
            env: dict[str, str]) -> VllmServerSpec:
    return VllmServerSpec(model=config.model_dir, port=HTTP_PORT, block_size=config.block_size, cores=str(core),
                          kv_transfer_config=kv, max_model_len=config.max_model_len,
                          env={**env, "PYTHONPATH": _pythonpath()}, args=["--seed", "0"], name=name,
                          host=host, netns=netns)


def server_specs(config: VllmLayerwiseConfig, hosts: TwoHosts, connector: str,
                 secret: str) -> tuple[VllmServerSpec, VllmServerSpec]:
    """P (core 0, in P's namespace, HTTP and side channel on the P-D link) and D (core 1, in
    D's, HTTP on its root-facing address, side channel on the P-D link), UCX over TCP on
    each side's end of the P-D link."""
    p_env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": hosts.link_p}
    d_env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": hosts.link_d}
    if connector == NIXL:
        kv: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        if config.nixl_extra:
            kv["kv_connector_extra_config"] = dict(config.nixl_extra)
        p_env |= {**config.nixl_env, "VLLM_NIXL_SIDE_CHANNEL_HOST": hosts.p_addr,
                  "VLLM_NIXL_SIDE_CHANNEL_PORT": str(SIDE_PORT)}
        d_env |= {**config.nixl_env, "VLLM_NIXL_SIDE_CHANNEL_HOST": hosts.d_addr,
                  "VLLM_NIXL_SIDE_CHANNEL_PORT": str(SIDE_PORT)}
        p_kv, d_kv = kv, kv
    else:
        p_env["KVLINK_SECRET"] = d_env["KVLINK_SECRET"] = secret
        p_kv = kvlink_transfer_config(SIDE_PORT, side_channel_host=hosts.p_addr)
        d_kv = kvlink_transfer_config(SIDE_PORT, side_channel_host=hosts.d_addr)
    return (_server(config, f"prefill-{connector}", hosts.ns_p, hosts.p_addr, 0, p_kv, p_env),
            _server(config, f"decode-{connector}", hosts.ns_d, hosts.d_http_addr, 1, d_kv, d_env))


@contextmanager
def running_pair(config: VllmLayerwiseConfig, hosts: TwoHosts, connector: str, log_dir: Path,
                 progress: Callable[[str], None]) -> Iterator[Service]:
    """P, D and kvlink's proxy in front of them; yields the proxy; stops all three."""
    services: list[Service] = []
    try:
        for spec in server_specs(config, hosts, connector, new_secret()):
            services.append(launcher.start_process(spec.label, server_argv(spec), spec.url, log_dir,
                                                   server_env(spec), cpus=[int(spec.cores)],
                                                   cwd=log_dir))
        progress(f"starting vLLM P and D with {connector if connector == NIXL else 'kvlink'}'s connector "
                 "(about a minute)")
        wait_ready(services, 300.0, lambda line: progress("  " + line))
        port = launcher.free_port()
        proxy = launcher.start_service(f"proxy-{connector}", [
            "proxy", "--prefill", services[0].url, "--decode", services[1].url, "--port", str(port),
            "--timeout-s", "300"], port, log_dir, env={"PYTHONPATH": _pythonpath()})
        services.append(proxy)
        launcher.wait_healthy([proxy], 60.0, lambda _line: None)
        yield proxy
    finally:
        launcher.stop_all(services, timeout_s=20.0)


_LAYERWISE_P = re.compile(r"request (\S+): layerwise prefill answered after ([0-9.]+)ms")


def layerwise_p_legs(log: Path) -> dict[str, float]:
    """P's leg of each layerwise request (seconds), from the proxy's log."""
    return seconds_by_request(log, _LAYERWISE_P)


def run_vllm_bench(config: VllmLayerwiseConfig, machine: str, log_dir: Path,
                   progress: Callable[[str], None] = print) -> Result:
    why = netns_unavailable("lwv")
    if why is not None:
        raise RuntimeError(f"kvlink bench layerwise needs two network namespaces, but {why}")
    result = Result(asdict(config) | {"engine": "vllm", "model_dir": config.model_dir.name,
                                      "log_dir": str(config.log_dir or "")}, machine,
                    "UCX_TLS=tcp on a veth pair between two network namespaces")
    groups = [(c, [m for m in config.modes if (m == NIXL) == (c == NIXL)]) for c in ("kvlink", NIXL)]
    total = len(config.rates) * len(config.tokens) * config.runs * len(config.modes)
    done = 0
    with two_hosts("lwv", octet=237) as hosts, httpx.Client(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        for connector, modes in groups:
            if not modes:
                continue
            rng = random.Random(config.seed)  # the same prompts for both connectors
            with running_pair(config, hosts, connector, log_dir, progress) as proxy:
                model = served_model(_p_url(hosts))
                samples: list[Sample] = []
                for rate in config.rates:
                    limit_link(hosts, rate)
                    for mode in modes:  # warm: handshakes, and the proxy learns P's side channel
                        _ask_vllm(client, proxy.url, model, _prompt(rng, 64), mode, f"warm-{rate_name(rate)}-{mode}")
                    for tokens in config.tokens:
                        for run in range(config.runs):
                            for mode in modes:
                                rid = f"lwv-{rate_name(rate)}-{tokens}-{mode}-{run}"
                                answer = _ask_vllm(client, proxy.url, model, _prompt(rng, tokens), mode, rid)
                                leg = None if mode == "layerwise" else answer.prefill_s  # from the log, below
                                samples.append(Sample(rate_name(rate), tokens, mode, run, answer.ttft_s,
                                                      leg, None, None, rid, leg))
                                done += 1
                                progress(f"[{done}/{total}] vLLM, rate {rate_name(rate)}, {tokens} tokens, {mode}, "
                                         f"run {run}: TTFT {answer.ttft_s * 1e3:.0f} ms")
                limit_link(hosts, None)
                legs = layerwise_p_legs(proxy.log_path)
                for sample in samples:
                    if sample.mode == "layerwise":
                        sample.p_s = legs.get(sample.request_id)
                result.samples += samples
    return result


def _p_url(hosts: TwoHosts) -> str:
    return f"http://{hosts.p_addr}:{HTTP_PORT}"


def _ask_vllm(client: httpx.Client, proxy: str, model: str, prompt: list[int], mode: str, request_id: str) -> Any:
    """One request of one token; NixlConnector's go the classic way (the proxy's default, and
    no kvlink transfer mode in the body)."""
    return _ask(client, proxy, prompt, None if mode == NIXL else mode, request_id, model=model)
