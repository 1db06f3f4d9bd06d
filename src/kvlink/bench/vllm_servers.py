"""The processes of `kvlink bench vllm`: ports and connector settings of a case, vLLM servers
and kvlink's proxy (started, awaited and stopped through `kvlink.procs.launcher` and
`kvlink.integrations.vllm.launch`), and greedy completions against them."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvlink.bench.vllm_config import Case, VllmBenchConfig
from kvlink.integrations.vllm.launch import (
    VllmServerSpec,
    kvlink_transfer_config,
    server_argv,
    server_env,
    wait_ready,
)
from kvlink.procs import launcher
from kvlink.procs.launcher import Progress, Service


@dataclass(frozen=True)
class CasePorts:
    """HTTP and side-channel ports of one case, each free when drawn and never drawn twice."""

    prefill: int
    decode: int
    proxy: int
    side_prefill: int
    side_decode: int

    @classmethod
    def draw(cls) -> CasePorts:
        draw = launcher.free_port
        return cls(prefill=draw(), decode=draw(), proxy=draw(), side_prefill=draw(), side_decode=draw())


def kv_setup(case: Case, ports: CasePorts, secret: str, config: VllmBenchConfig
             ) -> tuple[dict[str, Any], dict[str, str], dict[str, Any], dict[str, str]]:
    """(P config, P env, D config, D env) for the case's connector: NixlConnector with the
    bench's extra settings and environment, if any; kvlink with its `verify_kv` (None: the
    connector's default) on both sides."""
    verify_kv = config.verify_kv
    if case.connector == "nixl":
        cfg: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        if config.nixl_extra:
            cfg["kv_connector_extra_config"] = dict(config.nixl_extra)
        host = {**config.nixl_env, "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
        return (cfg, {**host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports.side_prefill)},
                cfg, {**host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports.side_decode)})
    env = {"KVLINK_SECRET": secret}
    extra: dict[str, Any] = {"verify_kv": verify_kv} if verify_kv is not None else {}
    return (kvlink_transfer_config(ports.side_prefill, **extra), env,
            kvlink_transfer_config(ports.side_decode, **extra), env)


def _pythonpath() -> str:
    """This kvlink's source tree first, so that the servers import the connector being benched."""
    source = str(Path(__file__).resolve().parents[2])
    return os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH", "")) if p)


def start_vllm(config: VllmBenchConfig, name: str, port: int, block_size: int, core: int, log_dir: Path,
               kv_config: dict[str, Any] | None, env: dict[str, str]) -> Service:
    """One vLLM server of the bench, every process of it (API server, engine core) on `core`."""
    spec = VllmServerSpec(model=config.model_dir, port=port, block_size=block_size, cores=str(core),
                          kv_transfer_config=kv_config, max_model_len=config.max_model_len,
                          enforce_eager=config.enforce_eager, env={**env, "PYTHONPATH": _pythonpath()},
                          dtype=config.dtype, args=["--seed", "0", *config.server_args], name=name)
    # From the temp dir: vLLM must never start from inside a vllm source tree.
    return launcher.start_process(spec.label, server_argv(spec), spec.url, log_dir, server_env(spec),
                                  cpus=[core], cwd=Path(tempfile.gettempdir()))


def wait_servers(servers: list[Service], timeout_s: float, progress: Progress) -> None:
    """Until each vLLM server serves its model; fails fast, with the log tail, if one exits."""
    wait_ready(servers, timeout_s, lambda line: progress("  " + line))


def start_proxy(prefill: Service, decode: Service, port: int, log_dir: Path) -> Service:
    """kvlink's proxy in front of P and D, awaited until it answers /health."""
    proxy = launcher.start_service("proxy", ["proxy", "--prefill", prefill.url, "--decode", decode.url,
                                             "--port", str(port), "--timeout-s", "300"],
                                   port, log_dir, env={"PYTHONPATH": _pythonpath()})
    try:
        launcher.wait_healthy([proxy], 60.0, lambda _line: None)
    except BaseException:
        launcher.stop_all([proxy])
        raise
    return proxy


@contextlib.contextmanager
def running(services: list[Service]) -> Iterator[list[Service]]:
    """Stop every service the block adds to `services`, however the block ends."""
    try:
        yield services
    finally:
        launcher.stop_all(services, timeout_s=20.0)


def complete(base_url: str, model: str, prompt: str, max_tokens: int, timeout_s: float = 300.0,
             kv_params: dict[str, Any] | None = None, request_id: str | None = None) -> dict[str, Any]:
    """One greedy completion: {"status", "text", "error", "timed_out", "params"} (P's
    `kv_transfer_params`); never raises on a server's failure. `request_id` goes out as
    X-Request-Id (vLLM's push connector pairs P's request with D's by it)."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": False}
    if kv_params is not None:
        body["kv_transfer_params"] = kv_params
    headers = {"X-Request-Id": request_id} if request_id else {}
    try:
        response = httpx.post(base_url + "/v1/completions", json=body, timeout=timeout_s, headers=headers)
    except httpx.TimeoutException as error:
        return {"status": None, "text": None, "error": f"{type(error).__name__}: {error}", "timed_out": True}
    except httpx.HTTPError as error:
        return {"status": None, "text": None, "error": f"{type(error).__name__}: {error}"}
    if response.status_code != 200:
        return {"status": response.status_code, "text": None, "error": response.text[:300]}
    try:
        body = response.json()
        text = body["choices"][0]["text"]
    except (ValueError, KeyError, IndexError, TypeError) as error:
        return {"status": 200, "text": None, "error": f"bad body: {error}: {response.text[:200]}"}
    usage = body.get("usage") if isinstance(body, dict) else None
    prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return {"status": 200, "text": text, "error": None, "prompt_tokens": prompt_tokens,
            "params": body.get("kv_transfer_params")}
