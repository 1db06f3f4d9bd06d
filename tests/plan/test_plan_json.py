"""`kvlink plan --json`: realistic plans are listed whole, as a stream, and only plans past the
report's bound (which no deployment of a preset reaches) are refused, naming it."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from kvlink.cli.main import main
from kvlink.layout.presets import LLAMA3_8B, PRESETS, TINY_HYBRID
from kvlink.layout.spec import ModelSpec
from kvlink.plan.budget import plan_bytes
from kvlink.plan.compat import IncompatibleLayout, check_configuration
from kvlink.plan.report import (
    D_ADDRESS_SPACE,
    MAX_LISTED_TRANSFERS,
    P_ADDRESS_SPACE,
    REPORT_MAX_PLAN_BYTES,
    EngineConfig,
    blocks_for,
    fake_engine,
    plan_report,
)
from kvlink.plan.report_json import plan_json

LLAMA = ["plan", "--preset", "llama3-8b"]


@pytest.mark.parametrize(("args", "transfers"), [
    # P TP 2 -> D TP 16: each D rank reads its head of every page of 32 layers
    (["--p-tp", "2", "--d-tp", "16", "--tokens", "1132"], 16 * 32 * -(-1131 // 16)),
    (["--p-tp", "2", "--d-tp", "16", "--tokens", "4577"], 16 * 32 * 4576 // 16),
    # D kernel blocks of 8 tokens: 8-token chunks of 4096 tokens, one piece per KV head (8),
    # in 32 layers
    (["--p-tp", "1", "--d-tp", "1", "--tokens", "4097", "--d-kernel-block-size", "8"],
     32 * 4096 // 8 * 8),
])
def test_realistic_plans_are_listed_whole(args: list[str], transfers: int,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*LLAMA, *args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sum(len(rank["transfers"]) for rank in report["d_ranks"]) == transfers > 30_000
    for rank in report["d_ranks"]:
        assert len(rank["transfers"]) == rank["descriptors"]
        assert sum(t["length"] for t in rank["transfers"]) == rank["bytes"]


@pytest.mark.parametrize(("model", "p", "d", "tokens", "computed", "scatter"), [
    (TINY_HYBRID, EngineConfig(1, 32, 16), EngineConfig(2, 16, 16), 40, 0, None),
    (TINY_HYBRID, EngineConfig(2, 16, 16), EngineConfig(1, 16, 8), 70, 16, 3),
    (PRESETS["deepseek-mla"], EngineConfig(4, 16, 16), EngineConfig(2, 16, 16), 100, 0, 7),
    (LLAMA3_8B, EngineConfig(1, 16, 16), EngineConfig(1, 16, 16), 1, 0, None),
])
def test_the_stream_is_the_report(model: ModelSpec, p: EngineConfig, d: EngineConfig, tokens: int,
                                  computed: int, scatter: int | None) -> None:
    streamed = json.loads("".join(plan_json(model, p, d, tokens, computed, scatter)))
    whole = plan_report(model, p, d, tokens, computed, scatter, with_transfers=True)
    assert streamed == whole
    assert list(streamed) == list(whole)
    assert [list(rank) for rank in streamed["d_ranks"]] == [list(rank) for rank in whole["d_ranks"]]


def test_the_writer_holds_pieces_not_the_document() -> None:
    pieces = plan_json(LLAMA3_8B, EngineConfig(2, 16, 16), EngineConfig(16, 16, 16), 4577)
    tracemalloc.start()
    try:
        size = largest = 0
        for piece in pieces:
            size += len(piece)
            largest = max(largest, len(piece))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # a 17 MB document, written in pieces of some hundred KB by a writer that never holds
    # more than a few MB (one D rank's plan and one batch of text)
    assert size > 15 * 2**20
    assert largest < 2**20
    assert peak < size / 4, (peak, size)


def test_errors_come_before_any_text() -> None:
    with pytest.raises(IncompatibleLayout):
        plan_json(PRESETS["smollm2-135m"], EngineConfig(2, 16, 16), EngineConfig(1, 16, 16), 40)
    with pytest.raises(ValueError, match="multiple of the local block size"):
        plan_json(LLAMA3_8B, EngineConfig(1, 16, 16), EngineConfig(1, 16, 16), 40, 5)


def test_past_the_report_bound_json_is_refused_naming_the_bound(capsys: pytest.CaptureFixture[str]) -> None:
    # 32 layers x 2 sides x 24 bytes per 16 tokens: 6 Mi tokens need 576 MiB of lists
    assert main([*LLAMA, "--p-tp", "1", "--d-tp", "1", "--tokens", str(6 * 2**20), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "needs 576.0 MiB of descriptor lists" in captured.err
    assert "more than the bound of 512 MiB; that is the report's bound" in captured.err
    assert f"caps --json at {MAX_LISTED_TRANSFERS} transfers" in captured.err
    assert MAX_LISTED_TRANSFERS == 11_184_810


def test_the_bound_holds_every_preset_at_128k_tokens_and_tp_up_to_8() -> None:
    """The reason the bound gives: a 128 Ki-token request of every preset, P and D at TP
    1..8, equal or unequal (kernel) block sizes, stays under it."""
    tokens, largest = 2**17, 0
    blocks = [(16, 16, 16, 16), (16, 8, 16, 16), (16, 16, 16, 8), (64, 64, 16, 16), (16, 16, 64, 64),
              (32, 16, 16, 8)]
    for model in PRESETS.values():
        for p_tp in (1, 2, 4, 8):
            for d_tp in (1, 2, 4, 8):
                for p_bs, p_kbs, d_bs, d_kbs in blocks:
                    try:
                        check_configuration(model, model, p_tp, d_tp, p_bs, p_kbs, d_bs, d_kbs)
                    except IncompatibleLayout:
                        continue
                    p = fake_engine(model, EngineConfig(p_tp, p_bs, p_kbs), blocks_for(tokens, p_bs),
                                    P_ADDRESS_SPACE)
                    d = fake_engine(model, EngineConfig(d_tp, d_bs, d_kbs), blocks_for(tokens, d_bs),
                                    D_ADDRESS_SPACE)
                    largest = max(largest, sum(plan_bytes(reader, dict(enumerate(p))) for reader in d))
    assert largest == 366 * 2**20 < REPORT_MAX_PLAN_BYTES


def test_a_reader_that_leaves_early_ends_the_stream_quietly() -> None:
    """`kvlink plan --json | head`: the closed pipe ends the command, exit 0, no traceback."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "kvlink.cli.main", "plan", "--preset", "llama3-8b",
                             "--p-tp", "2", "--d-tp", "16", "--tokens", "4577", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(100)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
