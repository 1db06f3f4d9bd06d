"""`kvlink bench transfer`: a real P/D run on a small geometry (bytes and bookkeeping, never
speed), and the arithmetic of its ratios and verdicts."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlink.bench.transfer import (
    BenchOptions,
    _ucx_get_protocol,
    per_layer_token_bytes,
    plan_sizes,
)
from kvlink.bench.transfer_node import CpuMeter, cpu_outside
from kvlink.bench.transfer_report import table, verdicts
from kvlink.bench.transfer_stats import load_figures, ratios


def test_ratios_are_taken_per_round_then_the_median() -> None:
    out = ratios("r", baseline_s=[1.0, 2.0, 4.0], connector_s=[2.0, 2.0, 2.0])
    assert out["r_all"] == [0.5, 1.0, 2.0]
    assert out["r"] == 1.0
    assert out["r_of_medians"] == 1.0
    # the machine slows down for rounds 2 and 3 of the baseline but only round 2 of the
    # connector: within a round they agree twice, while the medians say the baseline is 3x slower
    drift = ratios("r", baseline_s=[1.0, 3.0, 3.0], connector_s=[1.0, 3.0, 1.0])
    assert drift["r"] == 1.0 and drift["r_of_medians"] == 3.0
    with pytest.raises(ValueError):
        ratios("r", [1.0], [1.0, 2.0])


def _burn(cpu_s: float) -> None:
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def test_connector_cpu_counts_no_nixl_time_of_uncounted_polls() -> None:
    """Over TCP, UCX moves the bytes inside every poll's `check_xfer_state` and
    `get_new_notifs`. The connector's CPU is `start_load_kv` and the reporting poll, less the
    NIXL calls inside those two only: taking off every poll's NIXL time made it negative."""
    meters = {k: CpuMeter() for k in ("plan", "post", "transfer", "check", "progress")}
    transfer, check, progress = (meters[k].wrap(_burn) for k in ("transfer", "check", "progress"))
    nixl = (meters["transfer"], meters["check"], meters["progress"])

    def post() -> None:
        _burn(0.001)  # descriptors and checks
        transfer(0.003)  # the copy, on the CMA path

    def start_load_kv() -> None:
        _burn(0.002)  # planning and bookkeeping
        meters["post"].wrap(post)()

    def get_finished() -> None:
        _burn(0.0005)
        progress(0.002)  # UCX's TCP progress, from the notification poll
        check(0.002)  # and from the transfer's

    _, start_cpu = cpu_outside(start_load_kv, nixl)
    last_cpu = 0.0
    for _ in range(5):
        _, last_cpu = cpu_outside(get_finished, nixl)
    reply = {"wall_s": 0.05, "post_wall_s": 0.01, "start_cpu_s": start_cpu, "last_poll_cpu_s": last_cpu,
             "polls": 5, "nbytes": 2**20, "descriptors": 4, "meters": {k: m.take() for k, m in meters.items()}}
    figures = load_figures([reply])
    assert 0.0035 <= figures["connector_cpu_s"] < 0.0035 + 0.002
    assert 0.001 <= figures["post_cpu_s"] < 0.001 + 0.001
    assert figures["nixl_cpu_s"] >= 0.003 + 5 * 0.004


def _row(tokens: int, layout: str, ratio: float, cpu_pct: float = 1.0) -> dict[str, object]:
    return {"tokens": tokens, "layout": layout, "nbytes": 2**20, "rank0_descriptors": 4, "wall_s": 0.001,
            "gbps": 1.0, "raw_s": 0.001, "raw_gbps": 1.0, "raw_descriptors": 1, "raw_desc_bytes": 2**20,
            "ratio_vs_raw": ratio, "ratio_vs_raw_all": [ratio - 0.1, ratio, ratio + 0.1],
            "memcpy_gbps": 5.0, "connector_cpu_s": 1e-5, "plan_cpu_s": 1e-6, "post_cpu_s": 1e-6,
            "cpu_pct": cpu_pct}


def test_verdicts_name_the_worst_size() -> None:
    rows = [_row(512, "contiguous", 0.95), _row(4096, "contiguous", 0.89, cpu_pct=6.0),
            _row(512, "fragmented", 0.97), _row(4096, "fragmented", 0.93)]
    lines = verdicts({"rows": rows})
    assert lines[0].startswith("contiguous connector >= 0.9x raw NIXL, one descriptor: NOT MET")
    assert "worst 0.89 at 4096 tokens" in lines[0]
    assert lines[1].startswith("fragmented connector >= 0.9x raw NIXL, same descriptor sizes: MET")
    assert lines[2].startswith("connector CPU per request < 5% of transfer time at 4096 tokens: NOT MET")
    text = table({"rows": rows})
    assert "| 4,096 | contiguous |" in text and "0.89 (0.79–0.99)" in text and "n/a (push)" in text


def test_verify_cost_verdicts_take_each_mode_against_off() -> None:
    """Several verify-kv modes: the raw-NIXL verdicts look at the first mode's rows only, and
    each checked mode gets a verdict of its per-round time over `off`'s against its target."""
    def moded(tokens: int, layout: str, mode: str, ratio: float, cost: float | None) -> dict[str, object]:
        row = {**_row(tokens, layout, ratio), "verify_kv": mode}
        if cost is not None:
            row.update(time_vs_base=cost, time_vs_base_all=[cost - 0.01, cost, cost + 0.02])
        return row

    rows = [moded(512, "contiguous", "off", 0.95, None), moded(512, "contiguous", "sample", 0.5, 1.04),
            moded(512, "contiguous", "full", 0.4, 1.6), moded(512, "fragmented", "off", 0.92, None),
            moded(512, "fragmented", "sample", 0.5, 1.02), moded(512, "fragmented", "full", 0.4, 1.45)]
    lines = verdicts({"rows": rows, "verify_modes": ["off", "sample", "full"]})
    assert lines[0].startswith("contiguous connector >= 0.9x raw NIXL, one descriptor: MET")  # off's rows
    assert lines[1].startswith("fragmented connector >= 0.9x raw NIXL, same descriptor sizes: MET")
    assert lines[3].startswith("verify-kv sample load time <= 1.05x off's: MET")
    assert lines[4].startswith("verify-kv full load time <= 1.5x off's: NOT MET")
    assert "worst 1.600 at 512 tokens contiguous" in lines[4]
    text = table({"rows": rows, "verify_modes": ["off", "sample", "full"]})
    assert "time / off's" in text and "| full | 1.600 (1.59–1.62) |" in text and "| off |  |" in text
    # no target against a first mode other than off
    checked = [r for r in rows if r["verify_kv"] != "off"]
    assert len(verdicts({"rows": checked, "verify_modes": ["sample", "full"]})) == 3


@pytest.mark.parametrize("bad", [
    {"tokens": [0]}, {"tokens": []}, {"repeats": 0}, {"min_seconds": -1.0}, {"max_gib": 0.0},
    {"p_tp": 0}, {"mode": "sideways"}, {"d_netns": "kvd1"},  # a namespace needs a non-loopback --d-host
    {"verify_kv": "off,off"}, {"verify_kv": "off,bogus"}, {"verify_kv": ""}, {"verify_kv": 3},
    {"verify_kv": "off,sample", "memory": "cuda"},
])
def test_bad_options_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        BenchOptions(**bad)  # type: ignore[arg-type]


def test_ucx_read_protocol_between_namespaces_is_found() -> None:
    """Peers in two network namespaces are inter-node to UCX: that table names the transport."""
    log = "\n".join([
        "[1.0] [vm:1 :0]   | benchD-r0-35f5a271 inter-node cfg#1                    |",
        "[1.0] [vm:1 :0]   | remote memory read by ucp_get*(multi) into host memory from host |",
        "[1.0] [vm:1 :0]   +--------+--------------------+--------------------+",
        "[1.0] [vm:1 :0]   | Range  |    Description     |       Config       |",
        "[1.0] [vm:1 :0]   +--------+--------------------+--------------------+",
        "[1.0] [vm:1 :0]   | 0..inf | software emulation | tcp/kvkd1          |",
        "[1.0] [vm:1 :0]   +--------+--------------------+--------------------+",
    ])
    assert _ucx_get_protocol(log) == "0..inf software emulation via tcp/kvkd1"


def test_pool_and_layer_cut() -> None:
    opts = BenchOptions(preset="llama3-8b", tokens=[512, 32768], max_gib=2.0)
    sizes = plan_sizes(opts)
    assert sizes["pool_blocks"] == math.ceil(32769 / 16) + 1
    assert sizes["layers"] == 15  # 128 KiB/token over 32 layers, 2050 blocks: 15 layers fit in 2 GiB
    assert sizes["side_bytes"] <= 2 * 2**30
    assert per_layer_token_bytes(opts) == 2 * 8 * 128 * 2  # K and V, 8 heads, dim 128, bf16
    with pytest.raises(ValueError, match="attention and MLA"):
        plan_sizes(BenchOptions(preset="hybrid-mamba2"))


def test_bench_transfer_runs_between_processes(tmp_path: Path) -> None:
    """Two worker processes, real NIXL: every size moves the planned bytes, pages match P's,
    and the JSON carries each method's per-round samples."""
    out = tmp_path / "t.json"
    png = tmp_path / "t.png"
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvlink.cli.main", "bench", "transfer", "--preset", "smollm2-135m",
         "--tokens", "32,100", "--repeats", "3", "--min-seconds", "0", "--json", str(out), "--plot", str(png)],
        env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "UCX remote-read protocol" in proc.stdout and png.stat().st_size > 10_000
    result = json.loads(out.read_text())
    token_bytes = result["sizes"]["token_bytes"]
    assert result["sizes"]["layers"] == 30 and token_bytes == 30 * 2 * 3 * 64 * 4  # SmolLM2: 3 KV heads, dim 64, fp32
    assert len(result["rows"]) == 4
    for row in result["rows"]:
        blocks = math.ceil(row["tokens"] / 16)  # a prompt of tokens + 1: D recomputes the last one
        assert row["nbytes"] == blocks * 16 * token_bytes  # whole blocks of every layer, K and V
        assert row["verified_pages"] == 16
        assert len(row["wall_all_s"]) == len(row["raw_all_s"]) == len(row["same_all_s"]) == 3
        assert len(row["ratio_vs_raw_all"]) == 3 and row["ratio_vs_raw"] > 0
        if row["layout"] == "contiguous":
            assert row["raw_descriptors"] == 1 and row["raw_desc_bytes"] == row["rank0_nbytes"]
        else:  # the connector's descriptor size (after NIXL merged any neighbours), same bytes
            assert row["raw_desc_bytes"] == row["rank0_nbytes"] // row["rank0_descriptors"]
            assert 0 <= row["rank0_nbytes"] - row["raw_descriptors"] * row["raw_desc_bytes"] < row["raw_desc_bytes"]
    assert len(result["verdicts"]) == 3


def test_bench_transfer_times_several_verify_modes_in_the_same_rounds(tmp_path: Path) -> None:
    """`--verify-kv off,sample`: one D per mode reads from the same P in every round; each
    mode's row moves the same bytes, its pages match P's, and the checked mode carries its
    per-round time over off's."""
    out = tmp_path / "t.json"
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvlink.cli.main", "bench", "transfer", "--preset", "smollm2-135m",
         "--tokens", "32", "--repeats", "3", "--min-seconds", "0", "--verify-kv", "off,sample",
         "--json", str(out)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["verify_modes"] == ["off", "sample"]
    rows = result["rows"]
    assert [(r["layout"], r["verify_kv"]) for r in rows] == [
        ("contiguous", "off"), ("contiguous", "sample"), ("fragmented", "off"), ("fragmented", "sample")]
    for off, sample in (rows[:2], rows[2:]):
        assert off["nbytes"] == sample["nbytes"] == 2 * 16 * result["sizes"]["token_bytes"]
        assert off["verified_pages"] == sample["verified_pages"] == 16
        assert "time_vs_base" not in off
        assert sample["time_vs_base_all"] == pytest.approx(
            [s / o for s, o in zip(sample["wall_all_s"], off["wall_all_s"], strict=True)])
        assert off["raw_all_s"] == sample["raw_all_s"]  # one raw READ per round, shared
    assert any(line.startswith("verify-kv sample load time <= 1.05x off's") for line in result["verdicts"])
    refused = subprocess.run([sys.executable, "-m", "kvlink.cli.main", "bench", "transfer", "--verify-kv", "off,off"],
                             env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "each once" in refused.stderr


def test_a_namespace_the_peers_cannot_use_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    from kvlink.cli.main import main

    code = main(["bench", "transfer", "--preset", "smollm2-135m", "--tokens", "32", "--layers", "2", "--repeats",
                 "1", "--min-seconds", "0", "--max-gib", "0.01", "--p-netns", "kvlink-no-such-ns",
                 "--p-host", "10.9.9.9"])
    assert code == 2
    assert "kvlink bench transfer: error: network namespace kvlink-no-such-ns" in capsys.readouterr().err


def test_a_chart_path_that_is_not_png_is_refused_before_the_run(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from kvlink.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(["bench", "transfer", "--plot", str(tmp_path / "chart.foo")])
    assert exited.value.code == 2 and "expected a .png file path" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
