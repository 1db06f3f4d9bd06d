"""Soak (make test-faults, not CI): a low-rate P/D stream with idle gaps through the proxy.

Runs `kvlink bench load --soak-minutes M` (M from KVLINK_SOAK_MINUTES, default 60) on the
tiny hybrid model and requires no failed request and nothing held afterwards. The memory
of P, D and the proxy is sampled every 5 s; its growth per 1000 requests and, over the
last 30 minutes, per hour are printed for the report (measurements, not asserted), and
soak.json, memory.json and memory.png are left in KVLINK_SOAK_OUT (default: pytest's
tmp_path).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MINUTES = float(os.environ.get("KVLINK_SOAK_MINUTES", "60"))

pytestmark = [pytest.mark.faults, pytest.mark.timeout(int(MINUTES * 60) + 600)]


def test_soak_low_rate_with_idle_gaps(tmp_path: Path) -> None:
    out_dir = Path(os.environ.get("KVLINK_SOAK_OUT") or tmp_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "soak.json"
    cmd = [sys.executable, "-m", "kvlink.cli.main", "bench", "load", "--model", "tiny-hybrid",
           "--soak-minutes", str(MINUTES), "--soak-rate", "2", "--soak-batch", "100",
           "--soak-gap-s", "10", "--concurrency", "4", "--json", str(out),
           "--memory-json", str(out_dir / "memory.json"), "--memory-plot", str(out_dir / "memory.png"),
           "--log-dir", str(out_dir / "logs")]
    proc = subprocess.Popen(cmd, env={**os.environ, "UCX_NET_DEVICES": "lo"})
    try:
        proc.wait(timeout=MINUTES * 60 + 540)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    summary = json.loads(out.read_text())
    window = summary["series_window_min"]
    for name in ("prefill", "decode", "proxy"):
        print(f"{name}: RSS {summary[f'{name}_rss_mib_start']:.0f} -> {summary[f'{name}_rss_mib_end']:.0f} MiB, "
              f"{summary[f'{name}_rss_kib_per_1000_requests'] / 1024:.1f} MiB per 1000 requests; "
              f"last {window:.0f} min: {summary[f'series_{name}_rss_mib_per_hour_window']:.1f} MiB/h")
    print(f"memory curve: {out_dir / 'memory.png'}")
    assert summary["requests"] > 0
    assert summary["errors"] == 0, summary
    assert not summary["leaks"], summary["leaks"]
    assert summary["passed"]
