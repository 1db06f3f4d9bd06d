"""Prometheus text for the server and the proxy: counters, gauges and latency histograms.

Kept dependency-free and per-instance (no global registry), so several apps can live
in one test process without their figures mixing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from kvlink.connector.stats import prom_label, prom_number

LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{key}="{prom_label(value)}"' for key, value in sorted(labels.items()))
    return "{" + inner + "}"


class Histogram:
    """Cumulative-bucket histogram, rendered in the Prometheus exposition format."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.total += value
        for index, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[index] += 1

    def render(self, name: str) -> list[str]:
        lines = [f"# TYPE {name} histogram"]
        for edge, count in zip(self.buckets, self.counts, strict=True):
            lines.append(f'{name}_bucket{{le="{prom_number(edge)}"}} {count}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {prom_number(self.total)}")
        lines.append(f"{name}_count {self.count}")
        return lines


class MetricsRegistry:
    """Named counters and histograms under one prefix; thread-safe, render-on-demand.

    `gauges` are callables read at render time, so a value such as the queue length
    is never stale. `fragments` return ready Prometheus text (e.g. the connector's
    `PrometheusExporter.render`) appended as they are.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._histograms: dict[str, Histogram] = {}
        self.gauges: dict[str, Callable[[], float]] = {}
        self.fragments: list[Callable[[], str]] = []

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._counters[key] = self._counters.get(key, 0.0) + amount

    def counter(self, name: str, **labels: str) -> float:
        with self._lock:
            return self._counters.get((name, tuple(sorted(labels.items()))), 0.0)

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            histogram = self._histograms.setdefault(name, Histogram())
            histogram.observe(value)

    def histogram(self, name: str) -> Histogram:
        with self._lock:
            return self._histograms.setdefault(name, Histogram())

    def render(self) -> str:
        lines: list[str] = []
        with self._lock:
            typed: set[str] = set()
            for (name, labels), value in sorted(self._counters.items()):
                full = f"{self.prefix}_{name}"
                if full not in typed:
                    lines.append(f"# TYPE {full} counter")
                    typed.add(full)
                lines.append(f"{full}{_labels(dict(labels))} {prom_number(value)}")
            for name, histogram in sorted(self._histograms.items()):
                lines += histogram.render(f"{self.prefix}_{name}")
        for name, read in sorted(self.gauges.items()):
            full = f"{self.prefix}_{name}"
            lines += [f"# TYPE {full} gauge", f"{full} {prom_number(read())}"]
        text = "\n".join(lines) + "\n"
        for fragment in self.fragments:
            text += fragment()
        return text


def render_stats_gauges(prefix: str, stats: Mapping[str, object]) -> str:
    """Numeric engine stats as gauges; a dict or list of numbers (e.g. free blocks per group)
    becomes one gauge with a `key` label (the dict key or the list index)."""
    lines: list[str] = []
    for name, value in sorted(stats.items()):
        full = f"{prefix}_{name}"
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, (int, float)):
            lines += [f"# TYPE {full} gauge", f"{full} {prom_number(value)}"]
        elif isinstance(value, (Mapping, list, tuple)):
            items = value.items() if isinstance(value, Mapping) else enumerate(value)
            numeric = {k: v for k, v in items if isinstance(v, (int, float))}
            if numeric:
                lines.append(f"# TYPE {full} gauge")
                lines += [f'{full}{{key="{prom_label(str(k))}"}} {prom_number(v)}' for k, v in sorted(numeric.items(), key=str)]
    return "\n".join(lines) + "\n" if lines else ""
