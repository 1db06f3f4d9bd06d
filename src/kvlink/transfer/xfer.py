"""One posted transfer: its bookkeeping, its telemetry, and the error a failed one raises."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

Op = Literal["READ", "WRITE"]
State = Literal["PROC", "DONE", "FAILED"]


class TransferFailed(RuntimeError):
    """A transfer or notification could not complete; ``reason`` says why.

    Raised for peer disconnects, NIXL errors, an ``"ERR"`` status, and stalls.
    The affected destination bytes must be treated as invalid.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def describe(exc: BaseException) -> str:
    """``ExceptionType: message``, for failure reasons (NIXL's class names carry the meaning)."""
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class TransferTelemetry:
    """NIXL's per-request telemetry (times in microseconds)."""

    start_us: int
    post_us: int
    xfer_us: int
    total_bytes: int
    desc_count: int

    @classmethod
    def from_native(cls, native: Any) -> TransferTelemetry:
        return cls(
            start_us=int(native.startTime),
            post_us=int(native.postDuration),
            xfer_us=int(native.xferDuration),
            total_bytes=int(native.totalBytes),
            desc_count=int(native.descCount),
        )


@dataclass(eq=False)
class Transfer:
    """A request posted through ``NixlAgent.post``.

    ``desc_count`` is the number of descriptors asked for; NIXL may merge
    adjacent ones (see ``telemetry.desc_count``). ``deadline`` is on the
    ``time.monotonic`` clock; ``math.inf`` means no stall deadline.
    """

    op: Op
    remote_name: str
    nbytes: int
    desc_count: int
    notif: bytes
    posted_at: float
    handle: Any = field(repr=False)
    deadline: float = math.inf
    tag: object = None
    state: State = "PROC"
    failure: str | None = None
    telemetry: TransferTelemetry | None = None
    released: bool = False

    @property
    def finished(self) -> bool:
        return self.state != "PROC"
