"""D's `done` notifications leave from a second NIXL agent (kvlink.connector.notifier).

Over UCX (CMA data, TCP control) a READ posted after a notification on the same endpoint
completes only once the peer progresses again. A prefill engine mid-forward progresses
rarely, so D's loads waited for it. Frozen P (SIGSTOP) makes that deterministic: CMA
still reads a stopped process, so with the notification agent every load finishes while
P is stopped; with notifications attached to the READs (the control) a load stays in
flight until P runs again. Either way every load is byte-exact and P frees every block
once it resumes.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvpeer import Engine, blocks, pull_exact, start_engines, stop_engines

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SMALL = {"model": "llama3-8b", "layers": 2, "model_overrides": {"head_dim": 32},
         "block_size": 16, "num_blocks": 64, "stall_timeout_s": 20.0}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    started = start_engines(
        Path(tmp_path_factory.mktemp("notifier")),
        {"engine_id": "NP", "tp": 1, **SMALL},
        {"engine_id": "ND", "tp": 1, **SMALL},  # default: separate notification agent
        {"engine_id": "AD", "tp": 1, "separate_notifier": False, **SMALL},
    )
    try:
        yield {e.engine_id: e for e in started}
    finally:
        stop_engines(started)


def _loads_while_p_stopped(p: Engine, d: Engine, tag: str, first_block: int,
                           stop_at_two: bool) -> list[int]:
    """Warm pulls, then rounds of two loads with P stopped. Returns, per round, how many loads finished (then byte-exact) before P was resumed,
    within 2 s; P is resumed either way. Up to three rounds, ending early at a round where
    both finished when `stop_at_two`: UCX may still be wiring the endpoint up after the warm
    pulls (its lanes settle only once P has progressed on D's wire-up messages), and on a
    slower machine that can take longer than two pulls."""
    # The first READs to a new peer finish UCX's wire-up, which needs P to progress.
    for k in range(2):
        pull_exact(p, d, f"{tag}-warm{k}", 1, 40, [blocks(first_block, 3)], [blocks(0, 3)])
    counts: list[int] = []
    for rnd in range(3):
        base = first_block + 9 * rnd
        rids = [f"{tag}{rnd}-1", f"{tag}{rnd}-2"]
        params = [p.prefill(rid, 2 + i, 40, [blocks(base + 3 * (i + 1), 3)]) for i, rid in enumerate(rids)]
        d.call("snapshot")
        p.signal_all(signal.SIGSTOP)
        try:
            for i, rid in enumerate(rids):
                d.decode(f"d-{rid}", params[i], 40, [blocks(3 * (i + 1), 3)])
            deadline = time.monotonic() + 2.0
            while not d.settled([f"d-{r}" for r in rids]) and time.monotonic() < deadline:
                time.sleep(0.02)
            counts.append(sum(d.settled([f"d-{r}"]) for r in rids))
        finally:
            p.signal_all(signal.SIGCONT)
        d.wait_settled([f"d-{r}" for r in rids], timeout_s=5.0)
        assert not d.failed([f"d-{r}" for r in rids])
        d.verify([{"rid": rid, "seed": 2 + i, "tokens": 39, "block_ids": [blocks(3 * (i + 1), 3)]}
                  for i, rid in enumerate(rids)])
        p.peers[0].wait_until(lambda r=rids: p.sent(r), 5.0, what="P freeing after the notifications")
        if stop_at_two and counts[-1] == 2:
            break
    return counts


def test_loads_finish_while_p_is_stopped_and_p_frees_on_resume(engines: dict[str, Engine]) -> None:
    p, d = engines["NP"], engines["ND"]
    counts = _loads_while_p_stopped(p, d, "n", 0, stop_at_two=True)
    assert counts[-1] == 2, f"loads finished while P was stopped, per round: {counts} of 2"
    (state,) = d.call("state")
    assert state["open_transfers"] == 0 and state["loads_in_flight"] == 0


def test_control_notifications_on_the_reads_wait_for_p(engines: dict[str, Engine]) -> None:
    p, d = engines["NP"], engines["AD"]
    counts = _loads_while_p_stopped(p, d, "a", 30, stop_at_two=False)
    assert max(counts) < 2, f"attached notifications no longer hold READs ({counts}): is the notifier still needed?"
