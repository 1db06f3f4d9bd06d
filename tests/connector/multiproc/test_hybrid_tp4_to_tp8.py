"""Hybrid (full attention + Mamba2) P TP 4 -> D TP 8 across processes over real NIXL, with D
prefix hits: every D rank reads from one P rank only (the B/C conv groups that two P ranks
hold come from the one it reads attention from), gets P's SSM state even when its cache
holds every shipped token, and each P rank frees after the 2 notifications it waits for."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kvpeer import Engine, n_blocks, start_engines, stop_engines

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

HYBRID = {"model": "hybrid-mamba2", "block_size": 16, "kernel_block_size": 16, "num_blocks": 40}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    started = start_engines(
        Path(tmp_path_factory.mktemp("hybrid-tp48")),
        {"engine_id": "HP4", "tp": 4, **HYBRID},
        {"engine_id": "HD8", "tp": 8, **HYBRID},
    )
    try:
        yield {e.engine_id: e for e in started}
    finally:
        stop_engines(started)


@pytest.mark.parametrize(("prompt", "computed"), [(33, 32), (60, 16)], ids=["full-hit", "partial-hit"])
def test_d_hit_gets_the_state_from_one_p_rank_per_d_rank(
        engines: dict[str, Engine], prompt: int, computed: int) -> None:
    p, d = engines["HP4"], engines["HD8"]
    rid, seed = f"h48-{computed}", prompt + computed
    p_ids = [[3 + i for i in range(n_blocks(prompt, 16))], [11]]
    hits = computed // 16
    table = [[30 - i for i in range(n_blocks(prompt, 16))], [5]]  # the first `hits` are D's hits
    d.call("snapshot")
    for peer in d.peers:
        peer.call("stats", reset=True)
    params = p.prefill(rid, seed, prompt, p_ids)
    (load,) = d.decode(f"d-{rid}", params, prompt, table, computed=computed)["loads"]
    assert load["local_computed_tokens"] == computed
    d.wait_settled([f"d-{rid}"])
    assert not d.failed([f"d-{rid}"])
    d.verify([{"rid": rid, "seed": seed, "tokens": prompt - 1, "computed": computed,
               "block_ids": [table[0][hits:], table[1]]}])
    reads = [peer.call("stats")["transfers"] for peer in d.peers]
    assert [len(r) for r in reads] == [1] * 8, "each D rank reads from exactly one P rank"
    p.peers[0].wait_until(lambda: p.sent([rid]), 5.0, what="every P rank frees")
    assert all(not s["lease_ids"] for s in p.call("state"))


def test_push_mode_full_hit_writes_the_state(engines: dict[str, Engine]) -> None:
    """transfer_mode "push": each P rank WRITEs the state parts its D ranks read from it."""
    p, d = engines["HP4"], engines["HD8"]
    prompt, computed, rid, seed = 33, 32, "h48-push", 99
    p_ids, table = [[20, 21, 22], [12]], [[8, 9, 10], [6]]
    d.call("snapshot")
    params = p.prefill(rid, seed, prompt, p_ids, transfer_mode="push")
    d.decode(f"d-{rid}", params, prompt, table, computed=computed)
    d.wait_settled([f"d-{rid}"])
    assert not d.failed([f"d-{rid}"])
    d.verify([{"rid": rid, "seed": seed, "tokens": prompt - 1, "computed": computed,
               "block_ids": [table[0][2:], table[1]]}])
    p.peers[0].wait_until(lambda: p.sent([rid]), 5.0, what="every P rank frees after its WRITEs")
