"""A stream of streaming completions through the proxy: mixed prompts, some cancelled mid-flight.

Each request is scheduled ahead of time from a seeded RNG (prompt length, output length,
whether and when the client gives up), so two runs with the same seed send the same load.
TTFT is measured at the client, from sending to the first SSE chunk that carries text.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

WORDS = ("alpha", "river", "stone", "quiet", "seven", "lamp", "north", "glass", "cloud", "field",
         "paper", "orange", "window", "silver", "garden", "motion")


@dataclass(frozen=True)
class Planned:
    index: int
    prompt: str
    max_tokens: int
    cancel_after_s: float | None  # the client closes the connection after this long


@dataclass
class Outcome:
    index: int
    kind: str  # "ok", "cancelled", "error"
    ttft_s: float | None = None
    total_s: float = 0.0
    output_chunks: int = 0
    error: str | None = None
    text: str = ""  # what the stream carried, for checks against a reference


def plan_requests(n: int, seed: int, cancel_fraction: float, max_prompt_words: int = 300,
                  max_tokens: tuple[int, int] = (4, 16)) -> list[Planned]:
    """`n` requests with mixed prompt lengths; `cancel_fraction` of them cancelled mid-flight."""
    rng = random.Random(seed)
    cancelled = set(rng.sample(range(n), round(n * cancel_fraction)))
    planned = []
    for i in range(n):
        words = rng.choice((8, 24, 60, 120, max_prompt_words))
        words = rng.randint(max(1, words // 2), words)
        prompt = f"[{seed}:{i}] " + " ".join(rng.choice(WORDS) for _ in range(words))
        # Cancelled ones leave at any point: while P prefills, during the transfer, or mid-stream.
        cancel = rng.uniform(0.0, 0.4) if i in cancelled else None
        planned.append(Planned(i, prompt, rng.randint(*max_tokens), cancel))
    return planned


async def _one(client: httpx.AsyncClient, url: str, req: Planned, timeout_s: float) -> Outcome:
    body = {"prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0, "stream": True}
    outcome = Outcome(req.index, "ok")
    started = time.monotonic()

    async def stream() -> None:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                outcome.kind, outcome.error = "error", (await response.aread()).decode()[:300]
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    outcome.kind, outcome.error = "error", str(event["error"])[:300]
                    return
                text = event["choices"][0].get("text")
                if text:
                    outcome.text += text
                    outcome.output_chunks += 1
                    if outcome.ttft_s is None:
                        outcome.ttft_s = time.monotonic() - started

    limit = req.cancel_after_s if req.cancel_after_s is not None else timeout_s
    try:
        await asyncio.wait_for(stream(), limit)  # on timeout the connection is closed: a cancel
    except asyncio.TimeoutError:
        if req.cancel_after_s is not None:
            outcome.kind = "cancelled"
        else:
            outcome.kind, outcome.error = "error", f"no answer within {timeout_s:g}s"
    except httpx.HTTPError as error:
        outcome.kind, outcome.error = "error", repr(error)
    if req.cancel_after_s is not None and outcome.kind == "ok":
        outcome.kind = "cancelled_late"  # finished before the client gave up
    outcome.total_s = time.monotonic() - started
    return outcome


@dataclass
class RunResult:
    outcomes: list[Outcome]
    wall_s: float
    timed_out: bool = False
    extra: dict[str, float] = field(default_factory=dict)

    def count(self, kind: str) -> int:
        return sum(1 for o in self.outcomes if o.kind == kind)

    def ttfts(self) -> list[float]:
        return sorted(o.ttft_s for o in self.outcomes if o.kind == "ok" and o.ttft_s is not None)

    def summary(self) -> dict[str, float]:
        ttfts = self.ttfts()
        done = self.count("ok") + self.count("cancelled_late")
        return {
            "requests": float(len(self.outcomes)),
            "ok": float(self.count("ok")),
            "cancelled": float(self.count("cancelled")),
            "cancelled_after_finishing": float(self.count("cancelled_late")),
            "errors": float(self.count("error")),
            "wall_s": self.wall_s,
            "throughput_rps": done / self.wall_s if self.wall_s > 0 else 0.0,
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99),
            "ttft_mean_s": statistics.fmean(ttfts) if ttfts else float("nan"),
            **self.extra,
        }


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    rank = math.ceil(q / 100 * len(sorted_values))  # nearest rank, 1-based
    return sorted_values[min(len(sorted_values), max(1, rank)) - 1]


async def run_load(url: str, planned: list[Planned], concurrency: int, time_limit_s: float,
                   request_timeout_s: float = 60.0, rate_rps: float | None = None,
                   progress: Callable[[str], None] = print, report_every: int = 50,
                   on_outcome: Callable[[Outcome], None] | None = None) -> RunResult:
    """Send `planned` with at most `concurrency` in flight (optionally paced at `rate_rps`);
    stop launching new requests after `time_limit_s`. `on_outcome` sees each request end."""
    started = time.monotonic()
    outcomes: list[Outcome] = []
    gate = asyncio.Semaphore(concurrency)
    timed_out = False
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=5.0), limits=limits) as client:

        async def guarded(req: Planned) -> None:
            try:
                outcomes.append(await _one(client, url, req, request_timeout_s))
                if on_outcome is not None:
                    on_outcome(outcomes[-1])
            finally:
                gate.release()
            if len(outcomes) % report_every == 0:
                elapsed = time.monotonic() - started
                errors = sum(1 for o in outcomes if o.kind == "error")
                progress(f"  {len(outcomes)}/{len(planned)} done in {elapsed:.0f}s "
                         f"({len(outcomes) / elapsed:.1f} req/s, {errors} errors)")

        tasks = []
        for k, req in enumerate(planned):
            if time.monotonic() - started > time_limit_s:
                timed_out = True
                progress(f"  time limit {time_limit_s:g}s reached after launching {k} requests")
                break
            if rate_rps:
                await asyncio.sleep(max(0.0, started + k / rate_rps - time.monotonic()))
            await gate.acquire()
            tasks.append(asyncio.create_task(guarded(req)))
        await asyncio.gather(*tasks)
    return RunResult(sorted(outcomes, key=lambda o: o.index), time.monotonic() - started, timed_out)
