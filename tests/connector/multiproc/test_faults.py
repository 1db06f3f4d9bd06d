"""Dead and frozen P workers: D reports exactly the affected blocks by its deadlines, never hangs.

* P SIGKILLed after D's handshake, before D reads: the READ raises
  (nixlRemoteDisconnectError), D re-handshakes once, gets refused, fails the load.
* One P rank SIGKILLed while D works through a batch of loads: every load either
  finishes byte-exact or fails with exactly its blocks invalid.
* P SIGSTOPped with UCX_TLS=tcp (a frozen peer never errors): the stall deadline fails
  the READ; after SIGCONT the same engines work again.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvpeer import Engine, blocks, pull_exact, start_engines, stop_engines

from kvlink.connector.api import RequestView

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

STALL_S, HANDSHAKE_S = 2.0, 1.0
SMALL = {"model": "llama3-8b", "layers": 2, "model_overrides": {"head_dim": 32},
         "block_size": 16, "num_blocks": 32, "stall_timeout_s": STALL_S,
         "handshake_timeout_s": HANDSHAKE_S}
# 4 layers x 8 heads x head_dim 128, kernel blocks of 4 tokens: 8 KiB descriptors at TP 2 -> 1
BIG = {"model": "llama3-8b", "layers": 4, "block_size": 16, "kernel_block_size": 4,
       "num_blocks": 200, "stall_timeout_s": STALL_S, "handshake_timeout_s": HANDSHAKE_S}
TCP = {"UCX_TLS": "tcp"}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    started = start_engines(
        Path(tmp_path_factory.mktemp("faults")),
        {"engine_id": "KP", "tp": 1, **SMALL},
        {"engine_id": "KD", "tp": 1, **SMALL},
        {"engine_id": "BP", "tp": 2, **BIG},
        {"engine_id": "BD", "tp": 1, **BIG},
        {"engine_id": "TP", "tp": 1, "env": TCP, **SMALL},
        {"engine_id": "TD", "tp": 1, "env": TCP, **{**SMALL, "stall_timeout_s": 1.5}},
    )
    try:
        yield {e.engine_id: e for e in started}
    finally:
        stop_engines(started)


def _pull(p: Engine, d: Engine, rid: str, seed: int, p_ids: list[list[int]], d_ids: list[list[int]],
          prompt: int = 40) -> None:
    pull_exact(p, d, rid, seed, prompt, p_ids, d_ids)


def test_p_killed_before_d_reads(engines: dict[str, Engine]) -> None:
    p, d = engines["KP"], engines["KD"]
    _pull(p, d, "k-warm", 1, [blocks(0, 3)], [blocks(3, 3)])
    params = p.prefill("k-dead", 2, 40, [blocks(6, 3)])
    p.signal_all(signal.SIGKILL)
    p.peers[0].proc.wait(timeout=5)
    start = time.monotonic()
    d.decode("d-k-dead", params, 40, [[20, 9, 14]])
    d.wait_settled(["d-k-dead"], timeout_s=STALL_S + HANDSHAKE_S + 2)
    assert time.monotonic() - start < STALL_S + HANDSHAKE_S
    assert d.failed(["d-k-dead"]) == {"d-k-dead"}
    assert d.peers[0].invalid_block_ids == {20, 9, 14}
    (state,) = d.call("state")
    assert state["loads_in_flight"] == 0 and state["open_transfers"] == 0
    assert state["waiting_for_handshake"] == 0
    records = d.peers[0].call("logs")["records"]
    assert any("d-k-dead" in r and "failed to load" in r for r in records), records


def test_p_rank_killed_during_a_batch_of_loads(engines: dict[str, Engine]) -> None:
    p, d = engines["BP"], engines["BD"]
    prompt, per, count = 257, 16, 12  # 4 MiB per request, 8 KiB descriptors

    def batch(tag: str, seed0: int) -> tuple[list[dict], list[dict]]:
        loads, reqs = [], []
        for i in range(count):
            rid, p_ids = f"{tag}{i}", [blocks(i * per, per)]
            d_ids = [[199 - (i * per + j) for j in range(per)]]
            params = p.prefill(rid, seed0 + i, prompt, p_ids)
            loads += d.decode(f"d-{rid}", params, prompt, d_ids, send=False)["loads"]
            reqs.append({"rid": rid, "seed": seed0 + i, "tokens": prompt - 1, "block_ids": d_ids})
        return loads, reqs

    # calibrate: how long does D take to load the whole batch?
    loads, reqs = batch("cal", 100)
    d.call("snapshot")
    d.peers[0].send("step", loads=loads)
    window = d.wait_settled([f"d-{r['rid']}" for r in reqs])
    d.verify(reqs)
    p.peers[0].wait_until(lambda: p.sent([r["rid"] for r in reqs]), 5.0, what="P frees")
    # again, and kill P rank 1 about halfway through
    loads, reqs = batch("mid", 200)
    d.call("snapshot")
    d.peers[0].send("step", loads=loads)
    time.sleep(window / 4)
    p.peers[1].signal(signal.SIGKILL)
    rids = [f"d-{r['rid']}" for r in reqs]
    d.wait_settled(rids, timeout_s=STALL_S + HANDSHAKE_S + 3)
    failed = d.failed(rids)
    ok = [r for r in reqs if f"d-{r['rid']}" not in failed]
    want_invalid = {b for r in reqs if f"d-{r['rid']}" in failed for b in r["block_ids"][0]}
    assert d.peers[0].invalid_block_ids == want_invalid
    if ok:
        d.verify(ok, check_outside=False)
    print(f"batch of {count} ({window * 1e3:.1f} ms to load): "
          f"{len(ok)} finished, {len(failed)} failed after the kill")
    (state,) = d.call("state")
    assert state["loads_in_flight"] == 0 and state["open_transfers"] == 0
    # whatever the split, a load after the kill fails with exactly its blocks
    _, params = p.sched.request_finished(
        RequestView("late", list(range(prompt)), {"do_remote_decode": True}), [blocks(0, per)], False)
    assert params is not None
    d.decode("d-late", params, prompt, [blocks(0, per)])
    d.wait_settled(["d-late"], timeout_s=STALL_S + HANDSHAKE_S + 3)
    assert d.failed(["d-late"]) == {"d-late"}
    assert set(blocks(0, per)) <= d.peers[0].invalid_block_ids


def test_frozen_p_over_tcp_hits_the_stall_deadline(engines: dict[str, Engine]) -> None:
    p, d = engines["TP"], engines["TD"]
    _pull(p, d, "t-warm", 1, [blocks(0, 3)], [blocks(3, 3)])
    handshakes = d.call("state")[0]["handshakes_started"]
    params = p.prefill("t-frozen", 2, 40, [blocks(6, 3)])
    p.signal_all(signal.SIGSTOP)
    try:
        start = time.monotonic()
        d.decode("d-t-frozen", params, 40, [[10, 12, 11]])
        d.wait_settled(["d-t-frozen"], timeout_s=5.0)
        took = time.monotonic() - start
        d.call("snapshot")
    finally:
        p.signal_all(signal.SIGCONT)
    # UCX emulates a TCP READ with messages: once P resumes, the abandoned READ's data may
    # still land. It must land only in the blocks D already reported invalid.
    time.sleep(0.3)
    late = d.peers[0].call("changed_blocks")["blocks"]
    assert set(late.get("0", [])) <= {10, 11, 12}, late
    print(f"bytes of the abandoned READ that landed after SIGCONT: blocks {late}")
    assert 1.4 <= took < 4.0, took
    assert d.failed(["d-t-frozen"]) == {"d-t-frozen"}
    assert d.peers[0].invalid_block_ids == {10, 12, 11}
    (stats,) = d.call("stats")
    assert stats["counters"]["stalled_transfers_total"] == 1
    assert stats["counters"]["failed_transfers_total"] == 0
    # a frozen peer is not a dead one: D keeps its metadata, and after SIGCONT reads again
    assert d.call("state")[0]["remote_engines"] == ["TP"]
    _pull(p, d, "t-again", 3, [blocks(12, 3)], [blocks(20, 3)])
    assert d.call("state")[0]["handshakes_started"] == handshakes
