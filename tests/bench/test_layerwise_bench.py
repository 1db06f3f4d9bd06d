"""`kvlink bench layerwise`'s arithmetic and options (the run itself needs root and is a benchmark)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvlink.bench.layerwise import Result, Sample, p_times, rows, table, targets
from kvlink.cli.bench_layerwise import _modes, _rates, _tokens


def sample(rate: str, mode: str, ttft: float, p: float, transfer: float | None, run: int = 0) -> Sample:
    return Sample(rate, 2048, mode, run, ttft, None, transfer, 90 << 20, f"{rate}-{mode}-{run}", p)


def test_p_times_read_p_log_lines(tmp_path: Path) -> None:
    log = tmp_path / "prefill.log"
    log.write_text("2026-12-02 kvlink.serve request lw-1gbit-256-pull-0 role=prefill prompt_tokens=256 "
                   "output_tokens=0 finish=length ttft=- total=941.5ms\n"
                   "2026-12-02 kvlink.serve request x role=decode prompt_tokens=9 total=5.0ms\nnoise\n")
    assert p_times(log) == {"lw-1gbit-256-pull-0": pytest.approx(0.9415)}
    assert p_times(tmp_path / "missing.log") == {}


def test_rows_and_targets() -> None:
    result = Result({}, "machine", "tcp")
    for run in range(2):
        result.samples += [sample("1gbit", "pull", 12.9 + run * 0.1, 11.9, 0.8, run),
                           sample("1gbit", "layerwise", 12.0 + run * 0.1, 11.9, 11.9, run),
                           sample("none", "pull", 11.0, 10.7, 0.16, run),
                           sample("none", "layerwise", 11.7, 10.7, 10.9, run)]
    by_key = {(r["rate"], r["mode"]): r for r in rows(result)}
    assert by_key[("1gbit", "pull")]["after_p_ms"] == pytest.approx(1050.0)
    assert by_key[("1gbit", "pull")]["ttft_sd_ms"] == pytest.approx(70.71, abs=0.01)
    lines = targets(result)
    assert lines[0].endswith("met") and "bound 12470 ms" in lines[0]  # 12950 - 0.6 x 800
    assert lines[1].endswith("met")  # past P: 150 <= 1050 - 480
    assert lines[2].endswith("missed")  # no limit: 11700 > 11000 + noise (5 % of pull: 550)
    assert "| 1gbit | 2048 | layerwise |" in table(result)


def test_options_refuse_what_they_cannot_run() -> None:
    assert _rates("1gbit,none,500mbit") == ("1gbit", None, "500mbit")
    assert _tokens("256,2048") == (256, 2048)
    assert _modes("pull,layerwise") == ("pull", "layerwise")
    assert _rates("0.5gbit,10kbit") == ("0.5gbit", "10kbit")
    for parse, bad in ((_rates, "fast"), (_rates, "0bit"), (_rates, "0.0mbit"), (_rates, "gbit"), (_rates, "1.5.2mbit"),
                       (_tokens, "1"), (_tokens, "9000"), (_modes, "stream")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)


def test_vllm_targets_estimate_the_transfer_from_pull_past_p() -> None:
    """A vLLM D reports no transfer figures: the transfer is what the 1 Gbit/s link added to
    pull's time past P; NixlConnector's TTFT is set beside layerwise."""
    result = Result({"engine": "vllm"}, "machine", "tcp")
    result.samples += [sample("1gbit", "pull", 4.0, 3.0, None), sample("none", "pull", 3.2, 3.0, None),
                       sample("1gbit", "layerwise", 3.4, 3.1, None), sample("1gbit", "nixl", 4.2, 3.0, None)]
    lines = targets(result)
    # transfer = (4.0 - 3.0) - (3.2 - 3.0) = 800 ms; bound = 4000 - 480
    assert "bound 3520 ms" in lines[0] and "1gbit - no limit" in lines[0] and lines[0].endswith("met")
    assert any("NixlConnector 4200 ms" in line for line in lines)


def test_vllm_servers_sit_in_their_namespaces_with_tcp_on_the_link(tmp_path: Path) -> None:
    from kvlink.bench.layerwise_vllm import (
        NIXL,
        VllmLayerwiseConfig,
        layerwise_p_legs,
        server_specs,
    )
    from kvlink.bench.two_hosts import TwoHosts
    from kvlink.integrations.vllm.launch import server_argv, server_env

    hosts = TwoHosts("nsp", "nsd", "lp", "ld", "10.9.0.1", "10.9.0.2", "10.9.2.2")
    config = VllmLayerwiseConfig(tmp_path)
    for connector in ("kvlink", NIXL):
        p, d = server_specs(config, hosts, connector, "s" * 32)
        argv_p, argv_d = server_argv(p), server_argv(d)
        assert argv_p[:4] == ["ip", "netns", "exec", "nsp"] and argv_d[:4] == ["ip", "netns", "exec", "nsd"]
        assert argv_p[argv_p.index("--host") + 1] == "10.9.0.1" and p.url == f"http://10.9.0.1:{p.port}"
        assert argv_d[argv_d.index("--host") + 1] == "10.9.2.2"
        env_p, env_d = server_env(p), server_env(d)
        assert (env_p["UCX_TLS"], env_p["UCX_NET_DEVICES"], env_d["UCX_NET_DEVICES"]) == ("tcp", "lp", "ld")
        assert (p.cores, d.cores) == ("0", "1")
        if connector == NIXL:
            assert p.kv_transfer_config == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
            assert env_p["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.9.0.1"
            assert env_d["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.9.0.2"
        else:
            assert p.kv_transfer_config is not None and d.kv_transfer_config is not None
            assert p.kv_transfer_config["kv_connector_extra_config"]["side_channel_host"] == "10.9.0.1"
            assert d.kv_transfer_config["kv_connector_extra_config"]["side_channel_host"] == "10.9.0.2"
    log = tmp_path / "proxy.log"
    log.write_text("INFO request lwv-1gbit-256-layerwise-0: layerwise prefill answered after 812.5ms\nnoise\n")
    assert layerwise_p_legs(log) == {"lwv-1gbit-256-layerwise-0": pytest.approx(0.8125)}


def test_nixl_connector_settings_reach_its_servers_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--nixl-extra` / `--nixl-env`: NixlConnector's extra config and environment (over the
    bench's own), on NixlConnector's servers and not on kvlink's; refused without mode nixl."""
    from kvlink.bench.layerwise_vllm import NIXL, VllmLayerwiseConfig, server_specs
    from kvlink.bench.two_hosts import TwoHosts
    from kvlink.cli.main import main
    from kvlink.integrations.vllm.launch import server_env

    hosts = TwoHosts("nsp", "nsd", "lp", "ld", "10.9.0.1", "10.9.0.2", "10.9.2.2")
    config = VllmLayerwiseConfig(tmp_path, nixl_extra={"num_threads": 8}, nixl_env={"UCX_TLS": "tcp,self"})
    p, d = server_specs(config, hosts, NIXL, "s" * 32)
    for spec in (p, d):
        assert spec.kv_transfer_config == {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                                           "kv_connector_extra_config": {"num_threads": 8}}
        assert server_env(spec)["UCX_TLS"] == "tcp,self"
    assert server_env(p)["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.9.0.1"
    p, d = server_specs(config, hosts, "kvlink", "s" * 32)
    assert p.kv_transfer_config is not None and "num_threads" not in p.kv_transfer_config["kv_connector_extra_config"]
    assert server_env(p)["UCX_TLS"] == "tcp"
    for argv in (["--nixl-extra", '{"num_threads": 8}'], ["--engine", "vllm", "--modes", "pull", "--nixl-env", "A=1"]):
        assert main(["bench", "layerwise", *argv]) == 2
        assert "need --engine vllm and mode nixl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "layerwise", "--engine", "vllm", "--nixl-extra", "[1]"])
