"""`kvlink plan` and `kvlink bench plan` through the real entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvlink.cli.main import main


def test_plan_human_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "llama3-8b", "--p-tp", "2", "--d-tp", "4", "--tokens", "100"]) == 0
    out = capsys.readouterr().out
    assert "regions per rank: 32 = 32 attention (page 32.0 KiB)" in out
    assert "KV bytes per token per rank: 32.0 KiB" in out
    assert "D rank 3: reads P [1], notifies P [1]; 224 descriptors, 224 after merging" in out
    assert "notifications each P rank waits for per request: P0: 2, P1: 2" in out


def test_plan_reports_merging_of_consecutive_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "deepseek-mla", "--p-tp", "4", "--d-tp", "2", "--tokens", "100"]) == 0
    out = capsys.readouterr().out
    # 61 layers x 7 blocks, consecutive on both sides: one merged run per layer
    assert "D rank 1: reads P [2], notifies P [2, 3]; 427 descriptors, 61 after merging" in out


def test_plan_json_lists_every_transfer(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--preset", "hybrid-mamba2", "--p-tp", "1", "--d-tp", "2", "--tokens", "40",
            "--p-block-size", "32", "--p-kernel-block-size", "16", "--d-block-size", "16", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    p_regions = report["p"]["workers"][0]["regions"]
    d_regions = report["d"]["workers"][1]["regions"]
    assert [r["kind"] for r in p_regions] == ["attention", "ssm", "attention", "ssm"]
    rank = report["d_ranks"][1]
    assert rank["source_ranks"] == [0] and report["consumers_per_producer"] == [2]
    moved = 0
    for t in rank["transfers"]:
        src, dst = p_regions[t["src_region"]], d_regions[t["dst_region"]]
        assert t["src_offset"] + t["length"] <= src["num_pages"] * src["page_stride"]
        assert t["dst_offset"] + t["length"] <= dst["num_pages"] * dst["page_stride"]
        moved += t["length"]
    assert moved == rank["bytes"] and len(rank["transfers"]) == rank["descriptors"]
    # 39 tokens in 16-token chunks over 2 attention layers, then 4 SSM pieces per SSM layer
    assert len(rank["transfers"]) == 3 * 2 + 2 * 4


def test_plan_refuses_impossible_tp(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "smollm2-135m", "--p-tp", "2", "--d-tp", "1"]) == 2
    err = capsys.readouterr().err
    assert "P: TP 2 cannot shard kv (3 units)" in err and "Supported:" in err


def test_plan_refuses_impossible_request(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "llama3-8b", "--p-tp", "1", "--d-tp", "1",
                 "--d-computed-tokens", "5"]) == 2
    assert "multiple of the local block size 16" in capsys.readouterr().err


def test_bench_plan_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "plan", "--tokens", "1024", "4096", "--repeat", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["descriptors_per_side"] for r in rows] == [2048, 8192]
    assert "request_ids ms" in capsys.readouterr().out


def test_python_dash_m_kvlink_is_the_kvlink_command() -> None:
    done = subprocess.run([sys.executable, "-m", "kvlink", "plan", "--preset", "smollm2-135m", "--p-tp", "1",
                           "--d-tp", "1", "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["model"] == "smollm2-135m"
