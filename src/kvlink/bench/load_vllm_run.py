"""The run of `kvlink bench load --engine vllm`: reference, load, a killed P, checks, memory curve.

1. The requests are planned up front (`load.plan_requests`: mixed prompt lengths, some
   cancelled by the client mid-stream), and vLLM colocated (same flags, no connector)
   answers each of them in full first: the greedy reference. It starts together with the
   fleet where memory allows, and stops before the load.
2. The load streams them through vllm-router (`load.run_load`). Half way, one P is killed
   (SIGKILL of its process group) and started again on the same ports; the last requests
   wait until vllm-router has it back in rotation, so they show whether it takes traffic.
3. Every answer that completed must equal the reference, and every cancelled stream's text
   must be a prefix of it. The only errors allowed are client cancels and requests in
   flight between the kill and one health-check interval after vllm-router took the P out.
4. Afterwards every instance must be idle: vLLM's KV usage and running or waiting requests
   at 0, kvlink's worker holding no lease, load, transfer or handshake.

The RSS of every process (each server's API server, engine core and worker, the router)
is sampled over the run (`memory_series`) and drawn with the kill and restart marked.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from kvlink.bench import memory_series
from kvlink.bench.load import Outcome, Planned, percentile, plan_requests, run_load
from kvlink.bench.load_vllm import Fleet, FleetConfig
from kvlink.procs.launcher import Progress, Service, stop_all

SERVER_GIB = 3.6  # one vLLM server here, measured: API server, engine core, worker with 1 GiB of KV
MARGIN_GIB = 2.5
REQUEST_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class LoadPlan:
    requests: int = 300
    concurrency: int = 6
    cancel_fraction: float = 0.1
    max_prompt_words: int = 300
    seed: int = 0
    kill: str | None = "prefill0"  # the P killed half way (None: no fault)
    tail_fraction: float = 0.1  # sent once the killed P is back in rotation
    time_limit_s: float = 1800.0
    memory_interval_s: float = 2.0


@dataclass
class Events:
    """When the fault happened, on the monotonic clock, and what the restart thread saw."""

    kill_t: float | None = None
    out_t: float | None = None  # vllm-router marked the killed P unhealthy
    ready_t: float | None = None  # the restarted P served its model
    back_t: float | None = None  # vllm-router had it healthy again
    killed_pid: int | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2 ** 20
    return 0.0


def reference_texts(url: str, planned: list[Planned], concurrency: int, progress: Progress) -> dict[int, str]:
    """Each planned request's whole greedy answer from vLLM colocated (nobody cancels here)."""
    whole = [replace(p, cancel_after_s=None) for p in planned]
    result = asyncio.run(run_load(url, whole, concurrency, 3600.0, REQUEST_TIMEOUT_S, progress=progress,
                                  report_every=100))
    failed = [o for o in result.outcomes if o.kind != "ok"]
    if failed:
        raise RuntimeError(f"colocated reference: {len(failed)} of {len(whole)} failed, first: {failed[0]}")
    progress(f"  reference: {len(whole)} answers in {result.wall_s:.0f}s")
    return {o.index: o.text for o in result.outcomes}


def start_all(fleet: Fleet, planned: list[Planned], concurrency: int, progress: Progress) -> dict[int, str]:
    """Reference answers, then the fleet up: started together when memory allows."""
    servers = len(fleet.instances) + 1
    together = mem_available_gib() > servers * SERVER_GIB + MARGIN_GIB
    progress(f"starting {'colocated and the fleet together' if together else 'colocated first, then the fleet'}"
             f" ({mem_available_gib():.1f} GiB available)")
    reference = fleet.launch_reference(fleet.config.decode_core)
    fleet_services = [fleet.launch(i) for i in fleet.instances] if together else []
    try:
        fleet.wait([reference])
        texts = reference_texts(reference.url, planned, concurrency, progress)
    finally:
        stop_all([reference], timeout_s=20.0)
    fleet_services = fleet_services or [fleet.launch(i) for i in fleet.instances]
    fleet.wait(fleet_services)
    return texts


class FleetSampler(memory_series.MemorySampler):
    """Samples the fleet's processes as they are now: a killed server's read 0, a restarted
    one's are picked up as it starts them."""

    def __init__(self, fleet: Fleet, requests: Callable[[], int], interval_s: float) -> None:
        super().__init__(fleet.pids(), {}, requests, interval_s)
        self.fleet = fleet

    def sample(self, client: httpx.Client) -> memory_series.Sample:
        # Values only, never keys: the series keep one name per process role.
        for key, pid in self.fleet.pids().items():
            if key in self.pids:
                self.pids[key] = pid
        return super().sample(client)


def fault(fleet: Fleet, name: str, events: Events, progress: Progress) -> None:
    """Kill `name`, wait for vllm-router to take it out, start it again, wait until it is back."""
    try:
        inst = fleet.instance(name)
        events.kill_t = time.monotonic()
        events.killed_pid = fleet.kill(name)
        progress(f"  killed {name} (SIGKILL, PID {events.killed_pid})")
        events.out_t = fleet.wait_health(lambda h: not h[inst.url], 60, f"vllm-router taking {name} out")
        progress(f"  vllm-router took {name} out {events.out_t - events.kill_t:.1f}s after the kill; restarting")
        fleet.wait([fleet.launch(inst)])
        events.ready_t = time.monotonic()
        events.back_t = fleet.wait_health(lambda h: h[inst.url], 60, f"vllm-router taking {name} back")
        progress(f"  {name} back in vllm-router {events.back_t - events.kill_t:.1f}s after the kill")
    except Exception as error:  # reported in the summary; the load goes on
        events.error = f"{type(error).__name__}: {error}"
        progress(f"  fault: {events.error[:300]}")
    finally:
        events.done.set()


def check(outcomes: list[Outcome], ends: dict[int, float], reference: dict[int, str], events: Events,
          interval_s: float) -> dict[str, Any]:
    """Wrong answers and errors outside the window around the kill."""
    window: tuple[float, float] | None = None
    if events.kill_t is not None:
        out = events.out_t if events.out_t is not None else events.kill_t + 30.0
        window = (events.kill_t, out + interval_s + 1.0)
    wrong: list[dict[str, Any]] = []
    not_prefix: list[dict[str, Any]] = []
    allowed: list[dict[str, Any]] = []
    unexpected: list[dict[str, Any]] = []
    for o in outcomes:
        if o.kind in ("ok", "cancelled_late"):
            if o.text != reference[o.index]:
                wrong.append({"index": o.index, "got": o.text, "expected": reference[o.index]})
        elif o.kind == "cancelled":
            if not reference[o.index].startswith(o.text):
                not_prefix.append({"index": o.index, "got": o.text, "expected": reference[o.index]})
        elif o.kind == "error":
            end = ends[o.index]
            inside = window is not None and end - o.total_s <= window[1] and end >= window[0]
            (allowed if inside else unexpected).append({"index": o.index, "error": (o.error or "")[:300]})
    return {"wrong": wrong, "cancelled_not_prefix": not_prefix, "errors_in_kill_window": allowed,
            "errors_unexpected": unexpected,
            "kill_window_s": [w - events.kill_t for w in window] if window and events.kill_t else None}


def run_fleet_bench(config: FleetConfig, plan: LoadPlan, progress: Progress = print,
                    memory_json: Path | None = None, memory_plot: Path | None = None) -> dict[str, Any]:
    planned = plan_requests(plan.requests, plan.seed, plan.cancel_fraction, plan.max_prompt_words)
    tail = round(plan.requests * plan.tail_fraction) if plan.kill else 0
    main, last = planned[:len(planned) - tail], planned[len(planned) - tail:]
    progress(f"{len(planned)} requests ({sum(p.cancel_after_s is not None for p in planned)} to be cancelled), "
             f"concurrency {plan.concurrency}" + (f"; {plan.kill} killed after {len(main) // 2}, the last {tail} "
                                                  "sent once it is back" if plan.kill else ""))
    fleet = Fleet(config, progress)
    started = time.monotonic()
    try:
        reference = start_all(fleet, planned, plan.concurrency, progress)
        fleet.start_router()
        progress(f"fleet and vllm-router up in {time.monotonic() - started:.0f}s: " + ", ".join(
            f"{i.name} block {i.block_size} core {i.core}" for i in fleet.instances))
        return _run(fleet, plan, main, last, reference, progress, memory_json, memory_plot)
    finally:
        fleet.stop()


def _run(fleet: Fleet, plan: LoadPlan, main: list[Planned], last: list[Planned], reference: dict[int, str],
         progress: Progress, memory_json: Path | None, memory_plot: Path | None) -> dict[str, Any]:
    ends: dict[int, float] = {}
    events = Events()
    sampler = FleetSampler(fleet, lambda: len(ends), plan.memory_interval_s)
    kill_after = len(main) // 2

    def on_outcome(o: Outcome) -> None:
        ends[o.index] = time.monotonic()
        if plan.kill and len(ends) == kill_after:
            threading.Thread(target=fault, args=(fleet, plan.kill, events, progress), daemon=True).start()

    assert fleet.router is not None
    router: Service = fleet.router
    sampler.start()
    load_started = time.monotonic()
    try:
        result = asyncio.run(run_load(router.url, main, plan.concurrency, plan.time_limit_s, REQUEST_TIMEOUT_S,
                                      progress=progress, report_every=max(10, len(main) // 10), on_outcome=on_outcome))
        outcomes, timed_out, main_wall_s = list(result.outcomes), result.timed_out, result.wall_s
        if plan.kill:
            if not events.done.wait(fleet.config.ready_timeout_s + 180):
                events.error = events.error or "the restart did not finish"
            served_before = fleet.counters(fleet.instance(plan.kill))["vllm_requests_finished"]
            progress(f"  sending the last {len(last)} requests")
            result = asyncio.run(run_load(router.url, last, plan.concurrency, plan.time_limit_s, REQUEST_TIMEOUT_S,
                                          progress=progress, on_outcome=on_outcome))
            outcomes += result.outcomes
            timed_out = timed_out or result.timed_out
        wall_s = time.monotonic() - load_started
        progress("waiting for every instance to be idle")
        idle_s, still_held = fleet.wait_idle(fleet.config.lease_s + 45)
    finally:
        sampler.stop()
    summary: dict[str, Any] = {"requests": len(outcomes), "concurrency": plan.concurrency, "wall_s": wall_s,
                               "timed_out": timed_out}
    for kind in ("ok", "cancelled", "cancelled_late", "error"):
        summary[kind] = sum(o.kind == kind for o in outcomes)
    ttfts = sorted(o.ttft_s for o in outcomes if o.kind == "ok" and o.ttft_s is not None)
    completed_main = sum(o.kind in ("ok", "cancelled_late") for o in outcomes[:len(main)])
    summary.update({"ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
                    "main_wall_s": main_wall_s, "main_completed_per_s": completed_main / main_wall_s,
                    "verify_kv": fleet.config.verify_kv or "sample (default)"})
    summary.update(check(outcomes, ends, reference, events, fleet.config.health_check_interval_s))
    summary["idle_after_s"], summary["held_after"] = idle_s, still_held
    summary["counters"] = {i.name: fleet.counters(i) for i in fleet.instances}
    if plan.kill:
        summary["fault"] = _fault_figures(events, plan.kill)
        summary["fault"]["killed_at_s"] = None if events.kill_t is None else events.kill_t - load_started
        summary["fault"]["restarted_served"] = (summary["counters"][plan.kill]["vllm_requests_finished"]
                                                - served_before)
    summary["memory"] = memory_figures(sampler.samples)
    if memory_json:
        memory_series.write_json(sampler.samples, memory_json)
    if memory_plot and sampler.samples:
        from kvlink.bench.load_vllm_plot import plot

        plot(sampler.samples, {"kill_t": events.kill_t, "ready_t": events.ready_t, "back_t": events.back_t},
             load_started, memory_plot,
             f"kvlink bench load --engine vllm --requests {plan.requests} --concurrency {plan.concurrency}"
             f"{'' if fleet.config.verify_kv is None else ' --verify-kv ' + fleet.config.verify_kv}: "
             f"{len(fleet.roles('prefill'))} P + {len(fleet.roles('decode'))} D behind vllm-router")
    summary["passed"] = passed(summary, plan)
    return summary


def memory_figures(samples: list[memory_series.Sample]) -> dict[str, float]:
    """RSS first, last and peak per process in MiB, and the peak of their sum in GiB (a short
    run with a killed process has no growth rate worth quoting)."""
    if not samples:
        return {}
    out = {k: v for k, v in memory_series.figures(samples).items() if k.endswith(("_first", "_last", "_peak"))}
    out["all_rss_gib_peak"] = max(sum(s.rss_kib.values()) for s in samples) / 2 ** 20
    return out


def _fault_figures(events: Events, name: str) -> dict[str, Any]:
    def since(t: float | None) -> float | None:
        return None if t is None or events.kill_t is None else t - events.kill_t

    return {"killed": name, "pid": events.killed_pid, "out_after_s": since(events.out_t),
            "ready_after_s": since(events.ready_t), "back_after_s": since(events.back_t), "error": events.error}


def passed(summary: dict[str, Any], plan: LoadPlan) -> bool:
    ok = not (summary["wrong"] or summary["cancelled_not_prefix"] or summary["errors_unexpected"]
              or summary["held_after"] or summary["timed_out"])
    if plan.kill:
        fault_seen = summary["fault"]
        ok = ok and fault_seen["error"] is None and fault_seen["restarted_served"] > 0
    return ok and not any(c["kv_checksum_mismatch_total"] for c in summary["counters"].values())
