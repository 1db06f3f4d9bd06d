"""The one deployment helper, before anything starts: instances, ports, secret, router command lines."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from kvlink.bench.cluster import Cluster, ClusterSpec
from kvlink.bench.routers import router_argv, vllm_router_flags
from kvlink.transfer.framing import SECRET_ENV


def _option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def _fake_vllm_router(directory: Path) -> Path:
    path = directory / "vllm-router"
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_n_prefill_m_decode_instances_each_with_own_ports_and_ids(tmp_path: Path) -> None:
    spec = ClusterSpec(model="tiny-hybrid", n_prefill=2, n_decode=3, prefill_tp=2, decode_tp=1,
                       prefill_block_size=32, decode_block_size=16, colocated=True,
                       load_failure_policy="recompute", prefill_args=("--tp-step-timeout-s", "4"))
    cluster = Cluster(spec, tmp_path, progress=lambda _: None)
    assert [m.name for m in cluster.members] == ["prefill", "prefill1", "decode", "decode1", "decode2",
                                                 "colocated"]
    ports: list[int] = [cluster.proxy_port]
    for m in cluster.members:
        ports.append(m.port)
        if m.kv_port is not None:  # rank r of a TP engine listens on kv_port + r
            ports += range(m.kv_port, m.kv_port + int(_option(m.args, "--tp")))
    assert len(ports) == len(set(ports)), "a port handed out twice"
    assert len({m.engine_id for m in cluster.members}) == len(cluster.members)
    for m in cluster.roles("prefill"):
        assert (_option(m.args, "--tp"), _option(m.args, "--block-size")) == ("2", "32")
        assert "--load-failure-policy" not in m.args and _option(m.args, "--tp-step-timeout-s") == "4"
    for m in cluster.roles("decode"):
        assert (_option(m.args, "--tp"), _option(m.args, "--block-size")) == ("1", "16")
        assert _option(m.args, "--load-failure-policy") == "recompute"
        assert "--tp-step-timeout-s" not in m.args
    colocated = cluster.member("colocated")
    assert _option(colocated.args, "--role") == "both" and _option(colocated.args, "--tp") == "1"


def test_one_secret_per_deployment_in_p_and_d_environment_only(tmp_path: Path) -> None:
    first = Cluster(ClusterSpec(n_prefill=2, n_decode=2, colocated=True), tmp_path, progress=lambda _: None)
    second = Cluster(ClusterSpec(), tmp_path, progress=lambda _: None)
    assert first.secret != second.secret
    assert {m.env.get(SECRET_ENV) for m in first.members if m.role != "both"} == {first.secret}
    assert SECRET_ENV not in first.member("colocated").env
    assert not any(first.secret in arg for m in first.members for arg in m.args)


def test_kvlink_proxy_gets_every_prefill_and_decode_url(tmp_path: Path) -> None:
    cluster = Cluster(ClusterSpec(n_prefill=2, n_decode=2, request_timeout_s=7.0), tmp_path,
                      progress=lambda _: None)
    argv = cluster._router_argv
    assert argv is not None and argv[:4] == [sys.executable, "-m", "kvlink.cli.main", "proxy"]
    p_urls = [m.url for m in cluster.roles("prefill")]
    d_urls = [m.url for m in cluster.roles("decode")]
    assert argv[argv.index("--prefill") + 1:argv.index("--decode")] == p_urls
    assert argv[argv.index("--decode") + 1:argv.index("--port")] == d_urls
    assert (_option(argv, "--port"), _option(argv, "--timeout-s")) == (str(cluster.proxy_port), "7.0")


def test_vllm_router_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    executable = _fake_vllm_router(tmp_path)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "elsewhere" / "python"))
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    argv = router_argv("vllm-router", ["http://127.0.0.1:1", "http://127.0.0.1:2"], ["http://127.0.0.1:3"],
                       8090, 60.0)
    assert argv == [str(executable), "--vllm-pd-disaggregation",
                    "--prefill", "http://127.0.0.1:1", "--prefill", "http://127.0.0.1:2",
                    "--decode", "http://127.0.0.1:3", "--kv-connector", "nixl",
                    "--host", "127.0.0.1", "--port", "8090"]


def test_missing_vllm_router_is_reported_before_anything_starts(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no vllm-router here
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))  # nor next to the interpreter
    with pytest.raises(RuntimeError, match=r"pip install vllm-router==0\.1\.17"):
        Cluster(ClusterSpec(router="vllm-router"), tmp_path / "logs", progress=lambda _: None)
    assert not (tmp_path / "logs").exists()  # no process was started, not even a log opened


def test_vllm_router_is_found_next_to_the_interpreter_of_a_venv_not_activated(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    executable = _fake_vllm_router(bin_dir)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))  # not on PATH
    argv = router_argv("vllm-router", ["http://127.0.0.1:1"], ["http://127.0.0.1:2"], 8090, 60.0)
    assert argv[0] == str(executable)


def test_vllm_router_gets_its_own_metrics_port_and_the_extra_flags(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_vllm_router(bin_dir)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    flags = vllm_router_flags("round_robin", health_check_interval_s=1, health_failure_threshold=1)
    spec = ClusterSpec(n_prefill=2, n_decode=2, router="vllm-router", router_args=flags)
    first, second = (Cluster(spec, tmp_path / name, progress=lambda _: None) for name in ("a", "b"))
    for cluster in (first, second):
        argv = cluster._router_argv
        assert argv is not None and argv[-len(flags):] == flags
        assert _option(argv, "--prometheus-host") == "127.0.0.1"
        assert int(_option(argv, "--prometheus-port")) not in (cluster.proxy_port,
                                                               *(m.port for m in cluster.members))
    # Two routers on one host: the default 29000 would make the second one exit.
    assert first._router_argv is not None and second._router_argv is not None
    assert _option(first._router_argv, "--prometheus-port") != _option(second._router_argv, "--prometheus-port")
    first.set_router_args(vllm_router_flags("cache_aware"))
    assert first._router_argv is not None and first._router_argv[-2:] == ["--policy", "cache_aware"]
    assert "--health-check-interval-secs" not in first._router_argv


def test_kvlink_proxy_router_args_go_last(tmp_path: Path) -> None:
    cluster = Cluster(ClusterSpec(router_args=["--connect-timeout-s", "2"]), tmp_path, progress=lambda _: None)
    assert cluster._router_argv is not None and cluster._router_argv[-2:] == ["--connect-timeout-s", "2"]
    assert "--prometheus-port" not in cluster._router_argv


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"policy": "fastest"}, "policy: expected one of random, round_robin, cache_aware"),
    ({"health_check_interval_s": 0}, "health_check_interval_s: expected 1 to 3600; got 0"),
    ({"health_failure_threshold": 0}, "health_failure_threshold: expected 1 to 3600; got 0"),
    ({"max_retries": 5000}, "max_retries: expected 1 to 3600; got 5000"),
])
def test_bad_vllm_router_flags_name_the_option_and_the_range(kwargs: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        vllm_router_flags(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("fields", "named"), [
    ({"router": "nginx"}, "router: expected one of kvlink, vllm-router; got 'nginx'"),
    ({"transfer_mode": "pigeon"}, "transfer_mode: expected one of pull, push"),
    ({"load_failure_policy": "retry"}, "load_failure_policy: expected one of fail, recompute"),
    ({"pd": False, "colocated": False}, "starts nothing"),
])
def test_bad_spec_says_which_field_and_what_is_allowed(fields: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ClusterSpec(**fields)  # type: ignore[arg-type]


def test_restart_extra_args_only_for_instances(tmp_path: Path) -> None:
    cluster = Cluster(ClusterSpec(), tmp_path, progress=lambda _: None)
    with pytest.raises(ValueError, match="the proxy takes none"):
        cluster.restart("proxy", extra_args=["--lease-s", "2"])
    with pytest.raises(KeyError, match=r"no instance 'prefill3'.*it has prefill, decode"):
        cluster.restart("prefill3")


def test_a_colocated_only_cluster_has_no_proxy_to_restart(tmp_path: Path) -> None:
    cluster = Cluster(ClusterSpec(pd=False, colocated=True), tmp_path, progress=lambda _: None)
    assert [m.name for m in cluster.members] == ["colocated"]
    with pytest.raises(ValueError, match="no proxy: its spec has pd=False"):
        cluster.restart("proxy")
