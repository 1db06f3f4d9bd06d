"""Connector configuration: one frozen object per engine, shared by both sides."""

from __future__ import annotations

from dataclasses import dataclass

from kvlink.connector.api import LoadFailurePolicy, TransferMode


@dataclass(frozen=True)
class ConnectorConfig:
    """Settings an engine passes to its connector.

    `side_channel_port` is the base port: TP rank r listens on `port + r`.
    """

    engine_id: str
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 5600
    lease_s: float = 30.0
    stall_timeout_s: float = 10.0
    quarantine_s: float = 60.0
    handshake_timeout_s: float = 5.0
    engine_ttl_s: float = 600.0
    load_failure_policy: LoadFailurePolicy = "fail"
    transfer_mode: TransferMode = "pull"
    # Shared by every P and D (see connector/secret.py); None: `$KVLINK_SECRET`. The scheduler
    # side refuses to run without one unless `insecure_unsigned_params` opts out explicitly.
    secret: bytes | None = None
    insecure_unsigned_params: bool = False
    # One start of this engine, shared by its scheduler side and every worker rank (set it
    # once per process start, e.g. a random token). P's params and agent names carry it, so
    # D can tell a restarted P (same engine id and port, fresh memory) from the one that
    # prefilled a request. None: no such check.
    incarnation: str | None = None

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise ValueError("engine_id must be a non-empty string")
        if self.lease_s <= 0 or self.stall_timeout_s <= 0 or self.handshake_timeout_s <= 0:
            raise ValueError("lease_s, stall_timeout_s and handshake_timeout_s must be positive")
        if self.load_failure_policy not in ("recompute", "fail"):
            raise ValueError(f"load_failure_policy must be 'recompute' or 'fail', got {self.load_failure_policy!r}")
        if self.transfer_mode not in ("pull", "push"):
            raise ValueError(f"transfer_mode must be 'pull' or 'push', got {self.transfer_mode!r}")

    @property
    def heartbeat_interval_s(self) -> float:
        return self.lease_s / 6

    @property
    def lease_extension_s(self) -> float:
        return self.lease_s * 2 / 3
