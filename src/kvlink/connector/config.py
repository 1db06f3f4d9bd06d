"""Connector configuration: one frozen object per engine, shared by both sides."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvlink.connector.api import LoadFailurePolicy, TransferMode
from kvlink.connector.params import MAX_ENGINE_ID_CHARS, is_engine_name
from kvlink.layout.limits import (
    PORT_OR_EPHEMERAL,
    SECONDS,
    SECONDS_OR_ZERO,
    bounded,
    check_fields,
    int_range,
)

VERIFY_MODES = ("off", "sample", "full")
_INCARNATION = re.compile(r"[A-Za-z0-9_.]{1,64}")


@dataclass(frozen=True)
class ConnectorConfig:
    """Settings an engine passes to its connector.

    `side_channel_port` is the base port: TP rank r listens on `port + r` (0: ephemeral).
    Sizes and durations carry their allowed range (`kvlink.layout.limits`); building one
    from any dict (an engine's extra config) checks them.
    """

    engine_id: str
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = bounded(PORT_OR_EPHEMERAL, 5600)
    lease_s: float = bounded(SECONDS, 30.0)
    stall_timeout_s: float = bounded(SECONDS, 10.0)
    quarantine_s: float = bounded(SECONDS_OR_ZERO, 60.0)
    handshake_timeout_s: float = bounded(SECONDS, 5.0)
    engine_ttl_s: float = bounded(SECONDS, 600.0)
    load_failure_policy: LoadFailurePolicy = "fail"
    transfer_mode: TransferMode = "pull"
    # Layerwise (D first, P writes each layer as it prefills): how long D waits for P's
    # last write past the usual stall and handshake deadlines; P's queue and prefill are in it.
    layerwise_wait_s: float = bounded(SECONDS, 60.0)
    # Per reader worker and P kernel block size: staging pages for reads between different
    # kernel block sizes of a non token-major page order (kvlink.plan.staged). Allocated at
    # the first such handshake and touched only as READs land.
    staging_mib: int = bounded(int_range(1, 1 << 20), 256)
    # D's `done` notifications (and heartbeats) leave from a second NIXL agent that moves no
    # data: on UCX a READ posted after a notification on the same endpoint waits for the
    # peer's next progress (kvlink.connector.notifier). False: they ride the READs.
    separate_notifier: bool = True
    # Shared by every P and D (see connector/secret.py); None: `$KVLINK_SECRET`. The scheduler
    # side refuses to run without one unless `insecure_unsigned_params` opts out explicitly.
    secret: bytes | None = None
    insecure_unsigned_params: bool = False
    # One start of this engine, shared by its scheduler side and every worker rank (set it
    # once per process start, e.g. a random token). P's params and agent names carry it, so
    # D can tell a restarted P (same engine id and port, fresh memory) from the one that
    # prefilled a request. None: no such check.
    incarnation: str | None = None
    # End-to-end KV integrity (kvlink.connector.integrity): P digests what it ships, D checks
    # what it received before the request runs. "full" checks every unit D holds whole,
    # "sample" `verify_sample_units` of them per source rank (every block's seed is checked
    # either way), "off" neither seals nor checks.
    verify_kv: str = "sample"
    verify_sample_units: int = bounded(int_range(1, 1 << 20), 4)

    def __post_init__(self) -> None:
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ValueError(f"engine_id: expected a non-empty string, got {self.engine_id!r}")
        if not isinstance(self.side_channel_host, str) or not self.side_channel_host:
            raise ValueError(f"side_channel_host: expected a host name or address, got "
                             f"{self.side_channel_host!r}")
        for name in ("engine_id", "side_channel_host"):  # as D accepts them in P's params
            value = getattr(self, name)
            if not is_engine_name(value):
                raise ValueError(f"{name}: at most {MAX_ENGINE_ID_CHARS} printable characters (a decode "
                                 f"instance refuses params naming another), got {len(value)}: {value[:40]!r}")
        check_fields(self)
        if self.load_failure_policy not in ("recompute", "fail"):
            raise ValueError(f"load_failure_policy must be 'recompute' or 'fail', got {self.load_failure_policy!r}")
        if self.transfer_mode not in ("pull", "push", "layerwise"):
            raise ValueError(f"transfer_mode must be 'pull', 'push' or 'layerwise', got {self.transfer_mode!r}")
        if self.layerwise_wait_s <= 0:
            raise ValueError(f"layerwise_wait_s must be > 0, got {self.layerwise_wait_s}")
        if self.verify_kv not in VERIFY_MODES:
            raise ValueError(f"verify_kv must be 'off', 'sample' or 'full', got {self.verify_kv!r}")
        for name in ("separate_notifier", "insecure_unsigned_params"):
            # a string such as "false" would read as true (insecure_unsigned_params: signing off)
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false (a JSON boolean), got {getattr(self, name)!r}")
        if self.incarnation is not None and (
                not isinstance(self.incarnation, str) or not _INCARNATION.fullmatch(self.incarnation)):
            # it ends the agent names, after their last "-"
            raise ValueError(f"incarnation must be 1 to 64 letters, digits, '_' or '.', got {self.incarnation!r}")
        if self.secret is not None and not isinstance(self.secret, bytes):
            raise ValueError(f"secret must be bytes, got {type(self.secret).__name__}")

    @property
    def heartbeat_interval_s(self) -> float:
        return self.lease_s / 6

    @property
    def lease_extension_s(self) -> float:
        return self.lease_s * 2 / 3
