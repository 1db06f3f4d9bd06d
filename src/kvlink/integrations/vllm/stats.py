"""kvlink's transfer figures on vLLM's connector-stats path: the "KV Transfer metrics" log
line (`reduce`) and Prometheus (`KvlinkPromMetrics`). The payload is plain data (msgpack)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

# Per-transfer series, and the kvlink counters forwarded as vLLM counters.
SERIES = ("xfer_s", "post_s", "bytes", "descriptors")
COUNTERS = ("failed_transfers_total", "stalled_transfers_total", "failed_handshakes_total",
            "failed_notifications_total", "expired_leases_total", "refused_peers_total",
            "notify_only_total", "bad_notifications_total")


def empty_data() -> dict[str, Any]:
    return {**{k: [] for k in SERIES}, "counters": {}}


def from_worker_snapshot(snapshot: dict[str, Any], previous: dict[str, int]) -> dict[str, Any]:
    """One worker's `get_stats()` (cumulative counters) → a delta payload; updates `previous`."""
    data = empty_data()
    for t in snapshot.get("transfers", []):
        data["xfer_s"].append(float(t["duration_s"]))
        data["post_s"].append(float(t.get("post_s", 0.0)))
        data["bytes"].append(int(t["nbytes"]))
        data["descriptors"].append(int(t["descriptors"]))
    counters = snapshot.get("counters", {})
    for key in COUNTERS:
        now = int(counters.get(key, 0))
        delta = now - previous.get(key, 0)
        previous[key] = now
        if delta > 0:
            data["counters"][key] = delta
    return data


@dataclass
class KvlinkStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.data = empty_data()

    def reset(self) -> None:
        self.data = empty_data()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for key in SERIES:
                self.data[key] = list(self.data.get(key, [])) + list(other.data.get(key, []))
            mine = self.data.setdefault("counters", {})
            for key, value in other.data.get("counters", {}).items():
                mine[key] = mine.get(key, 0) + value
        return self

    def is_empty(self) -> bool:
        return not self.data.get("xfer_s") and not any(self.data.get("counters", {}).values())

    def reduce(self) -> dict[str, int | float]:
        xfer = np.asarray(self.data.get("xfer_s", []), dtype=np.float64) * 1e3
        nbytes = np.asarray(self.data.get("bytes", []), dtype=np.float64)
        descs = np.asarray(self.data.get("descriptors", []), dtype=np.float64)
        counters = self.data.get("counters", {})
        out: dict[str, int | float] = {"Num successful transfers": int(xfer.size)}
        if xfer.size:
            total_s = float(xfer.sum()) / 1e3
            out.update({
                "Avg xfer time (ms)": round(float(xfer.mean()), 3),
                "P90 xfer time (ms)": round(float(np.percentile(xfer, 90)), 3),
                "Avg post time (ms)": round(float(np.mean(self.data.get("post_s") or [0.0])) * 1e3, 3),
                "Avg MB per transfer": round(float(nbytes.mean()) / 1e6, 3),
                "Throughput (MB/s)": round(float(nbytes.sum()) / 1e6 / total_s, 1) if total_s > 0 else 0.0,
                "Avg number of descriptors": round(float(descs.mean()), 1),
            })
        out["Num failed transfers"] = int(counters.get("failed_transfers_total", 0))
        out["Num stalled transfers"] = int(counters.get("stalled_transfers_total", 0))
        out["Num expired leases"] = int(counters.get("expired_leases_total", 0))
        return out


class KvlinkPromMetrics(KVConnectorPromMetrics):
    """`vllm:kvlink_*` histograms per transfer and counters for kvlink's failure counters."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def histogram(name: str, doc: str, buckets: list[float]) -> dict[int, Any]:
            metric = self._histogram_cls(name=name, documentation=doc, buckets=buckets, labelnames=labelnames)
            return create_metric_per_engine(metric, per_engine_labelvalues)

        self.xfer = histogram("vllm:kvlink_xfer_time_seconds", "kvlink KV transfer time per request load.",
                              [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0])
        self.post = histogram("vllm:kvlink_post_time_seconds",
                              "kvlink time inside NIXL's post of each request load (the copy, on CMA).",
                              [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0])
        self.bytes = histogram("vllm:kvlink_bytes_transferred", "kvlink KV bytes per request load.",
                               [float(2 ** (10 + i)) for i in range(1, 25, 2)])
        self.descs = histogram("vllm:kvlink_num_descriptors", "kvlink NIXL descriptors per request load.",
                               [10.0, 100.0, 1000.0, 10000.0, 100000.0, 1000000.0])
        self.counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=f"vllm:kvlink_{key}", documentation=f"kvlink {key.replace('_', ' ')}.",
                                  labelnames=labelnames), per_engine_labelvalues)
            for key in COUNTERS
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for family, key in ((self.xfer, "xfer_s"), (self.post, "post_s"), (self.bytes, "bytes"),
                            (self.descs, "descriptors")):
            for value in transfer_stats_data.get(key, []):
                family[engine_idx].observe(value)
        for key, value in transfer_stats_data.get("counters", {}).items():
            if key in self.counters and value > 0:
                self.counters[key][engine_idx].inc(value)
