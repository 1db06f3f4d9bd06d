"""A hybrid request's SSM state moves even when D's prefix hit covers every shipped token."""

from __future__ import annotations

import pytest

from kvlink.cli.main import main
from kvlink.layout.presets import TINY_HYBRID
from kvlink.plan.report import EngineConfig, plan_report

ONE = EngineConfig(1, 16, 16)


@pytest.mark.parametrize("computed", [0, 16, 32])
def test_hybrid_state_moves_with_any_d_hit(computed: int) -> None:
    rank = plan_report(TINY_HYBRID, ONE, ONE, 33, computed)["d_ranks"][0]
    attention_blocks = (32 - computed) // 16
    # 2 attention layers x one descriptor per block, 2 SSM layers x 4 parts (conv x, B, C, state)
    assert rank["descriptors"] == 2 * attention_blocks + 2 * 4
    assert rank["source_ranks"] == [0]


def test_one_token_prompt_reads_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing precedes the only token: D starts from the zero state, P is only notified."""
    assert main(["plan", "--preset", "hybrid-mamba2", "--p-tp", "2", "--d-tp", "1", "--tokens", "1"]) == 0
    out = capsys.readouterr().out
    assert "request: 1-token prompt, ships no tokens (D computes the only prompt token); token chunk" in out
    assert "D rank 0: reads P [], notifies P [0, 1]; 0 descriptors" in out


def test_full_hit_without_state_reads_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "llama3-8b", "--p-tp", "1", "--d-tp", "1", "--tokens", "33",
                 "--d-computed-tokens", "32"]) == 0
    assert "D rank 0: reads P [], notifies P [0]; 0 descriptors" in capsys.readouterr().out


def test_cli_full_hit_reports_the_state(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "hybrid-mamba2", "--p-tp", "1", "--d-tp", "1", "--tokens", "33",
                 "--d-computed-tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert "ships no tokens (D has [0, 32) cached) plus SSM state" in out
    assert "D rank 0: reads P [0], notifies P [0]; 8 descriptors" in out
