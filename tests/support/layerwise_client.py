"""Layerwise requests through `kvlink proxy --mode layerwise` in front of a vLLM P and D."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from vllm_client import KV_LOADS, complete, metric, token_ids, wait_metric

from kvlink.bench.routers import router_argv
from kvlink.procs.launcher import free_port, start_process, stop_all, wait_healthy

PUSH_LINE = re.compile(r"layerwise push of .*: (\d+) WRITEs \(\d+ bytes\) during the prefill")


def layerwise_answers(p: Any, d: Any, model: str, prompts: list[Any], log_dir: Path,
                      name: str = "router-layerwise", **extra: Any) -> list[tuple[list[int], float]]:
    """Each prompt's greedy token ids through the proxy, and P's WRITEs for it. The first
    prompt goes once more before them, the classic way (a vLLM P has no /v1/kv_endpoint:
    the proxy learns P's side channel from its answer); D must read none of the others."""
    port = free_port()
    router = start_process(name, router_argv("kvlink", [p.url], [d.url], port, 60.0,
                                             extra_args=["--mode", "layerwise"]),
                           f"http://127.0.0.1:{port}", log_dir)
    out = []
    try:
        wait_healthy([router], 60)
        for n, prompt in enumerate([prompts[0], *prompts]):
            read, wrote = metric(d.url, KV_LOADS), metric(p.url, KV_LOADS)
            ids = token_ids(complete(router.url, model, prompt, **extra))
            if n:
                out.append((ids, wait_metric(p.url, KV_LOADS, wrote) - wrote))
                assert metric(d.url, KV_LOADS) == read, "D read a layerwise request"
    finally:
        stop_all([router])
    return out


def writes_during_prefill(p: Any) -> list[int]:
    """P's WRITEs during the prefill of each layerwise push it logged."""
    return [int(w) for w in PUSH_LINE.findall(p.log_path.read_text(errors="replace"))]
