"""Book of D-side loads in progress: their transfers, the blocks they write, their figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvlink.connector.api import WorkerOutput
from kvlink.connector.stats import TransferRecord
from kvlink.transfer.xfer import Transfer

if TYPE_CHECKING:
    from kvlink.connector.checks import LoadCheck
    from kvlink.connector.staging import StagingPool
    from kvlink.layout.conv_state import ConvTranspose
    from kvlink.plan.staged import StagedRequest


@dataclass
class Load:
    request_id: str
    entry: dict[str, Any]
    blocks: set[int]
    started: float
    transfers: list[Transfer] = field(default_factory=list)
    failed: bool = False
    pushes_expected: int = 0
    pushes_seen: set[str] = field(default_factory=set)
    deadline: float = float("inf")
    # push mode: what the sources will write, from D's own plan (P's WRITEs are not ours to count)
    push_bytes: int = 0
    push_descriptors: int = 0
    # staged read: the engine's staging pool and the plan request (slots to give back, runs to copy)
    staging: tuple[StagingPool, StagedRequest] | None = None
    # pull with a notification agent: (READ, P agent, `done` message) still to send when it is
    # done; a checked push: (None, P agent, `done`), sent once the check is over
    dones: list[tuple[Transfer | None, str, bytes]] = field(default_factory=list)
    # integrity check (verify_kv): the digests to compare before the request may run
    check: LoadCheck | None = None
    # push mode: D's own plan of what the sources write, for the check after `pushed`
    push_specs: list[Any] = field(default_factory=list)
    # a source with another SSM conv layout: what re-lays out the state blocks this load writes
    conv: tuple[ConvTranspose, dict[int, list[int]]] | None = None
    # push mode, the request aborted: we asked the sources to stop (`Cancel`), and these answered
    cancelled: bool = False
    cancel_acks: set[str] = field(default_factory=set)


def complete_push(book: LoadBook, out: WorkerOutput, load: Load, now: float) -> None:
    """Every source pushed (and the check, if any, passed): the request may run."""
    book.finish(load.request_id)
    out.finished_recving.add(load.request_id)
    out.transfer_figures[load.request_id] = {
        "kv_bytes": float(load.push_bytes),
        "kv_transfer_s": now - load.started,
        "kv_descriptors": float(load.push_descriptors),
    }
    if load.check is not None:  # as a pulled load reports it
        out.transfer_figures[load.request_id]["kv_verified_bytes"] = float(load.check.hashed_bytes)


def transfer_record(request_id: str, t: Transfer) -> TransferRecord:
    """Figures of one finished transfer, from NIXL telemetry when the agent captured it."""
    tel = t.telemetry
    if tel is not None:
        return TransferRecord(request_id, tel.xfer_us / 1e6, tel.post_us / 1e6, t.nbytes, tel.desc_count)
    return TransferRecord(request_id, 0.0, 0.0, t.nbytes, t.desc_count)


@dataclass
class LoadBook:
    loads: dict[str, Load] = field(default_factory=dict)

    def start(self, request_id: str, entry: dict[str, Any], blocks: set[int], now: float) -> Load:
        load = Load(request_id, entry, blocks, now)
        self.loads[request_id] = load
        return load

    def get(self, request_id: str) -> Load | None:
        return self.loads.get(request_id)

    def finish(self, request_id: str) -> None:
        self.loads.pop(request_id, None)
