"""`kvlink bench load` planning and figures: the same seed sends the same load; p99 is nearest-rank."""

from __future__ import annotations

from kvlink.bench.load import Outcome, RunResult, percentile, plan_requests


def test_plan_is_seeded_mixed_and_cancels_the_requested_fraction() -> None:
    planned = plan_requests(500, seed=3, cancel_fraction=0.1)
    assert planned == plan_requests(500, seed=3, cancel_fraction=0.1)
    assert planned != plan_requests(500, seed=4, cancel_fraction=0.1)
    assert sum(p.cancel_after_s is not None for p in planned) == 50
    lengths = sorted(len(p.prompt.split()) for p in planned)
    assert lengths[0] < 10 and lengths[-1] > 150  # short and long prompts both present
    assert all(4 <= p.max_tokens <= 16 for p in planned)
    assert len({p.prompt for p in planned}) == 500  # no accidental prefix-cache replays


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([7.0], 99) == 7.0


def test_summary_counts_only_uncancelled_failures_as_errors() -> None:
    result = RunResult([Outcome(0, "ok", ttft_s=0.5), Outcome(1, "cancelled"),
                        Outcome(2, "error", error="boom"), Outcome(3, "cancelled_late", ttft_s=0.2)], 2.0)
    summary = result.summary()
    assert (summary["ok"], summary["cancelled"], summary["errors"]) == (1.0, 1.0, 1.0)
    assert summary["throughput_rps"] == 1.0  # ok + finished-before-cancel, per second
    assert summary["ttft_p50_s"] == 0.5
