"""End-to-end helpers: real `kvlink serve`/`proxy` processes started by the launcher, stopped by PID."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvlink.bench.cluster import Cluster, ClusterSpec

NUM_BLOCKS = 64
BLOCK_SIZE = 16
START_TIMEOUT_S = 180.0


def cluster_for(spec: ClusterSpec, tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Cluster]:
    """Start `spec` (bounded wait); yield it; stop every process by PID whatever happens."""
    log_dir: Path = tmp_path_factory.mktemp(name)
    cluster = Cluster(spec, log_dir, progress=lambda line: None)
    cluster.start(timeout_s=START_TIMEOUT_S)
    try:
        yield cluster
    finally:
        cluster.stop(timeout_s=10.0)
        for service in cluster.services():
            assert service.proc.poll() is not None, f"{service.name} (pid {service.proc.pid}) still running"


def spec(model: str, p_tp: int = 1, d_tp: int = 1, colocated: bool = True,
         transfer_mode: str = "pull") -> ClusterSpec:
    return ClusterSpec(model=model, prefill_tp=p_tp, decode_tp=d_tp, num_blocks=NUM_BLOCKS,
                       prefill_block_size=BLOCK_SIZE, decode_block_size=BLOCK_SIZE, colocated=colocated, request_timeout_s=60.0,
                       transfer_mode=transfer_mode)


def complete(url: str, prompt: str | list[int], max_tokens: int, **extra: Any) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60.0)


def completion_text(url: str, prompt: str | list[int], max_tokens: int) -> tuple[str, dict[str, Any]]:
    response = complete(url, prompt, max_tokens)
    assert response.status_code == 200, response.text
    body = response.json()
    return body["choices"][0]["text"], body


def assert_clean(cluster: Cluster, timeout_s: float = 15.0) -> None:
    """Every instance: all blocks free, no request, lease, load or transfer left (bounded wait)."""
    for service in cluster.instances():
        deadline = time.monotonic() + timeout_s
        while True:
            state = httpx.get(f"{service.url}/debug/state", timeout=10.0).json()
            engine = state["engine"]
            connector = engine.get("connector") or {}
            problems = {
                "in_flight": state["in_flight"], "requests": engine.get("requests", 0),
                "running": engine["running"], "waiting": engine["waiting"],
                "waiting_for_remote_kv": engine["waiting_for_remote_kv"],
                "held_requests": engine["held_requests"],
                "leases": connector.get("leases", 0),
                "loads_in_flight": connector.get("loads_in_flight", 0),
                "open_transfers": connector.get("open_transfers", 0),
                "waiting_for_handshake": connector.get("waiting_for_handshake", 0),
            }
            leaks = {k: v for k, v in problems.items() if v}
            if set(engine["free_blocks"]) != {engine["num_blocks"]}:
                leaks["free_blocks"] = engine["free_blocks"]
            if not leaks:
                break
            assert time.monotonic() < deadline, f"{service.name} did not return to idle: {leaks}"
            time.sleep(0.2)
