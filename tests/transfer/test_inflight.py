"""InflightTracker logic against a scripted fake agent and a fake clock."""

from __future__ import annotations

import math
from typing import Literal

import pytest

from kvlink.transfer.inflight import InflightTracker
from kvlink.transfer.xfer import Transfer, TransferFailed


class ScriptedAgent:
    """Answers ``poll`` from a per-transfer script of statuses; the last one repeats."""

    def __init__(self) -> None:
        self.scripts: dict[int, list[str]] = {}
        self.released: list[Transfer] = []

    def poll(self, transfer: Transfer) -> Literal["DONE", "PROC"]:
        script = self.scripts[id(transfer)]
        status = script.pop(0) if len(script) > 1 else script[0]
        if status == "RAISE":
            transfer.state = "FAILED"
            transfer.failure = "nixlRemoteDisconnectError"
            self.release(transfer)
            raise TransferFailed(transfer.failure)
        if status == "DONE":
            transfer.state = "DONE"
            return "DONE"
        return "PROC"

    def abort(self, transfer: Transfer, reason: str) -> None:
        transfer.state = "FAILED"
        transfer.failure = reason
        self.release(transfer)

    def release(self, transfer: Transfer) -> None:
        if not transfer.released:
            transfer.released = True
            self.released.append(transfer)


def make(agent: ScriptedAgent, script: list[str], posted_at: float = 0.0) -> Transfer:
    transfer = Transfer("READ", "peer", 4096, 1, b"", posted_at, handle=None)
    agent.scripts[id(transfer)] = script
    return transfer


def test_each_transfer_leaves_once_done_failed_or_stalled() -> None:
    agent = ScriptedAgent()
    tracker = InflightTracker(agent, stall_timeout_s=2.0)
    done = make(agent, ["PROC", "DONE"])
    dies = make(agent, ["PROC", "RAISE"])
    frozen = make(agent, ["PROC"])
    for transfer in (done, dies, frozen):
        tracker.add(transfer)
    assert frozen.deadline == 2.0 and len(tracker) == 3

    first = tracker.poll_all(now=0.5)
    assert not first and len(tracker) == 3

    second = tracker.poll_all(now=1.0)
    assert second.done == [done] and second.failed == [dies]
    assert done.released and dies.released and not frozen.released

    assert not tracker.poll_all(now=1.999)
    third = tracker.poll_all(now=2.0)
    assert third.failed == [frozen] and not third.done
    assert frozen.failure == "stalled: no completion within 2.000 s"
    assert frozen.released and len(tracker) == 0
    assert not tracker.poll_all(now=10.0)


def test_explicit_deadline_is_kept() -> None:
    agent = ScriptedAgent()
    tracker = InflightTracker(agent, stall_timeout_s=100.0)
    transfer = make(agent, ["PROC"], posted_at=5.0)
    transfer.deadline = 6.0
    tracker.add(transfer)
    assert tracker.poll_all(now=6.0).failed == [transfer]
    assert transfer.failure == "stalled: no completion within 1.000 s"


def test_abort_all_fails_everything() -> None:
    agent = ScriptedAgent()
    tracker = InflightTracker(agent, stall_timeout_s=1.0)
    transfers = [make(agent, ["PROC"]) for _ in range(3)]
    for transfer in transfers:
        tracker.add(transfer)
    assert tracker.abort_all("shutdown") == transfers
    assert all(t.state == "FAILED" and t.failure == "shutdown" and t.released for t in transfers)
    assert len(tracker) == 0


def test_rejects_non_positive_timeout() -> None:
    with pytest.raises(ValueError, match="stall_timeout_s"):
        InflightTracker(ScriptedAgent(), stall_timeout_s=0.0)
    assert math.isinf(Transfer("READ", "p", 1, 1, b"", 0.0, handle=None).deadline)


def test_advance_polls_without_collecting() -> None:
    agent = ScriptedAgent()
    tracker = InflightTracker(agent, stall_timeout_s=2.0)
    done, dies = make(agent, ["PROC", "DONE"]), make(agent, ["PROC", "RAISE"])
    tracker.add(done)
    tracker.add(dies)
    tracker.advance()
    tracker.advance()  # now DONE and FAILED, still tracked
    assert done.state == "DONE" and dies.state == "FAILED" and len(tracker) == 2
    result = tracker.poll_all(now=0.1)
    assert result.done == [done] and result.failed == [dies] and len(tracker) == 0
