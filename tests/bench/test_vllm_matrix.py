"""`kvlink bench vllm-matrix`: its cells, prompts, references and how outcomes are summed up
(the servers' part runs in the bench itself; docs/vllm.md's matrix is its output)."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import httpx
import pytest

from kvlink.bench import vllm_matrix
from kvlink.bench.vllm_matrix import (
    CELLS,
    FAMILIES,
    PRIMARY,
    SECONDARY,
    Cell,
    MatrixConfig,
    ServerPool,
    Side,
    _references_needed,
    markdown,
    prompts_for,
    summarize,
)


def test_every_cell_names_a_known_family_and_kind() -> None:
    assert {c.family for c in CELLS} <= set(FAMILIES)
    assert {c.kind for c in CELLS} <= {"pull", "push", "prefix"}
    assert len({c.key for c in CELLS}) == len(CELLS)


def test_prefix_prompts_share_a_prefix_of_whole_blocks() -> None:
    prompts = prompts_for(Cell("dense", "x", Side(), Side(), "prefix"))
    assert len(prompts) == 3 and len(set(prompts)) == 3
    shared = min(len(p) for p in prompts)
    while len({p[:shared] for p in prompts}) > 1:
        shared -= 1
    assert shared > 2000  # characters: several 128-token blocks of the story


def test_references_add_p_flags_only_when_tp_differs() -> None:
    same = _references_needed(Cell("dense", "x", Side(block=32), Side()))
    assert list(same) == [PRIMARY]
    mixed = _references_needed(Cell("dense", "x", Side(tp=2), Side()))
    assert mixed[SECONDARY].tp == 2 and mixed[PRIMARY].tp == 1


def _answer(outcome: str, detail: str = "") -> dict[str, object]:
    return {"outcome": outcome, **({"detail": detail} if detail else {})}


@pytest.mark.parametrize(("result", "expected"), [
    ({"answers": [_answer("exact")] * 6}, "exact 6/6"),
    ({"answers": [_answer("exact")] * 2 + [_answer("wrong text")] * 4}, "wrong text 4/6; exact 2/6"),
    ({"answers": [_answer("HTTP error", "D: 500 boom")] * 6}, "HTTP error 6/6; first error: D: 500 boom"),
    ({"answers": [_answer("exact"), _answer("hang", "D: None timeout")], "stopped": "hang past 60 s"},
     "hang past 60 s; exact 1/6; first error: D: None timeout"),
    ({"start_failed": "nixl-P: AssertionError: DS"}, "start failed: nixl-P: AssertionError: DS"),
    ({"answers": [{"outcome": "wrong text", "equal": {PRIMARY: False, SECONDARY: True}}] * 2},
     "wrong text 2/6; equal to colocated at P's flags 2/6"),
])
def test_summaries(result: dict[str, object], expected: str) -> None:
    assert summarize(result, 6) == expected


def test_markdown_has_a_row_per_cell_and_a_column_per_connector() -> None:
    report = {"config": {"connectors": ["nixl", "kvlink"]}, "cells": [
        {"key": "dense: P TP 2 -> D TP 1", "connectors": {"nixl": {"summary": "wrong text 6/6"},
                                                         "kvlink": {"summary": "exact 6/6"}}},
        {"key": "mla: same", "reference_failed": "boom"},
    ]}
    lines = markdown(report).splitlines()
    assert lines[0] == "| family | case | NixlConnector | kvlink |"
    assert lines[2] == "| dense | P TP 2 -> D TP 1 | wrong text 6/6 | exact 6/6 |"
    assert lines[3].count("colocated reference failed") == 2


def test_cli_lists_cells_and_refuses_unknown_ones() -> None:
    run = [sys.executable, "-m", "kvlink.cli.main", "bench", "vllm-matrix"]
    listed = subprocess.run([*run, "--list"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and len(listed.stdout.splitlines()) == len(CELLS)
    bad = subprocess.run([*run, "--cells", "999"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--cells takes numbers" in bad.stdout


def test_a_cell_starts_with_only_its_own_servers_running(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Idle servers of earlier cells are stopped before the next cell's reference starts."""
    stopped: list[str] = []
    monkeypatch.setattr(vllm_matrix, "stop_servers", lambda services: stopped.extend(s for s in services))
    pool = ServerPool(MatrixConfig(log_dir=tmp_path), "s" * 32, lambda _line: None)
    first, second = CELLS[0], CELLS[1]  # dense prefix and dense push: same sides, other servers
    for role, key in ServerPool._keys("nixl", FAMILIES[first.family], first).items():
        pool.running[key] = f"first-{role}"  # type: ignore[assignment]
    pool.keep_only("nixl", FAMILIES[first.family], first)
    assert stopped == [] and len(pool.running) == 2
    pool.keep_only("nixl", FAMILIES[second.family], second)
    assert sorted(stopped) == ["first-D", "first-P"] and pool.running == {}


def test_a_server_up_but_silent_is_a_hang_not_a_crash_of_the_run(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """Seen with two TP 2 servers on two cores: /health said up, /v1/models then timed out; the
    cell is a hang and the run goes on to the next cell."""
    def silent(url: str) -> str:
        raise httpx.ReadTimeout("timed out")

    monkeypatch.setattr(vllm_matrix, "served_model", silent)
    server = types.SimpleNamespace(url="http://127.0.0.1:9")
    result = vllm_matrix.run_pd(MatrixConfig(log_dir=tmp_path), "nixl", CELLS[0], server, server,  # type: ignore[arg-type]
                                ["a prompt"], {})
    assert result["answers"] == [] and result["stopped"].startswith("hang")
    assert summarize(result, 1).startswith("hang: D did not list its model")
