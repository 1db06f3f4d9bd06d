"""Memory of a soak's processes over time: a sampler thread, the figures a report quotes, the curve.

Every `interval_s` it reads each process's RSS from /proc and, for the servers,
`/debug/memory` (glibc heap in use and free-but-held), so a curve can tell a leak
(in use grows) from an allocator that keeps what was freed (only free-but-held grows).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvlink.serve.memory import rss_kib


@dataclass
class Sample:
    t_s: float  # since the sampler started
    requests: int  # finished requests at that time
    rss_kib: dict[str, int]
    malloc_kib: dict[str, dict[str, int]] = field(default_factory=dict)  # servers only


class MemorySampler:
    """Samples `pids` (name -> pid) and the `/debug/memory` of `urls` (name -> base URL)."""

    def __init__(self, pids: dict[str, int], urls: dict[str, str], requests: Callable[[], int],
                 interval_s: float = 5.0) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.pids, self.urls, self.requests, self.interval_s = pids, urls, requests, interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvlink-memory-sampler", daemon=True)
        self._started = 0.0

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def sample(self, client: httpx.Client) -> Sample:
        malloc: dict[str, dict[str, int]] = {}
        for name, url in self.urls.items():
            try:
                found = client.get(url + "/debug/memory").json().get("malloc_kib")
            except (httpx.HTTPError, ValueError):
                found = None  # busy or gone: RSS is still worth a point
            if found:
                malloc[name] = found
        return Sample(time.monotonic() - self._started, self.requests(),
                      {name: rss_kib(pid) for name, pid in self.pids.items()}, malloc)

    def _run(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while True:
                self.samples.append(self.sample(client))
                if self._stop.wait(self.interval_s):
                    return


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x (nan with fewer than two distinct x)."""
    if len(points) < 2:
        return math.nan
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    var = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else math.nan


def figures(samples: list[Sample], window_min: float = 30.0) -> dict[str, float]:
    """Per process: RSS first/last/peak, and over the last `window_min` minutes its slope in
    MiB per hour and MiB per 1000 requests (a plateau is ~0 in both)."""
    if not samples:
        return {}
    end = samples[-1].t_s
    window = [s for s in samples if s.t_s >= end - window_min * 60]
    out: dict[str, float] = {"window_min": min(window_min, (end - window[0].t_s) / 60)}
    for name in samples[0].rss_kib:
        rss = [(s, s.rss_kib.get(name, 0) / 1024) for s in samples]
        out[f"{name}_rss_mib_first"] = rss[0][1]
        out[f"{name}_rss_mib_last"] = rss[-1][1]
        out[f"{name}_rss_mib_peak"] = max(v for _, v in rss)
        out[f"{name}_rss_mib_per_hour_window"] = slope(
            [(s.t_s / 3600, s.rss_kib.get(name, 0) / 1024) for s in window])
        out[f"{name}_rss_mib_per_1000_requests_window"] = 1000 * slope(
            [(float(s.requests), s.rss_kib.get(name, 0) / 1024) for s in window])
    return out


def write_json(samples: list[Sample], path: Path) -> None:
    import json

    path.write_text(json.dumps([asdict(s) for s in samples]) + "\n")


def plot(samples: list[Sample], path: Path, title: str) -> None:
    """RSS per process over minutes; below it, each server's malloc heap in use and free-but-held."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [s.t_s / 60 for s in samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for name in samples[0].rss_kib if samples else ():
        top.plot(minutes, [s.rss_kib.get(name, 0) / 1024 for s in samples], label=name)
    top.set_ylabel("RSS MiB")
    top.set_title(title)
    top.legend()
    servers = sorted({name for s in samples for name in s.malloc_kib})
    for name in servers:
        points = [(s.t_s / 60, s.malloc_kib[name]) for s in samples if name in s.malloc_kib]
        xs = [t for t, _ in points]
        bottom.plot(xs, [m["in_use"] / 1024 for _, m in points], label=f"{name}: malloc in use")
        bottom.plot(xs, [m["free_held"] / 1024 for _, m in points], "--", label=f"{name}: free, held")
    bottom.set_ylabel("glibc heap MiB")
    bottom.set_xlabel("minutes")
    if servers:
        bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
