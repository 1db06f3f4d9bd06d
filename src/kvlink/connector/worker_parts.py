"""What the pull reader and the push writer use of the worker they serve, as a protocol.

They are handed these parts instead of the worker class, so `worker.py` imports them
and they never import it back (docs/structure.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from kvlink.connector.api import WorkerOutput
from kvlink.connector.config import ConnectorConfig
from kvlink.connector.lease import LeaseTable
from kvlink.connector.loads import LoadBook
from kvlink.connector.notifier import Notifier
from kvlink.connector.remote import RemoteEngine
from kvlink.connector.stats import ConnectorStats


class WorkerParts(Protocol):
    """One TP rank's worker as its reader and writer see it (`NixlWorker` is one).

    `out` is this step's output; every poll hands it to the engine and starts a new one,
    so read it through the worker each time and never keep it. `notifier` is the second
    agent that sends notifications, or None (never built, or given up after a failure).
    """

    config: ConnectorConfig
    secret: bytes | None
    stats: ConnectorStats
    book: LoadBook
    leases: LeaseTable
    clock: Callable[[], float]
    out: WorkerOutput
    notifier: Notifier | None
    engines: dict[str, RemoteEngine]

    def fail_request(self, rid: str, blocks: set[int], reason: str, bad_params: bool = False,
                     forbidden: bool = False, stalled: bool = False) -> None:
        """Report a load as failed with exactly `blocks` invalid."""

    def retry_after_handshake(self, engine_id: str, entry: dict[str, Any], why: str) -> bool:
        """Queue a load again behind a fresh handshake, once; False if it had its retry."""

    def drop_engine(self, engine_id: str) -> None:
        """Forget a remote engine (its next load handshakes again)."""

    def notify(self, engine: RemoteEngine, entry: dict[str, Any], kind: str,
               only_extra: bool = False) -> None:
        """Send a load's `done`, notify-only or heartbeat messages to the engine's ranks."""

    def send(self, agent_name: str, msg: bytes, engine: RemoteEngine | None = None) -> None:
        """Notify one remote agent; a failure is counted and logged."""

    def send_or_raise(self, agent_name: str, msg: bytes, engine: RemoteEngine | None = None) -> None:
        """Notify one remote agent; raises TransferFailed."""
