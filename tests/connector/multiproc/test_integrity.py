"""End-to-end KV integrity between worker processes over real NIXL (kvlink.connector.integrity).

P seals each finished request's shipped units, D checks its copies before the request may
run. Faults are injected on purpose (`KVLINK_TEST_FAULT`, env of the worker only): a byte
flipped in P's page after sealing, a READ with one descriptor left out, blocks P frees at
once and reuses for other tokens before D reads. With `verify_kv` on, none of these loads
finishes; P frees every block; with it off the flipped byte lands in D's KV unnoticed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kvpeer import Engine, blocks, pull_exact, start_engines, stop_engines

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

STALL_S = 2.0
SMALL = {"model": "llama3-8b", "layers": 2, "model_overrides": {"head_dim": 32},
         "block_size": 16, "num_blocks": 32, "stall_timeout_s": STALL_S, "handshake_timeout_s": 2.0}
FULL = {**SMALL, "verify_kv": "full"}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    started = start_engines(
        Path(tmp_path_factory.mktemp("integrity")),
        {"engine_id": "IP", "tp": 1, **SMALL},
        {"engine_id": "FP", "tp": 1, "env": {"KVLINK_TEST_FAULT": "flip_after_seal"}, **SMALL},
        {"engine_id": "RP", "tp": 1, "env": {"KVLINK_TEST_FAULT": "free_after_seal"}, **SMALL},
        {"engine_id": "ID", "tp": 1, **FULL},
        {"engine_id": "SD", "tp": 1, "env": {"KVLINK_TEST_FAULT": "skip_descriptor"}, **FULL},
        {"engine_id": "OD", "tp": 1, **SMALL, "verify_kv": "off"},
    )
    try:
        yield {e.engine_id: e for e in started}
    finally:
        stop_engines(started)


def _counters(engine: Engine) -> dict[str, int]:
    return engine.call("stats")[0]["counters"]


def _failed_load(p: Engine, d: Engine, rid: str, p_ids: list[int], d_ids: list[int]) -> str:
    params = p.prefill(rid, 7, 40, [p_ids])
    d.call("snapshot")
    d.decode(f"d-{rid}", params, 40, [d_ids])
    d.wait_settled([f"d-{rid}"], timeout_s=STALL_S + 5)
    assert d.failed([f"d-{rid}"]) == {f"d-{rid}"}
    assert d.peers[0].invalid_block_ids >= set(d_ids)
    return str(d.peers[0].load_failures.get(f"d-{rid}", ""))


def _p_frees(p: Engine) -> None:
    p.peers[0].wait_until(lambda: not p.call("state")[0]["lease_ids"], 5.0, what="P frees every block")


def test_correct_loads_are_checked(engines: dict[str, Engine]) -> None:
    p, d = engines["IP"], engines["ID"]
    pull_exact(p, d, "ok-1", 3, 40, [blocks(0, 3)], [blocks(3, 3)])
    stats = d.call("stats")[0]
    counters = stats["counters"]
    # The digest slices the READ also carried stay out of its KV figures (NIXL merges the
    # slices of consecutive blocks, as it merges the KV's descriptors).
    (record,) = stats["transfers"]
    pull_exact(p, engines["OD"], "ok-off", 3, 40, [blocks(0, 3)], [blocks(3, 3)])
    (unchecked,) = engines["OD"].call("stats")[0]["transfers"]
    assert (record["nbytes"], record["descriptors"]) == (unchecked["nbytes"], unchecked["descriptors"])
    assert counters["kv_verified_units_total"] == 3 * 8 // 1  # 3 blocks x 8 heads (TP 1)
    assert counters["kv_verified_bytes_total"] == 2 * 39 * 8 * 2 * 32 * 2  # layers x tokens x heads x K,V x dim x bf16
    assert counters.get("kv_checksum_mismatch_total", 0) == 0
    assert _counters(p)["kv_sealed_bytes_total"] >= counters["kv_verified_bytes_total"]
    _p_frees(p)


def test_flipped_byte_after_sealing_fails_the_load(engines: dict[str, Engine]) -> None:
    p, d = engines["FP"], engines["ID"]
    reason = _failed_load(p, d, "flip-1", blocks(0, 3), blocks(10, 3))
    assert "KV checksum mismatch in 1 unit(s) from FP rank 0 (group 0 block 0)" in reason, reason
    assert "P sealed" in reason
    assert _counters(d)["kv_checksum_mismatch_total"] == 1
    records = d.peers[0].call("logs")["records"]
    assert any("d-flip-1" in r and "checksum mismatch" in r for r in records), records
    _p_frees(p)
    assert d.call("state")[0]["loads_in_flight"] == 0


def test_truncated_read_fails_the_load(engines: dict[str, Engine]) -> None:
    p, d = engines["IP"], engines["SD"]
    reason = _failed_load(p, d, "cut-1", blocks(8, 3), blocks(0, 3))
    assert "KV checksum mismatch" in reason, reason
    _p_frees(p)


def test_blocks_reused_for_other_tokens_fail_the_load(engines: dict[str, Engine]) -> None:
    """P frees r1's blocks at once (its lease 'ran out') and seals them again for another
    prompt before D reads r1: the seeds are not r1's tokens, so D refuses after re-reading."""
    p, d = engines["RP"], engines["ID"]
    params = p.prefill("reuse-1", 11, 40, [blocks(0, 3)])
    p.prefill("reuse-2", 12, 40, [blocks(0, 3)], first_token=1000)
    d.decode("d-reuse-1", params, 40, [blocks(20, 3)])
    d.wait_settled(["d-reuse-1"], timeout_s=STALL_S + 5)
    assert d.failed(["d-reuse-1"]) == {"d-reuse-1"}
    reason = str(d.peers[0].load_failures["d-reuse-1"])
    assert "never matched this request's tokens" in reason, reason
    assert _counters(d)["kv_digest_rereads_total"] >= 1


def test_without_verify_kv_a_flipped_byte_is_decoded_from(engines: dict[str, Engine]) -> None:
    """The control: the same fault with verify_kv off finishes the load with the wrong byte."""
    p, d = engines["FP"], engines["OD"]
    d.call("snapshot")
    params = p.prefill("flip-off", 9, 40, [blocks(4, 3)])
    d.decode("d-flip-off", params, 40, [blocks(0, 3)])
    d.wait_settled(["d-flip-off"])
    assert not d.failed(["d-flip-off"])
    errors = d.peers[0].call("verify", requests=[{"rid": "flip-off", "seed": 9, "tokens": 39,
                                                   "block_ids": [blocks(0, 3)]}])["errors"]
    assert errors and "1 bytes differ" in errors[0], errors
