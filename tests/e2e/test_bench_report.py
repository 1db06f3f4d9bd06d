"""The serving benchmark's arithmetic and outputs (no servers): percentiles, TTFT shares, table, PNG."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest

from kvlink.bench.serve_bench import percentile, plot, summarize, table
from kvlink.bench.serve_client import Answer


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) == 0.0


def test_summary_splits_ttft_and_counts_throughput(tmp_path: Path) -> None:
    moved = Answer(ttft_s=0.5, chunk_times=[1.0, 1.1, 1.3], completion_tokens=3, kv_bytes=2048,
                   kv_transfer_s=0.05, decode_ttft_s=0.2, prefill_s=0.25)
    assert moved.inter_token_s == pytest.approx([0.1, 0.2])
    assert moved.split() == pytest.approx(
        {"prefill_s": 0.25, "kv_transfer_s": 0.05, "decode_s": 0.15, "other_s": 0.05})
    pd = summarize("1P1D", [moved, moved], wall_s=2.0)
    assert pd.kv_share_of_ttft == pytest.approx(0.1)
    assert pd.prefill_share_of_ttft == pytest.approx(0.5)
    assert pd.output_tokens_per_s == pytest.approx(3.0)
    assert pd.itl_p99_ms == pytest.approx(200.0)
    local = summarize("colocated", [Answer(ttft_s=0.3, chunk_times=[0.0], completion_tokens=1)], 1.0)
    assert local.kv_share_of_ttft is None and Answer(ttft_s=0.3).split() is None
    report = {"config": {"model": "m", "requests": 2, "prompt_len": 8, "max_tokens": 3,
                         "concurrency": 1},
              "placement": "test", "results": [asdict(pd), asdict(local)]}
    text = table(report)
    assert "| 1P1D | 500 | 500 | 100.0 | 200.0 | 3.0 |" in text
    assert "| colocated |" in text and "| -% |" in text
    plot(report, tmp_path / "chart.png")
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
