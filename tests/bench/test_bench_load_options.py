"""`kvlink bench load` options: which routers run on which deployment, and what is refused."""

from __future__ import annotations

import pytest

from kvlink.bench.load_routers import routers_to_run, table
from kvlink.cli import bench_load
from kvlink.cli.main import parse_args


def test_defaults_are_kvlinks_proxy_on_one_p_and_one_d() -> None:
    spec = bench_load.spec_for(parse_args(["bench", "load"]))
    assert (spec.router, spec.n_prefill, spec.n_decode) == ("kvlink", 1, 1)


def test_both_routers_run_on_one_deployment_vllm_router_first() -> None:
    args = parse_args(["bench", "load", "--router", "both", "--prefills", "2", "--decodes", "3"])
    spec = bench_load.spec_for(args)
    assert (spec.router, spec.n_prefill, spec.n_decode) == ("vllm-router", 2, 3)
    assert routers_to_run(args.router) == ["vllm-router", "kvlink"]
    assert routers_to_run("kvlink") == ["kvlink"]
    with pytest.raises(ValueError, match="expected one of kvlink, vllm-router, both; got 'nginx'"):
        routers_to_run("nginx")


@pytest.mark.parametrize(("argv", "named"), [
    (["--router", "both", "--soak-minutes", "1"], "give --router kvlink or --router vllm-router"),
    (["--prefills", "0"], "--prefills"),
    (["--decodes", "65"], "--decodes"),
    (["--router", "nginx"], "--router"),
    (["--memory-json", "/tmp/kvlink-test-unwritten.json"], "--memory-json and --memory-plot keep the memory series"),
    (["--memory-plot", "/tmp/kvlink-test-chart.svg"], "expected a .png file path"),
])
def test_refused_options_name_the_option(argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["bench", "load", *argv])
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


def test_table_puts_routers_side_by_side() -> None:
    rows = table({
        "vllm-router": {"requests": 500.0, "ok": 450.0, "cancelled": 48.0, "cancelled_after_finishing": 2.0,
                        "errors": 0.0, "ttft_p50_s": 0.1234, "ttft_p99_s": 1.5, "leaks": {},
                        "decode_outcome_abort": 40.0, "disconnect_probe": "D abort"},
        "kvlink": {"requests": 500.0, "errors": 1.0, "leaks": {"decode": ["leases=1"]}},
    }).splitlines()
    assert rows[0].startswith("| router | requests | ok | cancelled |")
    assert len(rows) == 4 and all(r.count("|") == rows[0].count("|") for r in rows)
    assert rows[2].startswith("| vllm-router | 500 | 450 | 48 | 2 | 0 |") and "| 0.123 | 1.5 | 0 |" in rows[2]
    assert "D abort" in rows[2]
    assert rows[3].startswith("| kvlink | 500 |") and "| 1 |" in rows[3]  # one instance holds state
