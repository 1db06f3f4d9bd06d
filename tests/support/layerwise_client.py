"""Layerwise requests through `kvlink proxy --mode layerwise` in front of a vLLM P and D."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from vllm_client import KV_LOADS, complete, metric, token_ids, wait_metric

from kvlink.bench.routers import router_argv
from kvlink.procs.launcher import free_port, start_process, stop_all, wait_healthy

PUSH_LINE = re.compile(r"layerwise push of .*: (\d+) WRITEs \(\d+ bytes\) during the prefill")
IN_FLIGHT = "vllm:kvlink_loads_in_flight"
T = TypeVar("T")


def with_p_held(p: Any, d: Any, send: Callable[[], T], within_s: float = 30.0) -> T:
    """`send()` (a layerwise request through the proxy) while P's API server is stopped
    (SIGSTOP; its engine and workers run on) until D has started the load, i.e. asked P to
    stream: P's prefill then begins with D's ask already in its workers' inbox, so every
    forward after the first layer streams whatever the machine's load. Without the hold, D's
    ask may reach a busy P only after the prefill (the WRITEs then come after it, still exact)."""
    with ThreadPoolExecutor(1) as pool:
        p.proc.send_signal(signal.SIGSTOP)
        try:
            sent = pool.submit(send)
            deadline = time.monotonic() + within_s
            while metric(d.url, IN_FLIGHT) < 1 and not sent.done():
                assert time.monotonic() < deadline, "D never started the layerwise load"
                time.sleep(0.05)
            time.sleep(0.5)  # D's ask on its way into P's inbox
        finally:
            p.proc.send_signal(signal.SIGCONT)
        return sent.result(timeout=120)


def layerwise_answers(p: Any, d: Any, model: str, prompts: list[Any], log_dir: Path,
                      name: str = "router-layerwise", held: Collection[int] = (),
                      **extra: Any) -> list[tuple[list[int], float]]:
    """Each prompt's greedy token ids through the proxy, and P's WRITEs for it. The first
    prompt goes once more before them, the classic way (a vLLM P has no /v1/kv_endpoint:
    the proxy learns P's side channel from its answer); D must read none of the others.
    The prompts at the indices in `held` go with P held until D asked (`with_p_held`)."""
    port = free_port()
    router = start_process(name, router_argv("kvlink", [p.url], [d.url], port, 60.0,
                                             extra_args=["--mode", "layerwise"]),
                           f"http://127.0.0.1:{port}", log_dir)
    out = []
    try:
        wait_healthy([router], 60)
        for n, prompt in enumerate([prompts[0], *prompts]):
            read, wrote = metric(d.url, KV_LOADS), metric(p.url, KV_LOADS)
            def send(prompt: Any = prompt) -> Any:
                return complete(router.url, model, prompt, **extra)
            ids = token_ids(with_p_held(p, d, send) if n and n - 1 in held else send())
            if n:
                out.append((ids, wait_metric(p.url, KV_LOADS, wrote) - wrote))
                assert metric(d.url, KV_LOADS) == read, "D read a layerwise request"
    finally:
        stop_all([router])
    return out


def writes_during_prefill(p: Any) -> list[int]:
    """P's WRITEs during the prefill of each layerwise push it logged."""
    return [int(w) for w in PUSH_LINE.findall(p.log_path.read_text(errors="replace"))]
