"""Load through each router of one deployment, side by side, and whether a client's disconnect reaches D.

`kvlink bench load --router both` drives the same kind of load through vllm-router and then
through kvlink's proxy, both in front of the same P and D instances; this module holds what
that comparison needs besides the load itself: which routers run, the per-instance request
outcomes (how many each instance aborted), a probe that leaves one long stream after its
first token and watches what D does, and the side-by-side table.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from typing import Any

import httpx

from kvlink.bench.instance_state import metric
from kvlink.bench.routers import ROUTER_KINDS

ROUTER_CHOICES = (*ROUTER_KINDS, "both")
OUTCOMES = ("ok", "abort", "error")


def routers_to_run(choice: str) -> list[str]:
    """The routers one run drives, in order; `both` is vllm-router first, then kvlink's proxy."""
    if choice == "both":
        return ["vllm-router", "kvlink"]
    if choice in ROUTER_KINDS:
        return [choice]
    raise ValueError(f"--router: expected one of {', '.join(ROUTER_CHOICES)}; got {choice!r}")


def outcome_counts(urls: Sequence[str]) -> dict[str, float]:
    """`kvlink_server_requests_total` by outcome, summed over instances."""
    return {o: sum(metric(u, "server_requests_total", f'outcome="{o}"') for u in urls) for o in OUTCOMES}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def disconnect_probe(router_url: str, decode_urls: Sequence[str], max_tokens: int | None = None,
                     timeout_s: float = 30.0) -> dict[str, Any]:
    """Stream one long completion through the router, close the connection after the first
    text chunk, and watch D's outcome counters: `abort` means the disconnect reached D (which
    then frees its blocks and lets P's lease go); `ok` means D generated all `max_tokens`
    for nobody. Run it on an idle deployment. `max_tokens` None: 512, or less where D's
    context (its KV pool) is smaller."""
    if max_tokens is None:
        card = httpx.get(decode_urls[0] + "/v1/models", timeout=timeout_s).json()["data"][0]
        max_tokens = min(512, int(card["max_model_len"]) - 64)  # the prompt is about 12 tokens
    before = outcome_counts(decode_urls)
    body = {"prompt": "disconnect probe: count the stones by the river", "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    ended_early = False
    with httpx.Client(timeout=timeout_s) as client, \
            client.stream("POST", router_url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"disconnect_probe": f"HTTP {response.status_code}: {response.read().decode()[:200]}"}
        for line in response.iter_lines():
            if line == "data: [DONE]":
                ended_early = True
                break
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"disconnect_probe": f"error before the first token: {str(event['error'])[:200]}"}
            if event["choices"][0].get("text"):
                break
    left = time.monotonic()  # leaving the `with` closed the connection
    while time.monotonic() - left < timeout_s:
        seen = delta(outcome_counts(decode_urls), before)
        if any(seen.values()):
            outcome = max(seen, key=lambda k: seen[k])
            return {"disconnect_probe": "inconclusive: the stream ended before the first token"
                    if ended_early else f"D {outcome}",
                    "disconnect_reaches_decode": outcome == "abort" and not ended_early,
                    "disconnect_decode_done_after_s": time.monotonic() - left}
        time.sleep(0.05)
    return {"disconnect_probe": f"D still busy {timeout_s:g}s after the client left",
            "disconnect_reaches_decode": False, "disconnect_decode_done_after_s": math.nan}


COLUMNS = (("router", "router"), ("requests", "requests"), ("ok", "ok"), ("cancelled", "cancelled"),
           ("cancelled_after_finishing", "cancelled after finishing"), ("errors", "errors"),
           ("throughput_rps", "req/s"), ("ttft_p50_s", "TTFT p50 s"), ("ttft_p99_s", "TTFT p99 s"),
           ("leaked", "instances holding state"), ("prefill_outcome_abort", "P aborts"),
           ("decode_outcome_abort", "D aborts"), ("disconnect_probe", "probe: client left after 1st token"))


def table(results: dict[str, dict[str, Any]]) -> str:
    """One Markdown row per router, the figures the comparison is about."""
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |",
             "|" + "|".join("---" if key in ("router", "disconnect_probe") else "---:" for key, _ in COLUMNS) + "|"]
    for router, summary in results.items():
        row = {**summary, "router": router, "leaked": len(summary.get("leaks", {}))}
        lines.append("| " + " | ".join(_cell(row.get(key, "")) for key, _ in COLUMNS) + " |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.0f}" if value.is_integer() else f"{value:.3g}"
    return str(value)
