"""A worker wrapper that feeds connector figures to Prometheus from the engine thread.

`get_stats()` may involve every TP rank, so it must run where the engine calls the
worker; the tap does it at most every `interval_s`, right after `get_finished()`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvlink.connector.api import ConnectorWorker, StepMetadata, WorkerOutput
from kvlink.connector.stats import PrometheusExporter


class StatsTap(ConnectorWorker):
    def __init__(self, inner: ConnectorWorker, exporter: PrometheusExporter, interval_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.inner, self.exporter, self.interval_s, self._clock = inner, exporter, interval_s, clock
        self._last = float("-inf")

    def register_kv_caches(self, base_addrs: Sequence[int], nbytes: Sequence[int]) -> None:
        self.inner.register_kv_caches(base_addrs, nbytes)

    def start_load_kv(self, metadata: StepMetadata) -> None:
        self.inner.start_load_kv(metadata)

    def layer_sink(self) -> Callable[..., None] | None:
        return self.inner.layer_sink()

    def get_finished(self) -> WorkerOutput:
        out = self.inner.get_finished()
        now = self._clock()
        # Any finish or failure refreshes the figures now: the engine may go idle right after
        # (no more steps), and /metrics would keep showing the counters from before it.
        news = out.transfer_figures or out.failed_recving or out.finished_sending
        if news or now - self._last >= self.interval_s:
            self._last = now
            self.exporter.update(self.inner.get_stats())
        return out

    def get_stats(self) -> dict[str, Any]:
        return self.inner.get_stats()

    def debug_state(self) -> dict[str, Any]:
        return self.inner.debug_state()

    def shutdown(self) -> None:
        self.exporter.update(self.inner.get_stats())
        self.inner.shutdown()
