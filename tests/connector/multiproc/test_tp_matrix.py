"""P and D workers in separate processes over real NIXL: every TP pairing moves exact bytes.

Attention-only model (llama3-8b geometry cut to 2 layers, head_dim 32): each rank's
memory is a few MiB. One module-scoped set of engines (P and D at TP 1, 2, 4) serves
every pairing; each test uses its own request and block ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kvpeer import Engine, blocks, n_blocks, pull_exact, start_engines, stop_engines

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

MODEL = {"model": "llama3-8b", "layers": 2, "model_overrides": {"head_dim": 32},
         "block_size": 16, "num_blocks": 128}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    log_dir = Path(tmp_path_factory.mktemp("tp-matrix"))
    started = start_engines(
        log_dir,
        *[{"engine_id": f"P{tp}", "tp": tp, **MODEL} for tp in (1, 2, 4)],
        *[{"engine_id": f"D{tp}", "tp": tp, **MODEL} for tp in (1, 2, 4)],
    )
    try:
        yield {e.engine_id: e for e in started}
    finally:
        stop_engines(started)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2)])
def test_pull_is_byte_exact_and_p_frees(engines: dict[str, Engine], p_tp: int, d_tp: int) -> None:
    p, d = engines[f"P{p_tp}"], engines[f"D{d_tp}"]
    prompt = 150  # 149 tokens ship: 10 blocks of 16, the last one partial
    rid, seed = f"tp{p_tp}{d_tp}", 100 * p_tp + d_tp
    p_ids = [blocks(7, n_blocks(prompt, 16))[::-1]]  # reversed: nothing merges on P
    d_ids = [[2 * i + 1 for i in range(n_blocks(prompt, 16))]]  # every other block on D
    pull_exact(p, d, rid, seed, prompt, p_ids, d_ids)
    p.peers[0].wait_until(lambda: p.sent([rid]), 5.0, what="P frees")
    assert all(not s["lease_ids"] for s in p.call("state"))
    # every D rank read its share; together the ranks moved each byte of the request once
    per_token = 2 * 2 * 8 * 32 * 2  # layers x (K,V) x heads x head_dim x bf16
    moved = sum(peer.call("stats")["counters"]["bytes_total"] for peer in d.peers)
    assert moved >= (prompt - 1) * per_token


PER_TOKEN_TP1 = 2 * 2 * 8 * 32 * 2  # layers x (K,V) x heads x head_dim x bf16


def test_prefix_on_d_moves_only_the_tail(engines: dict[str, Engine]) -> None:
    """D's scheduler side sees a 3-block local prefix hit and hands the worker the whole
    block table; only tokens [48, 99) move, the prefix blocks stay untouched."""
    p, d = engines["P1"], engines["D1"]
    prompt, computed, seed = 100, 48, 77
    p_ids = [blocks(40, n_blocks(prompt, 16))]
    table = [[60, 61, 62, 70, 72, 74, 76]]  # 3 prefix-hit blocks, then the newly allocated tail
    d.call("snapshot")
    before = d.peers[0].call("stats", reset=True)["counters"]["bytes_total"]
    params = p.prefill("pfx", seed, prompt, p_ids)
    meta = d.decode("d-pfx", params, prompt, table, computed=computed)
    (load,) = meta["loads"]
    assert load["local_computed_tokens"] == computed
    d.wait_settled(["d-pfx"])
    assert not d.failed(["d-pfx"])
    d.verify([{"rid": "pfx", "seed": seed, "tokens": prompt - 1, "computed": computed,
               "block_ids": [table[0][3:]]}])
    stats = d.peers[0].call("stats")
    tail = n_blocks(prompt - 1 - computed, 16) * 16 * PER_TOKEN_TP1  # whole 16-token chunks move
    assert stats["counters"]["bytes_total"] - before == tail
    assert [t["nbytes"] for t in stats["transfers"]] == [tail]
    p.peers[0].wait_until(lambda: p.sent(["pfx"]), 5.0, what="P frees")


def test_fifty_concurrent_requests_share_one_handshake(
    engines: dict[str, Engine], tmp_path: Path,
) -> None:
    """A fresh D engine gets 50 requests for P2 in one step: one handshake, one payload
    served per P rank, 50 exact loads, P frees all 50."""
    p = engines["P2"]
    (fresh,) = start_engines(tmp_path, {"engine_id": "Dfresh", "tp": 1, **MODEL})
    try:
        served_before = [s["listener"]["served"] for s in p.call("state")]
        prompt, per = 20, 2  # 19 tokens ship: 2 blocks of 16 per request
        requests, loads = [], []
        for i in range(50):
            rid, p_ids, d_ids = f"c{i}", [blocks(i * per, per)], [[127 - i, 70 - i]]
            params = p.prefill(rid, 5000 + i, prompt, p_ids)
            req = fresh.decode(f"d-{rid}", params, prompt, d_ids, send=False)
            loads += req["loads"]
            requests.append({"rid": rid, "seed": 5000 + i, "tokens": prompt - 1, "block_ids": d_ids})
        fresh.call("snapshot")
        fresh.step(loads=loads)
        fresh.wait_settled([f"d-c{i}" for i in range(50)])
        assert not fresh.failed([f"d-c{i}" for i in range(50)])
        fresh.verify(requests)
        (state,) = fresh.call("state")
        assert state["handshakes_started"] == 1
        assert state["remote_engines"] == ["P2"]
        served = [s["listener"]["served"] - b for s, b in zip(p.call("state"), served_before, strict=True)]
        assert served == [1, 1]
        p.peers[0].wait_until(lambda: p.sent([f"c{i}" for i in range(50)]), 5.0, what="P frees")
    finally:
        fresh.stop()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (4, 2)])
def test_push_mode_is_byte_exact(engines: dict[str, Engine], p_tp: int, d_tp: int) -> None:
    """transfer_mode "push": D announces its blocks, each source P rank WRITEs into them."""
    p, d = engines[f"P{p_tp}"], engines[f"D{d_tp}"]
    prompt, rid, seed = 70, f"push{p_tp}{d_tp}", 300 + p_tp
    p_ids = [blocks(80, n_blocks(prompt, 16))]
    d_ids = [blocks(60, n_blocks(prompt, 16))[::-1]]
    pull_exact(p, d, rid, seed, prompt, p_ids, d_ids, transfer_mode="push")
    p.peers[0].wait_until(lambda: p.sent([rid]), 5.0, what="P frees after its WRITEs")
    written = sum(peer.call("stats")["counters"]["bytes_total"] for peer in p.peers)
    assert written >= (prompt - 1) * PER_TOKEN_TP1
