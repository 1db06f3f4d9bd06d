"""Byte-exact pulls across processes for hybrid (full attention + Mamba2) and MLA models,
with different block and kernel block sizes on P and D.

Hybrid engines: P1 (block 16, kernel 16) → D2 (block 32, kernel 16) is TP 1→2 with
P 16 / D 32; P2 (block 32, kernel 8) → D1 (block 16, kernel 4) is TP 2→1 with
P 32 / D 16 and different kernel block sizes on every side. MLA: TP 2→1 (the latent
is replicated, so D reads it whole from one P rank and the other P rank is only notified).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kvpeer import Engine, n_blocks, pull_exact, start_engines, stop_engines

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

HYBRID = {"model": "hybrid-mamba2", "num_blocks": 40}
MLA = {"model": "deepseek-mla", "layers": 3, "block_size": 16, "num_blocks": 40}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    started = start_engines(
        Path(tmp_path_factory.mktemp("layouts")),
        {"engine_id": "HP1", "tp": 1, "block_size": 16, "kernel_block_size": 16, **HYBRID},
        {"engine_id": "HD2", "tp": 2, "block_size": 32, "kernel_block_size": 16, **HYBRID},
        {"engine_id": "HP2", "tp": 2, "block_size": 32, "kernel_block_size": 8, **HYBRID},
        {"engine_id": "HD1", "tp": 1, "block_size": 16, "kernel_block_size": 4, **HYBRID},
        {"engine_id": "MP2", "tp": 2, **MLA},
        {"engine_id": "MD1", "tp": 1, **MLA},
    )
    try:
        yield {e.engine_id: e for e in started}
    finally:
        stop_engines(started)


def _pull(p: Engine, d: Engine, rid: str, seed: int, prompt: int, p_bs: int, d_bs: int,
          hybrid: bool) -> None:
    p_att = [3 + 2 * i for i in range(n_blocks(prompt, p_bs))][::-1]
    d_att = [30 - i for i in range(n_blocks(prompt, d_bs))]
    p_ids, d_ids = ([p_att, [11]], [d_att, [5]]) if hybrid else ([p_att], [d_att])
    pull_exact(p, d, rid, seed, prompt, p_ids, d_ids)
    p.peers[0].wait_until(lambda: p.sent([rid]), 5.0, what="P frees")
    assert all(not s["lease_ids"] for s in p.call("state"))


def test_hybrid_tp1_to_tp2_block16_to_block32(engines: dict[str, Engine]) -> None:
    _pull(engines["HP1"], engines["HD2"], "h12", 12, 123, 16, 32, hybrid=True)


def test_hybrid_tp2_to_tp1_block32_kernel8_to_block16_kernel4(engines: dict[str, Engine]) -> None:
    _pull(engines["HP2"], engines["HD1"], "h21", 21, 200, 32, 16, hybrid=True)


def test_mla_tp2_to_tp1_reads_one_replica(engines: dict[str, Engine]) -> None:
    p, d = engines["MP2"], engines["MD1"]
    _pull(p, d, "m21", 33, 90, 16, 16, hybrid=False)
    # one READ from one P rank; the other P rank holds the same latent and was only notified
    (stats,) = d.call("stats")
    assert len(stats["transfers"]) == 1
    assert stats["transfers"][0]["nbytes"] == n_blocks(89, 16) * 16 * 3 * 576 * 2
