"""`kvlink serve --verify-kv` and `--verify-sample-units`: defaults from the connector, refused
values exit 2 naming the option; what D checked reaches the answer and the request's log line;
the connector's gauges and per-engine counters survive the merge over TP ranks."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvlink.cli.main import parse_args
from kvlink.connector.config import ConnectorConfig
from kvlink.connector.stats import ConnectorStats, PrometheusExporter
from kvlink.engine.tp import merge_stats
from kvlink.serve.factory import _connector_config
from kvlink.serve.generation import Summary
from kvlink.transfer.framing import SECRET_ENV


def test_defaults_are_the_connector_defaults() -> None:
    args = parse_args(["serve"])
    assert (args.verify_kv, args.verify_sample_units) == (ConnectorConfig.verify_kv, ConnectorConfig.verify_sample_units)
    assert args.verify_kv == "sample"


@pytest.mark.parametrize(("argv", "expected"), [
    (["--verify-kv", "paranoid"], "argument --verify-kv: invalid choice: 'paranoid' (choose from"),
    (["--verify-kv", ""], "argument --verify-kv: invalid choice"),
    (["--verify-sample-units", "0"], "argument --verify-sample-units: expected an integer in [1, 1048576], got 0"),
    (["--verify-sample-units", "1048577"], "argument --verify-sample-units: expected an integer in [1, 1048576]"),
    (["--verify-sample-units", "-3"], "argument --verify-sample-units: expected an integer in [1, 1048576], got -3"),
    (["--verify-sample-units", "2.5"], "argument --verify-sample-units: expected an integer in [1, 1048576]"),
    (["--verify-sample-units", "many"], "argument --verify-sample-units: expected an integer in [1, 1048576]"),
])
def test_bad_values_exit_2_naming_the_option_and_range(argv: list[str], expected: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["serve", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err, err


@pytest.mark.parametrize(("argv", "mode", "units"), [
    ([], "sample", 4),
    (["--verify-kv", "full"], "full", 4),
    (["--verify-kv", "off"], "off", 4),
    (["--verify-sample-units", "1048576"], "sample", 1 << 20),
    (["--verify-kv", "sample", "--verify-sample-units", "1"], "sample", 1),
])
def test_options_reach_the_connector_config(argv: list[str], mode: str, units: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    args = parse_args(["serve", "--role", "decode", "--insecure-unsigned-params", *argv])
    config = _connector_config(args)
    assert (config.verify_kv, config.verify_sample_units) == (mode, units)


def test_checked_bytes_are_in_the_answer_and_the_log_line(fake_app: Any, caplog: pytest.LogCaptureFixture) -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "fake-p", "remote_block_ids": [1, 2]}
    with caplog.at_level(logging.INFO, logger="kvlink.serve"), TestClient(fake_app) as client:
        loaded = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "kv_transfer_params": params,
                                                       "user": "x"}, headers={"x-request-id": "checked-1"}).json()
        local = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                            headers={"x-request-id": "local-1"}).json()
    assert loaded["kvlink"]["kv_bytes"] == 4096 and loaded["kvlink"]["kv_verified_bytes"] == 1024
    assert "kvlink" not in local
    lines = {r.getMessage().split()[1]: r.getMessage() for r in caplog.records if r.getMessage().startswith("request ")}
    assert "kv_bytes=4096" in lines["checked-1"] and lines["checked-1"].endswith(" kv_verified_bytes=1024")
    assert "kv_verified_bytes" not in lines["local-1"]


def test_a_load_without_a_check_has_no_verified_figure() -> None:
    summary = Summary("r", "decode", prompt_tokens=40, kv_bytes=1000, kv_transfer_s=0.01)
    assert "kv_verified_bytes" not in summary.log_line()
    figures = summary.figures()
    assert figures is not None and "kv_verified_bytes" not in figures
    summary.kv_verified_bytes = 1000
    assert summary.log_line().endswith("kv_transfer=10.0ms kv_verified_bytes=1000")


def _rank_snapshot(pending: int, loads: int, handshakes: dict[str, int], mismatches: int) -> dict[str, Any]:
    stats = ConnectorStats()
    stats.gauges.update(pending_sends=pending, pending_send_blocks=3 * pending, loads_in_flight=loads)
    for engine, n in handshakes.items():
        stats.count_engine("handshakes_total", engine, n)
    stats.count("kv_checksum_mismatch_total", mismatches)
    return stats.take()


def test_tp_ranks_merge_into_one_engines_figures() -> None:
    merged = merge_stats([_rank_snapshot(2, 1, {"P-a": 1, "P-b": 2}, 0), _rank_snapshot(2, 0, {"P-a": 1}, 1)])
    assert merged["counters"]["kv_checksum_mismatch_total"] == 1
    assert merged["counters"]["kv_verified_bytes_total"] == 0  # declared at 0 on every rank
    assert merged["gauges"] == {"pending_sends": 2, "pending_send_blocks": 6, "loads_in_flight": 1}
    assert merged["engine_counters"] == [["handshakes_total", "P-a", 2], ["handshakes_total", "P-b", 2]]
    exporter = PrometheusExporter()
    exporter.update(merged)
    text = exporter.render()
    assert "# TYPE kvlink_pending_sends gauge\nkvlink_pending_sends 2\n" in text
    assert 'kvlink_handshakes_total{remote_engine="P-a"} 2' in text
    assert "kvlink_kv_checksum_mismatch_total 1" in text


def test_kv_host_sets_the_side_channel_address_apart_from_http(monkeypatch: pytest.MonkeyPatch) -> None:
    """A D whose HTTP and KV networks differ (two hosts) advertises the KV one to P."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
    base = ["serve", "--role", "decode", "--insecure-unsigned-params", "--host", "10.0.2.2"]
    assert _connector_config(parse_args(base)).side_channel_host == "10.0.2.2"
    assert _connector_config(parse_args([*base, "--kv-host", "10.0.0.2"])).side_channel_host == "10.0.0.2"
