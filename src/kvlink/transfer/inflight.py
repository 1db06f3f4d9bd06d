"""Tracker of posted transfers that turns errors and stalls into failures by a deadline.

NIXL never times a transfer out: a frozen peer over TCP leaves a READ in
``PROC`` forever. Every tracked transfer therefore carries a deadline, and
``poll_all`` fails any transfer still in flight once its deadline has passed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Protocol

from kvlink.transfer.xfer import Transfer, TransferFailed


class TransferPoller(Protocol):
    """The part of ``NixlAgent`` the tracker needs."""

    def poll(self, transfer: Transfer) -> Literal["DONE", "PROC"]: ...

    def abort(self, transfer: Transfer, reason: str) -> None: ...

    def release(self, transfer: Transfer) -> None: ...


@dataclass
class PollResult:
    """Transfers that finished during one ``poll_all``; each appears once, then is forgotten."""

    done: list[Transfer] = field(default_factory=list)
    failed: list[Transfer] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.done or self.failed)


class InflightTracker:
    """Posted transfers awaiting completion, each with a stall deadline.

    Invariant: a transfer leaves the tracker exactly once, in ``done`` (its
    handle released, telemetry kept) or in ``failed`` (``failure`` says why,
    handle released or queued for release by the agent).
    """

    def __init__(self, agent: TransferPoller, stall_timeout_s: float) -> None:
        if not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {stall_timeout_s}")
        self._agent = agent
        self.stall_timeout_s = stall_timeout_s
        self._inflight: list[Transfer] = []

    def __len__(self) -> int:
        return len(self._inflight)

    def add(self, transfer: Transfer) -> None:
        """Track a transfer; one without a deadline gets ``posted_at + stall_timeout_s``."""
        if math.isinf(transfer.deadline):
            transfer.deadline = transfer.posted_at + self.stall_timeout_s
        self._inflight.append(transfer)

    def poll_all(self, now: float) -> PollResult:
        """Poll every tracked transfer; ``now`` is on the ``time.monotonic`` clock."""
        result = PollResult()
        still: list[Transfer] = []
        for transfer in self._inflight:
            try:
                status = self._agent.poll(transfer)
            except TransferFailed:
                result.failed.append(transfer)
                continue
            if status == "DONE":
                self._agent.release(transfer)
                result.done.append(transfer)
            elif now >= transfer.deadline:
                window = transfer.deadline - transfer.posted_at
                self._agent.abort(transfer, f"stalled: no completion within {window:.3f} s")
                result.failed.append(transfer)
            else:
                still.append(transfer)
        self._inflight = still
        return result

    def advance(self) -> None:
        """Poll every tracked transfer without collecting it (between engine steps): a READ
        finishes, and its notification leaves, when it is done rather than at the next
        `poll_all`; failures and stalls are still reported by `poll_all`."""
        for transfer in self._inflight:
            try:
                self._agent.poll(transfer)
            except TransferFailed:
                continue

    def abort_all(self, reason: str) -> list[Transfer]:
        """Fail every tracked transfer (e.g. at shutdown) and return them."""
        aborted, self._inflight = self._inflight, []
        for transfer in aborted:
            self._agent.abort(transfer, reason)
        return aborted
