"""Hostile or absurd values (negative, zero, huge, wrong type, inconsistent pairs) given to every
command line and every public constructor that takes sizes: each ends in exit 2 or a ValueError
naming the option, the value and the range, within 5 s and a bounded amount of memory. A
value in range may make `kvlink plan` plan up to its report bound (512 MiB of descriptor
lists, about 850 MB touched): that answer may take longer on a machine whose memory is
faulted in from its host on first touch (measured here: 3.3 s of system time for it, right
after an idle minute; 0.2 s when run again), so completed plans get PLAN_ANSWER_S.

Commands run in this process, so the bounds measure the command and not interpreter start-up:
a 5 s SIGALRM watchdog, and an address-space limit 2 GiB above the current size for the
duration of the call (an allocation beyond it fails the example with a MemoryError).
`kvlink plan` runs to the end; servers, the proxy, the demo and the benches run for minutes
by design, so for them the parser and its cross-checks run (`parse_args`), not the command.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import math
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlink.bench.cluster import ClusterSpec
from kvlink.bench.placement import Placement
from kvlink.bench.serve_bench import BenchConfig
from kvlink.bench.transfer import BenchOptions
from kvlink.cli.main import _build_parser, main, parse_args
from kvlink.cli.ranges import ranged, ranged_list
from kvlink.connector.config import ConnectorConfig
from kvlink.layout.geometry import build_worker_geometry
from kvlink.layout.limits import Bound, range_problem
from kvlink.layout.presets import LLAMA3_8B, TINY_HYBRID
from kvlink.layout.spec import ModelSpec
from kvlink.plan.report import EngineConfig, plan_report

ANSWER_S = 5.0
PLAN_ANSWER_S = 30.0
EXTRA_ADDRESS_SPACE = 2 << 30

HUGE_INTS = [0, -1, -5, 2**31, 2**40, 2**63, 2**64, 10**12, 10**30, -(10**30)]
BAD_TEXT = ["", "abc", "nan", "inf", "-inf", "0x10", "12abc", "1_0_"]
PLAN_BASE = ["plan", "--preset", "llama3-8b", "--p-tp", "1", "--d-tp", "1"]

# One valid command line per command; hostile options are added to it.
BASE_ARGV: dict[str, list[str]] = {
    "plan": PLAN_BASE,
    "serve": ["serve"],
    "proxy": ["proxy", "--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200"],
    "demo": ["demo"],
    "bench plan": ["bench", "plan"],
    "bench serve": ["bench", "serve"],
    "bench transfer": ["bench", "transfer"],
    "bench load": ["bench", "load"],
}


def _address_space_now() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def bounded_call(limit_s: float = ANSWER_S) -> Iterator[None]:
    """Fail the call if it runs past `limit_s` or maps more than EXTRA_ADDRESS_SPACE."""
    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"no answer within {limit_s} s")

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    previous = signal.signal(signal.SIGALRM, expire)
    resource.setrlimit(resource.RLIMIT_AS, (_address_space_now() + EXTRA_ADDRESS_SPACE, hard))
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.signal(signal.SIGALRM, previous)


def run_cli(argv: list[str], parse_only: bool = False, limit_s: float = ANSWER_S) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `kvlink argv`, in this process, bounded in time and memory."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), bounded_call(limit_s):
        try:
            if parse_only:
                parse_args(argv)
                code = 0
            else:
                code = main(argv)
        except SystemExit as exit_:
            code = int(exit_.code or 0)
    return code, out.getvalue(), err.getvalue()


def _subparser(command: str) -> argparse.ArgumentParser:
    args = _build_parser(BASE_ARGV[command]).parse_args(BASE_ARGV[command])
    parser: argparse.ArgumentParser = args._parser
    return parser


def _ranged_options() -> list[tuple[str, str, Bound]]:
    """(command, option, bound) of every option whose type is a range."""
    found = []
    for command in BASE_ARGV:
        for action in _subparser(command)._actions:
            if isinstance(action.type, (ranged, ranged_list)):
                found.append((command, action.option_strings[-1], action.type.bound))
    return found


RANGED = _ranged_options()


def _outside(bound: Bound) -> st.SearchStrategy[str]:
    """Text values argparse must refuse for `bound`."""
    numbers = [bound.low - 1, bound.high + 1, *HUGE_INTS]
    if bound.integer:
        texts = [str(int(n)) for n in numbers if not bound.low <= n <= bound.high] + ["2.5", "1e3", "1.0"]
    else:
        texts = [repr(float(n)) for n in numbers if not bound.low <= n <= bound.high]
    return st.sampled_from(texts + BAD_TEXT)


def _inside(bound: Bound) -> st.SearchStrategy[str]:
    low, high = bound.low, min(bound.high, 2**16 if bound.integer else 60.0)
    if bound.integer:
        return st.integers(int(low), int(high)).map(str)
    return st.floats(low, high, allow_nan=False).map(repr)


def test_every_numeric_option_of_every_command_has_a_range() -> None:
    commands_seen = {command for command, _, _ in RANGED}
    assert commands_seen == set(BASE_ARGV)
    for command in BASE_ARGV:
        for action in _subparser(command)._actions:
            assert action.type not in (int, float), f"kvlink {command} {action.option_strings}: raw {action.type}"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_out_of_range_option_exits_2_naming_option_value_and_range(data: st.DataObject) -> None:
    command, option, bound = data.draw(st.sampled_from(RANGED))
    value = data.draw(_outside(bound))
    code, _, err = run_cli([*BASE_ARGV[command], f"{option}={value}"], parse_only=True)
    assert code == 2
    assert f"argument {option}: expected" in err and repr(value)[1:-1] in err, err
    assert "Traceback" not in err


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_in_range_option_is_accepted(data: st.DataObject) -> None:
    command, option, bound = data.draw(st.sampled_from([r for r in RANGED if r[0] != "plan"]))
    value = data.draw(_inside(bound))
    code, _, err = run_cli([*BASE_ARGV[command], f"{option}={value}"], parse_only=True)
    assert code == 0 or ("argument" not in err and "Traceback" not in err), err


PLAN_VALUES = {
    "--p-tp": [1, 2, 4, 8, 3, 256, 257, 0, -1, 10**6],
    "--d-tp": [1, 2, 8, 256, 0, 10**6],
    "--p-block-size": [1, 16, 32, 48, 65536, 65537, 0, 2**40],
    "--d-block-size": [1, 16, 64, 65536, 0, -16],
    "--p-kernel-block-size": [1, 8, 16, 0, 5, 2**40],
    "--d-kernel-block-size": [1, 16, 3, 0],
    "--tokens": [1, 2, 31, 32, 1000, 2**20, 2**24, 2**24 + 1, 0, -5, 10**12],
    "--d-computed-tokens": [0, 16, 31, 32, 1000, 2**24, -1],
    "--scatter": [0, 7, 2**63, -1],
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(options=st.sets(st.sampled_from(sorted(PLAN_VALUES)), max_size=5)
       .flatmap(lambda keys: st.fixed_dictionaries({k: st.sampled_from(PLAN_VALUES[k]) for k in keys})),
       preset=st.sampled_from(["llama3-8b", "deepseek-mla", "hybrid-mamba2", "smollm2-135m"]),
       as_json=st.booleans())
def test_plan_answers_any_mix_of_values(options: dict[str, int], preset: str, as_json: bool) -> None:
    argv = ["plan", "--preset", preset, "--p-tp", "1", "--d-tp", "1"]
    argv += [f"{k}={v}" for k, v in options.items()] + (["--json"] if as_json else [])
    started = time.monotonic()
    code, out, err = run_cli(argv, limit_s=PLAN_ANSWER_S)
    elapsed = time.monotonic() - started
    assert code in (0, 2), (code, err)
    assert "Traceback" not in err
    if code == 0:
        assert out
    else:
        assert err.startswith(("kvlink plan: ", "usage: kvlink plan")), err
        assert elapsed < ANSWER_S, f"refused after {elapsed:.1f} s"


@pytest.mark.parametrize(("args", "expected"), [
    (["--tokens", "0"], "argument --tokens: expected an integer in [1, 16777216], got 0"),
    (["--tokens", "-5"], "argument --tokens: expected an integer in [1, 16777216], got -5"),
    (["--tokens", "32", "--d-computed-tokens", "32"],
     "--d-computed-tokens 32 must be below --tokens 32"),
    (["--tokens", "32", "--d-computed-tokens", "48"], "--d-computed-tokens 48 must be below --tokens 32"),
    (["--p-kernel-block-size", "0"], "argument --p-kernel-block-size: expected an integer in [1, 65536], got 0"),
    (["--tokens", "1000000000000"], "argument --tokens: expected an integer in [1, 16777216], got 1000000000000"),
    (["--p-block-size", "1099511627776"], "argument --p-block-size: expected an integer in [1, 65536]"),
    (["--p-tp", "1000000"], "argument --p-tp: expected an integer in [1, 256], got 1000000"),
    (["--scatter", "-1"], "argument --scatter: expected an integer in [0, 9223372036854775807], got -1"),
])
def test_issue_examples_are_refused_naming_the_option(args: list[str], expected: str) -> None:
    code, _, err = run_cli([*PLAN_BASE, *args])
    assert code == 2 and expected in err, err


def test_plan_at_the_widest_tp_answers_within_the_bound() -> None:
    code, out, err = run_cli(["plan", "--preset", "llama3-8b", "--p-tp", "256", "--d-tp", "256", "--tokens", "16"])
    assert code == 0, err
    assert "D rank 255: reads P [255], notifies P [255]" in out


def test_plan_over_the_report_bound_is_refused_with_its_size() -> None:
    code, _, err = run_cli([*PLAN_BASE, "--tokens", "16777216", "--p-block-size", "1", "--d-block-size", "1"])
    assert code == 2
    assert "the plans of all 1 D rank(s) needs 24576.0 MiB of descriptor lists" in err, err


def test_plan_json_over_the_report_bound_is_refused() -> None:
    code, _, err = run_cli([*PLAN_BASE, "--tokens", "6000000", "--json"])
    assert code == 2 and "more than the bound of 512 MiB" in err and "caps --json at" in err, err


def test_bench_plan_over_the_bound_exits_2() -> None:
    code, _, err = run_cli(["bench", "plan", "--tokens", "16777216", "--repeat", "1"])
    assert code == 2 and "MiB of descriptor lists" in err, err


@pytest.mark.parametrize(("args", "expected"), [
    (["serve", "--kv-port", "65535", "--tp", "2"], "--kv-port must be at most 65534"),
    (["serve", "--block-size", "16", "--kernel-block-size", "5"], "--kernel-block-size 5 must divide --block-size 16"),
    (["serve", "--num-blocks", "16777216", "--block-size", "65536"], "GiB of KV memory per rank for smollm2-135m"),
    (["serve", "--model", "tiny-hybrid", "--tp", "3"], "--model tiny-hybrid with --tp 3"),
    (["serve", "--port", "0"], "argument --port: expected an integer in [1, 65535], got 0"),
    (["serve", "--lease-s", "-1"], "argument --lease-s: expected a number in [0.001, 604800], got -1.0"),
    (["serve", "--stall-timeout-s", "nan"], "argument --stall-timeout-s: expected a number"),
    (["serve", "--log-level", "loud"], "argument --log-level: invalid choice"),
    (["serve", "--prefill-chunk", "-1"], "argument --prefill-chunk: expected an integer in [0, 16777216], got -1"),
    (["proxy", "--prefill", "ftp://127.0.0.1:1", "--decode", "http://127.0.0.1:2"], "--prefill: expected an http"),
    (["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://:2"], "--decode: expected an http"),
    (["proxy", "--prefill", "http://127.0.0.1:99999", "--decode", "http://h:2"], "--prefill: expected an http"),
    (["proxy", "--prefill", "http://a", "--decode", "http://b", "--timeout-s", "0"], "argument --timeout-s"),
    (["bench", "load", "--concurrency", "0"], "argument --concurrency: expected an integer in [1, 1024], got 0"),
    (["bench", "load", "--cancel-fraction", "1.5"], "argument --cancel-fraction: expected a number in [0, 1]"),
    (["bench", "serve", "--prompt-len", "1"], "argument --prompt-len: expected an integer in [2, 16777216], got 1"),
    (["bench", "transfer", "--tokens", "512,-1"], "argument --tokens: expected an integer in [1, 16777216], got -1"),
    (["bench", "transfer", "--tokens", ","], "argument --tokens: expected comma-separated values"),
    (["bench", "plan", "--tokens", "1"], "argument --tokens: expected an integer in [2, 16777216], got 1"),
])
def test_servers_proxy_and_benches_refuse_bad_values(args: list[str], expected: str) -> None:
    code, _, err = run_cli(args, parse_only=True)
    assert code == 2 and expected in err, err


# ---- public constructors -----------------------------------------------------------------

HOSTILE_OBJECTS: list[Any] = [*HUGE_INTS, -0.5, 1e308, math.nan, math.inf, -math.inf, "16", None, True, [], 2.5]


def _valid(bound: Bound) -> Any:
    return int(bound.low) if bound.integer else float(bound.low)


def _bounded_fields(cls: type) -> list[tuple[str, Bound]]:
    return [(f.name, f.metadata["bound"]) for f in dataclasses.fields(cls) if "bound" in f.metadata]


CONFIG_CLASSES: dict[type, Callable[..., Any]] = {
    ConnectorConfig: lambda **kw: ConnectorConfig("E", **kw),
    EngineConfig: lambda **kw: EngineConfig(**{"tp": 1, "block_size": 16, "kernel_block_size": 16, **kw}),
    BenchConfig: lambda **kw: BenchConfig(**kw),
    Placement: lambda **kw: Placement(**kw),
    ClusterSpec: lambda **kw: ClusterSpec(**kw),
}
CONFIG_FIELDS = [(cls, name, bound) for cls in CONFIG_CLASSES for name, bound in _bounded_fields(cls)]


def test_config_classes_declare_their_ranges() -> None:
    names = {(cls.__name__, name) for cls, name, _ in CONFIG_FIELDS}
    assert {("ConnectorConfig", "side_channel_port"), ("ConnectorConfig", "lease_s"),
            ("ConnectorConfig", "stall_timeout_s"), ("EngineConfig", "tp"),
            ("BenchConfig", "concurrency"), ("ClusterSpec", "num_blocks")} <= names


@settings(max_examples=150, deadline=None)
@given(field=st.sampled_from(CONFIG_FIELDS), value=st.sampled_from(HOSTILE_OBJECTS))
def test_config_field_out_of_range_is_a_value_error_naming_it(field: tuple[type, str, Bound],
                                                              value: Any) -> None:
    cls, name, bound = field
    build = CONFIG_CLASSES[cls]
    with bounded_call():
        if range_problem(value, bound) is None:
            build(**{name: value})
            return
        with pytest.raises(ValueError) as refused:
            build(**{name: value})
    assert str(refused.value).startswith(f"{name}: expected {bound.describe()}, got"), refused.value


@settings(max_examples=40, deadline=None)
@given(field=st.sampled_from(CONFIG_FIELDS), data=st.data())
def test_config_field_in_range_is_accepted(field: tuple[type, str, Bound], data: st.DataObject) -> None:
    cls, name, bound = field
    value = data.draw(st.sampled_from([_valid(bound), bound.high]))
    assert getattr(CONFIG_CLASSES[cls](**{name: value}), name) == value


GEOMETRY_ARGS = ("tp_size", "tp_rank", "block_size", "kernel_block_size", "num_blocks", "device_id")


@settings(max_examples=120, deadline=None)
@given(arg=st.sampled_from(GEOMETRY_ARGS), value=st.sampled_from(HOSTILE_OBJECTS),
       model=st.sampled_from([LLAMA3_8B, TINY_HYBRID]))
def test_geometry_builder_refuses_hostile_sizes(arg: str, value: Any, model: ModelSpec) -> None:
    kwargs: dict[str, Any] = {"tp_size": 2, "tp_rank": 0, "block_size": 16, "kernel_block_size": 16,
                              "num_blocks": 8, "device_id": 0}
    kwargs[arg] = value
    with bounded_call():
        try:
            build_worker_geometry(model, base_addrs=[i << 32 for i in range(model.num_layers)], **kwargs)
        except ValueError as error:
            assert arg in str(error) or "block_size" in str(error) or "units" in str(error), error


@settings(max_examples=60, deadline=None)
@given(prompt_tokens=st.sampled_from([*HOSTILE_OBJECTS, 1, 64]),
       computed=st.sampled_from([*HOSTILE_OBJECTS, 0, 16]))
def test_plan_report_refuses_hostile_requests(prompt_tokens: Any, computed: Any) -> None:
    config = EngineConfig(1, 16, 16)
    with bounded_call():
        try:
            plan_report(LLAMA3_8B, config, config, prompt_tokens, computed)
        except ValueError as error:
            assert "prompt_tokens" in str(error) or "d_computed_tokens" in str(error) \
                or "multiple of the local block size" in str(error), error


MODEL_FIELDS = ("num_kv_heads", "head_dim", "num_heads", "n_groups", "d_state", "conv_kernel", "window")


@settings(max_examples=80, deadline=None)
@given(field=st.sampled_from(MODEL_FIELDS), value=st.sampled_from([*HOSTILE_OBJECTS, "abc", 1]))
def test_model_spec_from_the_wire_refuses_hostile_dims(field: str, value: Any) -> None:
    data = {"name": "m", "num_kv_heads": 4, "head_dim": 32, "dtype": "float32", "layer_groups": [0, 1, 2],
            "groups": [{"kind": "full"}, {"kind": "sliding", "window": 64},
                       {"kind": "mamba2", "num_heads": 8, "head_dim": 16, "n_groups": 2, "d_state": 16,
                        "conv_kernel": 4}]}
    if field in data:
        data[field] = value
    else:
        group = data["groups"][1 if field == "window" else 2]
        assert isinstance(group, dict)
        group[field] = value
    with bounded_call():
        try:
            ModelSpec.from_dict(data)
        except ValueError as error:
            assert field in str(error) or "malformed" in str(error) or "invalid literal" in str(error), error


@pytest.mark.parametrize("kwargs", [
    {"tokens": []}, {"tokens": [0]}, {"tokens": [2**40]}, {"p_tp": 0}, {"d_tp": 10**6},
    {"block_size": -16}, {"repeats": 0}, {"min_seconds": -1.0}, {"max_gib": math.inf}, {"layers": 0},
])
def test_bench_transfer_options_refuse_hostile_values(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="expected"):
        BenchOptions(**kwargs)


def test_connector_sides_refuse_bad_sizes() -> None:
    from kvlink.connector.scheduler import NixlScheduler
    from kvlink.connector.worker import NixlWorker

    with pytest.raises(ValueError, match=r"tp_size: expected an integer in \[1, 256\], got 0"):
        NixlScheduler(ConnectorConfig("D"), tp_size=0)
    with pytest.raises(ValueError, match="use a base port of at most 65534"):
        NixlWorker(ConnectorConfig("P", side_channel_port=65535), LLAMA3_8B, 2, 1, 16, 16, 8)
    with pytest.raises(ValueError, match=r"num_blocks: expected an integer in \[1, 16777216\], got 0"):
        NixlWorker(ConnectorConfig("P"), LLAMA3_8B, 1, 0, 16, 16, 0)


def test_issue_crashes_end_in_exit_2_in_a_fresh_process() -> None:
    """The issue's MemoryError and hang cases, as a user runs them, under a 2 GiB address-space limit."""
    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (EXTRA_ADDRESS_SPACE + (1 << 30), resource.RLIM_INFINITY))

    for args in (["--tokens", "1000000000000"], ["--p-tp", "1000000"]):
        done = subprocess.run([sys.executable, "-m", "kvlink.cli.main", *PLAN_BASE, *args], capture_output=True,
                              text=True, timeout=60, preexec_fn=limit_memory)
        assert done.returncode == 2, (args, done.stderr[-2000:])
        assert f"argument {args[0]}: expected an integer" in done.stderr
        assert "Traceback" not in done.stderr
