"""Soak (make test-faults, not CI): a low-rate P/D stream with idle gaps through the proxy.

Runs `kvlink bench load --soak-minutes M` (M from KVLINK_SOAK_MINUTES, default 20) on the
tiny hybrid model and requires no failed request and nothing held afterwards; the memory
growth per 1000 requests is printed for the report (it is a measurement, not asserted).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MINUTES = float(os.environ.get("KVLINK_SOAK_MINUTES", "20"))

pytestmark = [pytest.mark.faults, pytest.mark.timeout(int(MINUTES * 60) + 600)]


def test_soak_low_rate_with_idle_gaps(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "kvlink.cli.main", "bench", "load", "--model", "tiny-hybrid",
           "--soak-minutes", str(MINUTES), "--soak-rate", "2", "--soak-batch", "100",
           "--soak-gap-s", "10", "--concurrency", "4", "--json", str(out),
           "--log-dir", str(tmp_path / "logs")]
    proc = subprocess.Popen(cmd, env={**os.environ, "UCX_NET_DEVICES": "lo"})
    try:
        proc.wait(timeout=MINUTES * 60 + 540)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    summary = json.loads(out.read_text())
    for name in ("prefill", "decode", "proxy"):
        print(f"{name}: RSS {summary[f'{name}_rss_mib_start']:.0f} -> {summary[f'{name}_rss_mib_end']:.0f} MiB, "
              f"{summary[f'{name}_rss_kib_per_1000_requests'] / 1024:.1f} MiB per 1000 requests")
    assert summary["requests"] > 0
    assert summary["errors"] == 0, summary
    assert not summary["leaks"], summary["leaks"]
    assert summary["passed"]
