"""The soak's memory series (no servers): sampling a live process, the quoted figures, the PNG."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import httpx
import pytest

from kvlink.bench.memory_series import MemorySampler, Sample, figures, plot, slope, write_json


def _series(rss_mib: list[float], every_s: float = 60.0, requests_per_sample: int = 100) -> list[Sample]:
    return [Sample(i * every_s, i * requests_per_sample, {"prefill": int(v * 1024)}) for i, v in enumerate(rss_mib)]


def test_a_plateau_after_an_early_step_has_zero_slope_in_the_window() -> None:
    # +50 MiB in the first 10 minutes, then flat for 50: the last 30 minutes are flat.
    samples = _series([600.0] * 5 + [650.0] * 56)
    out = figures(samples, window_min=30)
    assert out["window_min"] == 30
    assert out["prefill_rss_mib_first"] == 600 and out["prefill_rss_mib_last"] == 650
    assert out["prefill_rss_mib_peak"] == 650
    assert out["prefill_rss_mib_per_hour_window"] == pytest.approx(0.0)
    assert out["prefill_rss_mib_per_1000_requests_window"] == pytest.approx(0.0)


def test_steady_growth_is_reported_per_hour_and_per_1000_requests() -> None:
    samples = _series([600.0 + i for i in range(61)])  # 1 MiB per minute, 100 requests per minute
    out = figures(samples, window_min=30)
    assert out["prefill_rss_mib_per_hour_window"] == pytest.approx(60.0)
    assert out["prefill_rss_mib_per_1000_requests_window"] == pytest.approx(10.0)


def test_a_run_shorter_than_the_window_uses_all_of_it() -> None:
    out = figures(_series([600.0, 602.0, 604.0]), window_min=30)
    assert out["window_min"] == pytest.approx(2.0)
    assert out["prefill_rss_mib_per_hour_window"] == pytest.approx(120.0)


def test_slope_needs_two_distinct_points() -> None:
    assert slope([(1.0, 2.0), (3.0, 6.0)]) == pytest.approx(2.0)
    assert math.isnan(slope([(1.0, 2.0)]))
    assert math.isnan(slope([(1.0, 2.0), (1.0, 3.0)]))


def test_sampler_reads_rss_and_survives_a_server_that_does_not_answer(tmp_path: Path) -> None:
    with httpx.Client(timeout=0.5) as client:
        sampler = MemorySampler({"me": os.getpid()}, {"gone": "http://127.0.0.1:9"}, lambda: 7)
        sample = sampler.sample(client)
    assert sample.requests == 7
    assert sample.rss_kib["me"] > 1024
    assert sample.malloc_kib == {}  # no answer from the server: RSS only
    sampler = MemorySampler({"me": os.getpid()}, {}, lambda: 0, interval_s=0.01)
    sampler.start()
    deadline = time.monotonic() + 30
    while len(sampler.samples) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop(timeout_s=5)
    taken = len(sampler.samples)
    assert taken >= 3
    time.sleep(0.05)
    assert len(sampler.samples) == taken  # stopped
    write_json(sampler.samples, tmp_path / "memory.json")
    assert json.loads((tmp_path / "memory.json").read_text())[0]["rss_kib"]["me"] > 1024


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s must be > 0, got 0"):
        MemorySampler({}, {}, lambda: 0, interval_s=0)


def test_plot_writes_a_png_with_the_heap_panel(tmp_path: Path) -> None:
    samples = _series([600.0, 610.0, 610.0])
    for sample in samples:
        sample.malloc_kib["prefill"] = {"in_use": 90_000, "free_held": 4_000, "heap_from_system": 94_000,
                                        "mmapped": 100_000}
    plot(samples, tmp_path / "memory.png", "soak")
    assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
