"""What `kvlink bench vllm` measures on its servers besides the client: the connector's
transfer figures from the difference of D's `/metrics` around a run, and idle CPU from /proc."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import httpx

from kvlink.procs.launcher import Service

# Connector -> prefix of its metrics on D's /metrics.
METRIC_PREFIX = {"nixl": "vllm:nixl_", "kvlink": "vllm:kvlink_"}


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value, summed over label sets; comments and unparsable lines skipped."""
    values: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            _, _, rest = rest.rpartition("}")
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not name or not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isnan(value):
            continue
        values[name] = values.get(name, 0.0) + value
    return values


def metric_delta(before: dict[str, float], after: dict[str, float], prefix: str) -> dict[str, float]:
    """after - before for every sample whose name starts with `prefix` (bucket lines left out)."""
    names = {n for n in (*before, *after) if n.startswith(prefix) and not n.endswith("_bucket")
             and not n.endswith("_created")}
    return {n[len(prefix):]: after.get(n, 0.0) - before.get(n, 0.0) for n in sorted(names)}


def transfer_summary(delta: dict[str, float]) -> dict[str, float | None]:
    """Transfers, KV MB and transfer ms per transfer, failures, from one connector's deltas."""
    count = delta.get("xfer_time_seconds_count", 0.0)
    bytes_count = delta.get("bytes_transferred_count", 0.0)
    failures = sum(v for k, v in delta.items() if "fail" in k and not k.endswith(("_sum", "_count")))
    return {
        "transfers": count,
        "kv_mb_per_transfer": (delta.get("bytes_transferred_sum", 0.0) / bytes_count / 1e6
                               if bytes_count else None),
        "transfer_ms": delta.get("xfer_time_seconds_sum", 0.0) / count * 1e3 if count else None,
        "failures": failures,
    }


def scrape(url: str) -> dict[str, float]:
    response = httpx.get(url + "/metrics", timeout=10.0)
    response.raise_for_status()
    return parse_prometheus(response.text)


def kv_bytes_total(url: str, prefix: str) -> float | None:
    """The connector's cumulative KV bytes on a server (None when /metrics cannot be read)."""
    try:
        return scrape(url).get(prefix + "bytes_transferred_sum", 0.0)
    except Exception:
        return None


def _proc_tree(pid: int) -> list[int]:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root.pid, *(c.pid for c in root.children(recursive=True))]
    except psutil.Error:
        return []


def _cpu_ticks(pid: int) -> tuple[str, int] | None:
    """(name, utime+stime in clock ticks) of one process, from /proc/<pid>/stat."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()
    return name, int(fields[11]) + int(fields[12])


def _role_of(name: str, cmdline: str) -> str:
    if "Worker" in name or "Worker" in cmdline:
        return "worker"
    if "EngineCore" in name or "EngineCore" in cmdline:
        return "engine_core"
    if "vllm.entrypoints" in cmdline or name.startswith("python"):
        return "api"
    return "other"


def idle_cpu(servers: dict[str, Service], seconds: float) -> dict[str, dict[str, Any]]:
    """% of one core used by each process of each server while no request runs.

    vLLM's CPU engine with TP 1 runs the model worker inside the EngineCore process, so
    `worker_pct` is that of a process named like a worker if there is one, else EngineCore's.
    """
    tick = os.sysconf("SC_CLK_TCK")
    pids = {role: _proc_tree(s.proc.pid) for role, s in servers.items()}
    start = {pid: _cpu_ticks(pid) for ps in pids.values() for pid in ps}
    t0 = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - t0
    out: dict[str, dict[str, Any]] = {}
    for role, ps in pids.items():
        procs: list[dict[str, Any]] = []
        for pid in ps:
            a, b = start.get(pid), _cpu_ticks(pid)
            if a is None or b is None:
                continue
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmdline = ""
            pct = (b[1] - a[1]) / tick / elapsed * 100.0
            procs.append({"pid": pid, "name": b[0], "role": _role_of(b[0], cmdline), "pct": round(pct, 3)})
        by_role: dict[str, float] = {}
        for p in procs:
            by_role[p["role"]] = by_role.get(p["role"], 0.0) + p["pct"]
        worker = by_role.get("worker", by_role.get("engine_core"))
        out[role] = {"worker_pct": worker, "engine_core_pct": by_role.get("engine_core"),
                     "api_pct": by_role.get("api"), "total_pct": sum(by_role.values()),
                     "processes": procs}
    return out
