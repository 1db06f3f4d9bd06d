"""Untrusted peers against a live connector (real NIXL, in one process).

* With a shared secret, a D without it (or with another one) is refused at the handshake
  and counted on both sides; with the right secret the load works.
* NIXL notifications from a raw agent that loaded P's metadata: garbage, unknown or
  already-freed request ids, oversized bodies are dropped and counted, and never change
  the lease of another request. With a secret, unsigned or mis-signed `done`s are dropped
  too, and only a signed one frees the lease.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvmem import real_worker, region_sizes

from kvlink.connector.api import StepMetadata, WorkerOutput
from kvlink.connector.config import ConnectorConfig
from kvlink.connector.notifs import (
    MAX_NOTIF_BYTES,
    BadNotification,
    Done,
    Heartbeat,
    Pushed,
    PushRequest,
    UnauthenticatedNotification,
    decode,
    encode,
)
from kvlink.connector.worker import NixlWorker
from kvlink.layout.presets import TINY_HYBRID
from kvlink.transfer.agent import NixlAgent

pytestmark = pytest.mark.timeout(60)
SECRET = b"correct horse battery staple"
HELD = {"request_id": "held", "block_ids": [[1, 2, 3], [4]]}


@pytest.fixture(autouse=True)
def _no_env_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVLINK_SECRET", raising=False)


def _worker(engine_id: str, secret: bytes | None, seed: int, lease_s: float = 30.0) -> tuple[NixlWorker, Any]:
    mem = real_worker(TINY_HYBRID, 1, 0, 16, 16, 32, seed=seed)
    worker = NixlWorker(ConnectorConfig(engine_id, side_channel_port=0, secret=secret, lease_s=lease_s,
                                        handshake_timeout_s=2.0),
                        TINY_HYBRID, 1, 0, 16, 16, 32)
    worker.register_kv_caches(*region_sizes(mem))
    return worker, mem


@pytest.fixture
def workers() -> Iterator[Callable[..., NixlWorker]]:
    made: list[tuple[NixlWorker, Any]] = []

    def make(engine_id: str, secret: bytes | None, **kw: Any) -> NixlWorker:
        made.append(_worker(engine_id, secret, seed=len(made) + 1, **kw))
        return made[-1][0]

    yield make
    for worker, _ in made:
        worker.shutdown()


def _load(p: NixlWorker, rid: str) -> dict[str, Any]:
    return {"request_id": rid, "remote_request_id": "held", "remote_engine_id": p.config.engine_id,
            "remote_host": "127.0.0.1", "remote_port": p.side_channel_port, "remote_tp_size": 1,
            "remote_block_ids": HELD["block_ids"], "transfer_mode": "pull",
            "local_block_ids": [[5, 6, 7], [8]], "local_computed_tokens": 0, "num_tokens": 40}


def _poll(workers: list[NixlWorker], until: Callable[[list[WorkerOutput]], bool], timeout_s: float = 10) -> list[WorkerOutput]:
    outs: list[WorkerOutput] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        outs += [w.get_finished() for w in workers]
        if until(outs):
            return outs
        time.sleep(0.002)
    raise AssertionError("condition not reached before the deadline")


@pytest.mark.parametrize("d_secret", [None, b"another secret"])
def test_peer_without_the_secret_is_refused_and_counted(workers: Callable[..., NixlWorker],
                                                        d_secret: bytes | None) -> None:
    p = workers("P", SECRET)
    d = workers("D", d_secret)
    p.start_load_kv(StepMetadata(saves=[HELD]))
    d.start_load_kv(StepMetadata(loads=[_load(p, "d1")]))
    outs = _poll([d, p], lambda o: any("d1" in x.failed_recving for x in o))
    assert not any(x.finished_recving for x in outs)
    assert d.get_stats()["counters"]["failed_handshakes_total"] == 1
    p_counters = p.get_stats()["counters"]
    assert p_counters["unauthenticated_handshakes_total"] == 1
    assert p_counters["rejected_handshakes_total"] == 1
    assert "held" in p.leases.leases  # nothing was read, the lease is intact


def test_peer_with_the_secret_loads(workers: Callable[..., NixlWorker]) -> None:
    p = workers("P", SECRET)
    d = workers("D", SECRET)
    p.start_load_kv(StepMetadata(saves=[HELD]))
    d.start_load_kv(StepMetadata(loads=[_load(p, "d1")]))
    # D's signed `done` reaches P, which frees the blocks at once (not at lease expiry).
    outs = _poll([d, p], lambda o: any("d1" in x.finished_recving for x in o)
                 and any("held" in x.finished_sending for x in o))
    assert not any(x.failed_recving for x in outs)
    assert p.get_stats()["counters"]["unauthenticated_notifications_total"] == 0


def _raw_peer(p: NixlWorker) -> tuple[NixlAgent, str]:
    """An agent of our own that loaded P's metadata: it can send P notifications (and READ)."""
    assert p.agent is not None
    agent = NixlAgent(f"intruder-{os.getpid()}")
    return agent, agent.add_remote(p.agent.metadata())


def _drain(p: NixlWorker, agent: NixlAgent, counter: str, expected: int) -> None:
    deadline = time.monotonic() + 5
    while p.stats.counters.get(counter, 0) < expected:
        assert time.monotonic() < deadline, f"{counter} stayed at {p.stats.counters.get(counter)}"
        p.get_finished()
        agent.get_notifs()  # the sender must progress too, or its messages stay queued
        time.sleep(0.002)


GARBAGE = [
    b"", b"\x00\xff\xfe", b"hello", b"kvlink1:done:0:held", b"kvlink1:done:-1:held",
    b"kvlink1:done:1:", b"kvlink1:hb:1:{not json", b'kvlink1:hb:1:{"a":1}',
    b"kvlink1:push:0:[]", b"kvlink1:teleport:1:held", b"kvlink2:done:1:held",
    b"kvlink1:done:1:" + b"x" * MAX_NOTIF_BYTES,
]


def test_garbage_notifications_are_dropped_and_leave_leases_alone(workers: Callable[..., NixlWorker]) -> None:
    p = workers("P", None)
    p.start_load_kv(StepMetadata(saves=[HELD]))
    agent, name = _raw_peer(p)
    try:
        for raw in GARBAGE:
            agent.send_notif(name, raw)
        _drain(p, agent, "bad_notifications_total", len(GARBAGE))
        # Unknown and already-freed ids: parked (bounded, expire), never applied to another lease.
        agent.send_notif(name, encode(Done("never-existed", 1)))
        agent.send_notif(name, encode(Heartbeat(("never-existed", "held-too"))))
        deadline = time.monotonic() + 2
        while p.leases.unknown_notifs_total < 1:
            assert time.monotonic() < deadline
            p.get_finished()
            agent.get_notifs()
        lease = p.leases.leases["held"]
        assert lease.notified == 0 and lease.expected is None
        assert p.book.loads == {} and p.debug_state()["leases"] == 1
    finally:
        agent.close()


def test_with_a_secret_only_signed_done_frees_the_lease(workers: Callable[..., NixlWorker]) -> None:
    p = workers("P", SECRET)
    p.start_load_kv(StepMetadata(saves=[HELD]))
    agent, name = _raw_peer(p)
    try:
        agent.send_notif(name, encode(Done("held", 1)))  # unsigned
        agent.send_notif(name, encode(Done("held", 1), b"guessed secret"))
        agent.send_notif(name, encode(Heartbeat(("held",)), b"guessed secret"))
        _drain(p, agent, "unauthenticated_notifications_total", 3)
        assert "held" in p.leases.leases and p.leases.leases["held"].notified == 0
        agent.send_notif(name, encode(Done("held", 1), SECRET))
        deadline = time.monotonic() + 5
        while "held" in p.leases.leases:
            assert time.monotonic() < deadline, "a signed done did not free the lease"
            p.get_finished()
            agent.get_notifs()
    finally:
        agent.close()


# ---- codec, without NIXL -----------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_are_refused_or_decode_to_one_of_ours(raw: bytes) -> None:
    for secret in (None, SECRET):
        try:
            msg = decode(raw, secret)
        except BadNotification:  # the only exception a peer's bytes may raise
            continue
        assert secret is None, "an unsigned random message passed authentication"
        assert isinstance(msg, Done | Heartbeat | Pushed | PushRequest)


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=1, max_size=40), st.integers(1, 64), st.integers(0, 200))
def test_signed_round_trip_and_any_flipped_byte_is_refused(rid: str, expected: int, pos: int) -> None:
    raw = encode(Done(rid, expected), SECRET)
    assert decode(raw, SECRET) == Done(rid, expected)
    flipped = bytearray(raw)
    flipped[pos % len(raw)] ^= 0x01
    with pytest.raises(BadNotification):
        decode(bytes(flipped), SECRET)
    with pytest.raises(UnauthenticatedNotification):
        decode(raw, None)  # signed, but this side has no secret: refuse rather than guess
    with pytest.raises(UnauthenticatedNotification):
        decode(encode(Done(rid, expected)), SECRET)
