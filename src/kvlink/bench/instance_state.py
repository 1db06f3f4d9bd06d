"""What a running instance still holds, and its metrics: leak checks for benches and tests.

`leaks()` reads `/debug/state` of an instance and names everything still held: busy
blocks, leases, loads in flight, open transfers; `wait_clean()` polls until nothing is.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

import httpx

from kvlink.procs.launcher import Service


def leaks(state: dict[str, Any], num_blocks: int) -> list[str]:
    """What an idle instance still holds, from its `/debug/state`; empty when clean."""
    engine = state.get("engine", {})
    found = []
    if state.get("in_flight"):
        found.append(f"{state['in_flight']} requests in flight")
    for name in ("running", "waiting", "waiting_for_remote_kv", "held_requests"):
        if engine.get(name):
            found.append(f"{name}={engine[name]}")
    free = engine.get("free_blocks", [])
    if any(f != num_blocks for f in free):
        found.append(f"free blocks {free}, expected {num_blocks} per group")
    connector = engine.get("connector") or {}
    for name in ("leases", "loads_in_flight", "open_transfers", "waiting_for_handshake"):
        if connector.get(name):
            found.append(f"{name}={connector[name]}")
    return found


def metric(url: str, name: str, label: str = "") -> float:
    """Sum of every sample in `url`/metrics of the Prometheus metrics whose name ends with `name`
    (and, if given, whose labels include `label`, e.g. `outcome="abort"`)."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if match and match.group(1).endswith(name) and label in (match.group(2) or ""):
            total += float(match.group(3))
    return total


def wait_clean(urls: Sequence[str], num_blocks: int, timeout_s: float) -> dict[str, float]:
    """Poll each instance's `/debug/state` until nothing is held; returns seconds until clean.

    Raises AssertionError naming what is still held at the deadline.
    """
    started = time.monotonic()
    took: dict[str, float] = {}
    last: dict[str, list[str]] = {}
    with httpx.Client(timeout=5.0) as client:
        while True:
            for url in urls:
                if url in took:
                    continue
                try:
                    found = leaks(client.get(url + "/debug/state").json(), num_blocks)
                except httpx.HTTPError as error:
                    found = [f"/debug/state unreachable: {error!r}"]
                if found:
                    last[url] = found
                else:
                    took[url] = time.monotonic() - started
            if len(took) == len(urls):
                return took
            if time.monotonic() - started > timeout_s:
                held = {u: last.get(u) for u in urls if u not in took}
                raise AssertionError(f"instances still hold state after {timeout_s:.0f}s: {held}")
            time.sleep(0.1)


def tails(services: Sequence[Service], lines: int = 8) -> str:
    """The last log lines of each service, for error reports."""
    return "\n".join(f"--- {s.name} ({s.log_path}):\n{s.log_tail(lines)}" for s in services)
