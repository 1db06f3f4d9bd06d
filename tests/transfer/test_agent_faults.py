"""Peer faults with real processes: SIGKILL before and during a READ, and a SIGSTOPped peer."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from transfer_peers import BLOCKS, SpawnHolder, connect, wait_done

from kvlink.transfer.agent import NixlAgent
from kvlink.transfer.inflight import InflightTracker
from kvlink.transfer.xfer import Transfer, TransferFailed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

TCP_ONLY = {"UCX_TLS": "tcp"}
BIG_BLOCKS = 4096  # 64 MiB: a READ emulated over TCP takes tens of milliseconds


@pytest.fixture
def tcp_agent(monkeypatch: pytest.MonkeyPatch) -> Iterator[NixlAgent]:
    """A D agent whose UCX context only has TCP (UCX reads the env when the backend starts)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    agent = NixlAgent(f"decode-tcp-{uuid.uuid4().hex[:8]}")
    try:
        yield agent
    finally:
        agent.close()


def poll_until_failed(agent: NixlAgent, transfer: Transfer, timeout: float) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            agent.poll(transfer)
        except TransferFailed as exc:
            return exc.reason
    raise AssertionError(f"no failure within {timeout} s")


def test_killed_peer_fails_posts_and_notifications(
    spawn_holder: SpawnHolder, decode_agent: NixlAgent
) -> None:
    holder = spawn_holder("prefill-kill")
    link = connect(decode_agent, holder)
    ids = np.arange(BLOCKS)
    wait_done(
        decode_agent, decode_agent.post("READ", link.local_handle, ids, link.remote_handle, ids)
    )

    holder.signal(signal.SIGKILL)
    holder.proc.wait(timeout=5)
    killed_at = time.monotonic()
    with pytest.raises(TransferFailed, match="RemoteDisconnect"):
        deadline = killed_at + 2.0
        while time.monotonic() < deadline:  # the disconnect can take a few ms to surface
            decode_agent.post("READ", link.local_handle, ids, link.remote_handle, ids)
    assert time.monotonic() - killed_at < 2.0
    with pytest.raises(TransferFailed, match="notification"):
        decode_agent.send_notif(link.remote_name, b"anyone?")
    decode_agent.remove_remote(link.remote_name)
    assert decode_agent.remote_names == frozenset()


def test_kill_during_tcp_read_fails_quickly(
    spawn_holder: SpawnHolder, tcp_agent: NixlAgent
) -> None:
    holder = spawn_holder("prefill-kill-mid", blocks=BIG_BLOCKS, env=TCP_ONLY)
    link = connect(tcp_agent, holder)
    ids = np.random.default_rng(0).permutation(BIG_BLOCKS)
    read = tcp_agent.post("READ", link.local_handle, ids, link.remote_handle, ids)
    assert read.state == "PROC", "the TCP-emulated READ finished before the kill could land"
    os.kill(holder.proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    reason = poll_until_failed(tcp_agent, read, timeout=5.0)
    assert time.monotonic() - killed_at < 2.0
    assert "RemoteDisconnect" in reason
    assert (read.state, read.released) == ("FAILED", True)
    tcp_agent.release(read)  # safe after failure


def test_stopped_peer_is_reported_stalled(spawn_holder: SpawnHolder, tcp_agent: NixlAgent) -> None:
    holder = spawn_holder("prefill-stop", env=TCP_ONLY)
    link = connect(tcp_agent, holder)
    ids = np.arange(BLOCKS)
    wait_done(tcp_agent, tcp_agent.post("READ", link.local_handle, ids, link.remote_handle, ids))

    holder.signal(signal.SIGSTOP)
    tracker = InflightTracker(tcp_agent, stall_timeout_s=0.5)
    read = tcp_agent.post("READ", link.local_handle, ids, link.remote_handle, ids)
    tracker.add(read)
    result = tracker.poll_all(time.monotonic())
    while not result:
        assert time.monotonic() - read.posted_at < 5.0, "tracker never reported the stall"
        time.sleep(0.01)
        result = tracker.poll_all(time.monotonic())
    waited = time.monotonic() - read.posted_at
    assert result.failed == [read] and not result.done
    assert read.failure is not None and "stalled: no completion within 0.500 s" in read.failure
    assert 0.5 <= waited < 2.5
    assert read.released and len(tracker) == 0
