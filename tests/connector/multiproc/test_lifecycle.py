"""Lease expiry, both abort paths, a killed D, an incompatible D, hostile handshake bytes.

One P engine (lease 2 s) and a few D engines, each a separate process. P must free
every held request exactly once (all consumers notified, aborted, or lease expired)
and keep serving valid loads after every bad peer.
"""

from __future__ import annotations

import signal
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvpeer import SECRET, Engine, blocks, n_blocks, pull_exact, start_engines, stop_engines

from kvlink.connector.api import RequestView
from kvlink.transfer.framing import pack_frame

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

LEASE_S = 2.0
MODEL = {"model": "llama3-8b", "layers": 2, "model_overrides": {"head_dim": 32},
         "block_size": 16, "num_blocks": 64, "lease_s": LEASE_S}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    started = start_engines(
        Path(tmp_path_factory.mktemp("lifecycle")),
        {"engine_id": "P", "tp": 1, **MODEL},
        {"engine_id": "D", "tp": 1, **MODEL},
        {"engine_id": "Dkill", "tp": 1, **MODEL},
        {"engine_id": "Dfresh", "tp": 1, **MODEL},
        {"engine_id": "Dbad", "tp": 1, **{**MODEL, "model_overrides": {"head_dim": 16}}},
    )
    try:
        yield {e.engine_id: e for e in started}
    finally:
        stop_engines(started)


def _pull_ok(p: Engine, d: Engine, rid: str, seed: int, p_first: int = 40) -> None:
    """A normal request from P to D: exact bytes, P frees on D's notification."""
    prompt = 40
    p_ids, d_ids = [blocks(p_first, n_blocks(prompt, 16))], [blocks(50, n_blocks(prompt, 16))]
    pull_exact(p, d, rid, seed, prompt, p_ids, d_ids)
    p.peers[0].wait_until(lambda: p.sent([rid]), 5.0, what=f"P frees {rid}")


def _p_state(p: Engine) -> dict:
    (state,) = p.call("state")
    return state


def test_lease_expires_when_d_never_reads(engines: dict[str, Engine]) -> None:
    p = engines["P"]
    expired_before = _p_state(p)["expired_total"]
    held_at = time.monotonic()
    p.prefill("lonely", 1, 40, [blocks(0, 3)])
    assert "lonely" in _p_state(p)["lease_ids"]
    p.peers[0].wait_until(lambda: p.sent(["lonely"]), LEASE_S + 3.0, what="lease expiry")
    freed_after = p.peers[0].finished_sending["lonely"] - held_at
    assert LEASE_S - 0.1 <= freed_after <= LEASE_S + 2.0, freed_after
    state = _p_state(p)
    assert state["expired_total"] == expired_before + 1
    assert "lonely" not in state["lease_ids"]
    (stats,) = p.call("stats")
    assert stats["counters"]["expired_leases_total"] == state["expired_total"]


def test_d_abort_before_allocation_frees_p_at_once(engines: dict[str, Engine]) -> None:
    """D's scheduler side aborts a request it never allocated: notify_only → P frees now."""
    p, d = engines["P"], engines["D"]
    params = p.prefill("early-abort", 2, 40, [blocks(4, 3)])
    req = RequestView("d-early-abort", list(range(40)), params)
    d.sched.on_new_request(req)
    held_at = time.monotonic()
    assert d.sched.request_finished(req, [], aborted=True) == (False, None)
    meta = d.sched.build_step_metadata()
    assert [e["remote_request_id"] for e in meta.notify_only] == ["early-abort"]
    assert not meta.loads
    d.step(notify_only=meta.notify_only)
    p.peers[0].wait_until(lambda: p.sent(["early-abort"]), LEASE_S / 2, what="free on notify_only")
    assert p.peers[0].finished_sending["early-abort"] - held_at < LEASE_S / 2
    assert _p_state(p)["expired_total"] == _p_state(p)["expired_total"]  # nothing expired here
    (d_stats,) = d.call("stats")
    assert d_stats["counters"]["notify_only_total"] >= 1


def test_p_side_abort_frees_without_waiting(engines: dict[str, Engine]) -> None:
    """P's engine lets a held request go (its caller left before taking the params): `frees`
    drops the lease at once and P reports the request sent, so the engine frees its blocks;
    nothing expires later."""
    p = engines["P"]
    expired_before = _p_state(p)["expired_total"]
    p.prefill("p-abort", 3, 40, [blocks(8, 3)])
    assert "p-abort" in _p_state(p)["lease_ids"]
    p.step(frees=["p-abort"])
    assert "p-abort" not in _p_state(p)["lease_ids"]
    time.sleep(LEASE_S + 0.3)
    assert _p_state(p)["expired_total"] == expired_before
    assert "p-abort" in p.peers[0].finished_sending
    _pull_ok(p, engines["D"], "after-p-abort", 4)


def test_killed_d_lease_expires_and_p_keeps_serving(engines: dict[str, Engine]) -> None:
    p, dk = engines["P"], engines["Dkill"]
    _pull_ok(p, dk, "warm-kill", 5, p_first=12)  # Dkill has handshaked and read once
    expired_before = _p_state(p)["expired_total"]
    params = p.prefill("orphan", 6, 40, [blocks(16, 3)])
    # D admits the request (only its heartbeat reaches the worker) and dies before it reads
    meta = dk.decode("d-orphan", params, 40, [blocks(50, 3)], send=False)
    dk.step(heartbeats=meta["heartbeats"])
    dk.signal_all(signal.SIGKILL)
    p.peers[0].wait_until(lambda: p.sent(["orphan"]), LEASE_S + 3.0, what="lease expiry after D died")
    assert _p_state(p)["expired_total"] == expired_before + 1
    _pull_ok(p, engines["D"], "after-d-kill", 7, p_first=20)


def test_incompatible_peer_is_refused_and_both_keep_serving(engines: dict[str, Engine]) -> None:
    p, bad = engines["P"], engines["Dbad"]
    params = p.prefill("mismatch", 8, 40, [blocks(24, 3)])
    bad.decode("d-mismatch", params, 40, [blocks(50, 3)])
    bad.wait_settled(["d-mismatch"], timeout_s=10.0)
    assert bad.failed(["d-mismatch"]) == {"d-mismatch"}
    assert bad.peers[0].invalid_block_ids == {50, 51, 52}
    reason = bad.peers[0].load_failures.get("d-mismatch", "")
    assert "head_dim: P has 32, D has 16" in reason, reason
    records = bad.peers[0].call("logs")["records"]
    assert any("head_dim: P has 32, D has 16" in r for r in records), records
    (stats,) = bad.call("stats")
    assert stats["counters"]["refused_peers_total"] == 1
    assert bad.call("state")[0]["loads_in_flight"] == 0  # still answering, nothing stuck
    p.step(frees=["mismatch"])
    _pull_ok(p, engines["D"], "after-mismatch", 9, p_first=28)


def _raw_send(port: int, data: bytes, linger_s: float = 0.2) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2.0) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            time.sleep(linger_s)
            return sock.recv(4096)
        except OSError:
            return b""


def test_hostile_handshake_bytes_are_refused_and_p_keeps_serving(engines: dict[str, Engine]) -> None:
    p, fresh = engines["P"], engines["Dfresh"]
    before = _p_state(p)["listener"]
    _raw_send(p.port, pack_frame(b"hello", SECRET.encode()))      # signed, but not msgpack
    _raw_send(p.port, struct.pack(">I", 40) + b"h" * 40)          # not signed with the secret
    _raw_send(p.port, struct.pack(">I", 0x7FFFFFFF) + b"x" * 64)  # length beyond the limit
    _raw_send(p.port, struct.pack(">I", 100) + b"abc")           # truncated, then EOF
    _raw_send(p.port, b"\x00\x00")                               # not even a header
    _raw_send(p.port, bytes(range(256)) * 64)                    # 16 KiB of noise
    p.peers[0].wait_until(
        lambda: _p_state(p)["listener"]["malformed"] > before["malformed"]
        and _p_state(p)["listener"]["oversized"] > before["oversized"]
        and _p_state(p)["listener"]["unauthenticated"] > before["unauthenticated"]
        and _p_state(p)["listener"]["truncated"] >= before["truncated"] + 3,
        5.0, what="listener counts the hostile frames")
    after = _p_state(p)["listener"]
    assert after["served"] == before["served"], "no payload for hostile clients"
    _pull_ok(p, fresh, "after-hostile", 10, p_first=32)  # Dfresh has never handshaked: a new one
    assert _p_state(p)["listener"]["served"] == before["served"] + 1
