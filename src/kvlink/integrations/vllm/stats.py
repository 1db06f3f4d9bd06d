"""kvlink's transfer figures on vLLM's connector-stats path: the "KV Transfer metrics" log
line (`reduce`) and Prometheus (`KvlinkPromMetrics`). The payload is plain data (msgpack)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

# Per-transfer series.
SERIES = ("xfer_s", "post_s", "bytes", "descriptors")
# kvlink counters forwarded as vLLM counters (`vllm:kvlink_<name>`), with their help text.
COUNTERS = {
    "failed_transfers_total": "kvlink loads whose READ/WRITE failed (peer gone or refused).",
    "stalled_transfers_total": "kvlink loads that made no progress before the stall deadline.",
    "failed_handshakes_total": "kvlink side-channel handshakes that failed.",
    "failed_notifications_total": "kvlink notifications to a peer that could not be sent.",
    "expired_leases_total": "kvlink requests P freed at lease expiry, before every decoder had read them.",
    "refused_peers_total": "kvlink peers refused at handshake (incompatible layout or model).",
    "notify_only_total": "kvlink loads with nothing to read (D held every block): P only told to free.",
    "bad_notifications_total": "kvlink notifications that could not be decoded.",
    "kv_checksum_mismatch_total": "kvlink loads whose KV did not match P's digests (the load failed).",
    "kv_verified_units_total": "kvlink KV units D hashed and found equal to P's digests.",
    "kv_verified_bytes_total": "kvlink KV bytes D hashed to check them.",
    "kv_digest_rereads_total": "kvlink digest slices D read again (P had not sealed them for this request yet).",
    "kv_early_seals_total": "kvlink requests P sealed right after the forward that completed their prefill.",
    "kv_unsealed_loads_total": "kvlink loads whose digests never matched the request's tokens (the load failed).",
    "kv_unverifiable_units_total": "kvlink KV units D received but could not check (not held whole).",
    "kv_unchecked_loads_total": "kvlink loads D left unchecked although it checks: their P keeps no digests.",
    "cancelled_loads_total": "kvlink push or layerwise loads D asked P to stop (the request ended first).",
    "cancelled_pushes_total": "kvlink pushes P stopped because D's request ended first.",
    "conv_relayout_bytes_total": "kvlink SSM conv-state bytes D re-laid out from its P's layout (DS/SD) into its own.",
    "staged_loads_total": "kvlink loads D read through its staging pages (P and D of different kernel block sizes).",
    "relayout_bytes_total": "kvlink KV bytes D copied from its staging pages into its own blocks.",
    "push_as_staged_pull_total": "kvlink pushes D turned into staged pulls (P's WRITE cannot re-lay out pages).",
}
# Levels right now, per worker (`get_stats()["gauges"]`); TP ranks hold the same requests and
# vLLM's (logical) block ids, so a step's value is the largest over its ranks.
GAUGES = {
    "pending_sends": "kvlink requests P holds for decoders right now (under lease).",
    "pending_send_blocks": "kvlink KV blocks P holds for decoders right now.",
    "loads_in_flight": "kvlink loads D has started and not finished.",
}
# Counters per remote engine (`get_stats()["engine_counters"]`), labelled `remote_engine`.
ENGINE_COUNTERS = {
    "handshakes_total": "kvlink side-channel handshakes, per remote engine.",
    "failed_handshakes_by_engine_total": "kvlink failed side-channel handshakes, per remote engine.",
}


def empty_data() -> dict[str, Any]:
    return {**{k: [] for k in SERIES}, "counters": {}, "engine_counters": [], "gauges": {}}


@dataclass
class Forwarded:
    """What one worker has forwarded so far: cumulative counters, and the gauge levels last sent."""

    counters: dict[str, int] = field(default_factory=dict)
    engine_counters: dict[tuple[str, str], int] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)


def from_worker_snapshot(snapshot: dict[str, Any], sent: Forwarded) -> dict[str, Any]:
    """One worker's `get_stats()` (cumulative counters, levels now) → a delta payload; updates
    `sent`. Gauges go along while any is not 0 or one changed, so that the largest over TP
    ranks is right in every step that carries them."""
    data = empty_data()
    for t in snapshot.get("transfers", []):
        data["xfer_s"].append(float(t["duration_s"]))
        data["post_s"].append(float(t.get("post_s", 0.0)))
        data["bytes"].append(int(t["nbytes"]))
        data["descriptors"].append(int(t["descriptors"]))
    counters = snapshot.get("counters", {})
    for key in COUNTERS:
        now = int(counters.get(key, 0))
        delta = now - sent.counters.get(key, 0)
        sent.counters[key] = now
        if delta > 0:
            data["counters"][key] = delta
    for name, engine, count in snapshot.get("engine_counters", []):
        if name not in ENGINE_COUNTERS:
            continue
        engine_key = (str(name), str(engine))
        delta = int(count) - sent.engine_counters.get(engine_key, 0)
        sent.engine_counters[engine_key] = int(count)
        if delta > 0:
            data["engine_counters"].append([engine_key[0], engine_key[1], delta])
    levels = {key: float(snapshot.get("gauges", {}).get(key, 0.0)) for key in GAUGES}
    if levels != sent.gauges or any(levels.values()):
        data["gauges"] = levels
        sent.gauges = levels
    return data


def carries_anything(data: dict[str, Any]) -> bool:
    return bool(data["xfer_s"] or data["counters"] or data["engine_counters"] or data["gauges"])


@dataclass
class KvlinkStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.data = empty_data()

    def reset(self) -> None:
        self.data = empty_data()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Sum series and counters (over TP ranks, or over the steps of a log interval); the
        largest level of each gauge."""
        for key in SERIES:
            self.data[key] = list(self.data.get(key, [])) + list(other.data.get(key, []))
        mine = self.data.setdefault("counters", {})
        for key, value in other.data.get("counters", {}).items():
            mine[key] = mine.get(key, 0) + value
        per_engine: dict[tuple[str, str], int] = {}
        for name, engine, n in [*self.data.get("engine_counters", []), *other.data.get("engine_counters", [])]:
            per_engine[(name, engine)] = per_engine.get((name, engine), 0) + int(n)
        self.data["engine_counters"] = [[name, engine, n] for (name, engine), n in per_engine.items()]
        levels = self.data.setdefault("gauges", {})
        for key, value in other.data.get("gauges", {}).items():
            levels[key] = max(levels.get(key, value), value)
        return self

    def is_empty(self) -> bool:
        # Gauges alone (P holding leases) are no reason for the "KV Transfer metrics" line.
        return (not self.data.get("xfer_s") and not any(self.data.get("counters", {}).values())
                and not self.data.get("engine_counters"))

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
        out["Num KV checksum mismatches"] = int(counters.get("kv_checksum_mismatch_total", 0))
        return out


class KvlinkPromMetrics(KVConnectorPromMetrics):
    """`vllm:kvlink_*`: histograms per transfer, kvlink's counters (failures, integrity), its
    gauges (what P holds for decoders), and handshakes per remote engine."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM types these as a union of prometheus classes; each is used as the one it is.
        histogram_cls: Any = self._histogram_cls
        counter_cls: Any = self._counter_cls
        gauge_cls: Any = self._gauge_cls

        def histogram(name: str, doc: str, buckets: list[float]) -> dict[int, Any]:
            metric = histogram_cls(name=name, documentation=doc, buckets=buckets, labelnames=labelnames)
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
        self.counters: dict[str, dict[int, Any]] = {
            key: create_metric_per_engine(
                counter_cls(name=f"vllm:kvlink_{key}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues)
            for key, doc in COUNTERS.items()
        }
        self.gauges: dict[str, dict[int, Any]] = {
            key: create_metric_per_engine(
                gauge_cls(name=f"vllm:kvlink_{key}", documentation=doc, multiprocess_mode="mostrecent",
                                labelnames=labelnames), per_engine_labelvalues)
            for key, doc in GAUGES.items()
        }
        self.engine_counters = {
            key: counter_cls(name=f"vllm:kvlink_{key}", documentation=doc,
                                   labelnames=[*labelnames, "remote_engine"])
            for key, doc in ENGINE_COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for family, key in ((self.xfer, "xfer_s"), (self.post, "post_s"), (self.bytes, "bytes"),
                            (self.descs, "descriptors")):
            for value in transfer_stats_data.get(key, []):
                family[engine_idx].observe(value)
        for key, value in transfer_stats_data.get("counters", {}).items():
            if key in self.counters and value > 0:
                self.counters[key][engine_idx].inc(value)
        for key, value in transfer_stats_data.get("gauges", {}).items():
            if key in self.gauges:
                self.gauges[key][engine_idx].set(value)
        labels = self.per_engine_labelvalues[engine_idx]
        for name, remote_engine, n in transfer_stats_data.get("engine_counters", []):
            if name in self.engine_counters and n > 0:
                self.engine_counters[name].labels(*labels, str(remote_engine)).inc(n)
