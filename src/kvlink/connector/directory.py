"""The remote engines one worker reads from: one handshake each, then a prepared plan.

Handshakes run in background threads; their results are applied (NIXL calls) on the
engine thread in `collect`. An engine is dropped after a failed transfer to it (it
may have restarted) or after `engine_ttl_s` without use.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kvlink.connector.config import ConnectorConfig
from kvlink.connector.handshakes import HandshakeRunner
from kvlink.connector.remote import (
    DigestSlotsFor,
    RemoteEngine,
    StagingFor,
    connect_reader,
    release_engine,
)
from kvlink.connector.stats import ConnectorStats
from kvlink.layout.geometry import WorkerGeometry
from kvlink.plan.tp_mapping import compute_tp_mapping
from kvlink.transfer.agent import NixlAgent
from kvlink.transfer.side_channel import EngineMismatch, HandshakeRefused

log = logging.getLogger("kvlink.connector")
Key = tuple[str, str, int]


def engine_key(entry: dict[str, Any]) -> Key:
    return (entry["remote_engine_id"], entry["remote_host"], int(entry["remote_port"]))


class EngineDirectory:
    def __init__(self, config: ConnectorConfig, stats: ConnectorStats) -> None:
        self.config, self.stats = config, stats
        self.handshakes = HandshakeRunner(config.handshake_timeout_s, config.secret)
        self.engines: dict[str, RemoteEngine] = {}
        self._asked: dict[Key, float] = {}
        self.on_connect: Callable[[RemoteEngine], None] | None = None  # after an engine is connected
        self.on_release: Callable[[RemoteEngine], None] | None = None  # after an engine is dropped

    def known(self, entry: dict[str, Any]) -> bool:
        return entry["remote_engine_id"] in self.engines or self.handshakes.pending(engine_key(entry))

    def lookup(self, entry: dict[str, Any], local: WorkerGeometry) -> RemoteEngine | None:
        """The ready engine, or None after making sure a handshake with it is under way."""
        engine = self.engines.get(entry["remote_engine_id"])
        if engine is not None:
            return engine
        key = engine_key(entry)
        if not self.handshakes.pending(key):
            ranks = compute_tp_mapping(local.model, local.tp_size, local.tp_rank,
                                       entry["remote_tp_size"]).notify_ranks
            self.handshakes.request(key, entry["remote_host"], entry["remote_port"],
                                    entry["remote_engine_id"], ranks)
            self._asked[key] = time.monotonic()
        return None

    def collect(self, agent: NixlAgent, local: WorkerGeometry,
                on_failure: Callable[[str, str, bool], None], staging_for: StagingFor | None = None,
                digest_slots_for: DigestSlotsFor | None = None) -> None:
        """Apply finished handshakes; `on_failure(engine_id, reason, bad_params)` for each that
        failed. `bad_params`: the params name what is not there (another engine answers at
        that address, or one D cannot read from); otherwise P could not be reached (dead,
        restarting, not answering), which a retry through another P may not meet."""
        for key, result in self.handshakes.take_done():
            engine_id = str(key[0]) if isinstance(key, tuple) else str(key)
            asked = self._asked.pop(key, None)  # type: ignore[call-overload]
            fetched = time.monotonic()
            self.stats.count_engine("handshakes_total", engine_id)
            if isinstance(result, BaseException):
                self.stats.count("failed_handshakes_total")
                self.stats.count_engine("failed_handshakes_by_engine_total", engine_id)
                log.warning("handshake with engine %s failed: %s", engine_id, result)
                wrong_engine = isinstance(result, (HandshakeRefused, EngineMismatch))
                on_failure(engine_id, f"handshake failed: {result}", wrong_engine)
                continue
            try:
                engine = connect_reader(agent, local, engine_id, result, staging_for, digest_slots_for)
                self.engines[engine_id] = engine
                if self.on_connect is not None:
                    self.on_connect(engine)
                assert engine.plan is not None
                log.info("connected to engine %s: handshake %.0f ms, plan and prepare %.0f ms (%d local, "
                         "%d remote descriptors%s%s)", engine_id,
                         1e3 * (fetched - asked) if asked is not None else -1.0,
                         1e3 * (time.monotonic() - fetched),
                         sum(len(s.local_descs) for s in engine.plan.sources),
                         sum(len(s.remote_descs) for s in engine.plan.sources),
                         ", staged" if engine.staged is not None else "",
                         ", KV digests checked" if engine.digest_slots else "")
            except Exception as exc:  # incompatible layout, NIXL refusal: fail its requests, keep serving
                self.stats.count("refused_peers_total")
                self.stats.count_engine("failed_handshakes_by_engine_total", engine_id)
                log.error("refusing engine %s: %s", engine_id, exc)
                on_failure(engine_id, f"remote engine refused: {exc}", True)

    def drop(self, agent: NixlAgent | None, engine_id: str) -> None:
        engine = self.engines.pop(engine_id, None)
        if engine is not None and self.on_release is not None:
            self.on_release(engine)
        if engine is not None and agent is not None:
            release_engine(agent, engine)

    def evict_idle(self, agent: NixlAgent | None, busy: set[str], now: float) -> None:
        for engine_id, engine in list(self.engines.items()):
            if engine_id not in busy and now - engine.last_used > self.config.engine_ttl_s:
                log.info("evicting idle remote engine %s", engine_id)
                self.drop(agent, engine_id)

    def shutdown(self, agent: NixlAgent | None) -> None:
        self.handshakes.shutdown()
        for engine_id in list(self.engines):
            self.drop(agent, engine_id)
