"""Push mode: P WRITEs a finished request's KV into blocks D allocated and announced.

D sends a `push` notification to each source P rank with its block ids and side
channel; P handshakes back with that D rank once, plans with the same planner (D as
reader, itself as the only source) and WRITEs, attaching `pushed` to the data. D
counts one `pushed` per source rank; a deadline turns silence into a failed load.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvlink.connector.handshakes import HandshakeRunner
from kvlink.connector.loads import Load, complete_push, transfer_record
from kvlink.connector.notifs import Pushed, PushRequest, encode
from kvlink.connector.remote import RemoteEngine, connect_writer, release_engine
from kvlink.connector.worker_parts import WorkerParts
from kvlink.layout.geometry import WorkerGeometry
from kvlink.transfer.agent import NixlAgent
from kvlink.transfer.inflight import InflightTracker
from kvlink.transfer.xfer import Transfer, TransferFailed

log = logging.getLogger("kvlink.connector.push")


@dataclass
class _Job:
    request: PushRequest
    received: float
    retried: bool = False  # a WRITE to a D we knew failed once: D may have restarted


class PushWriter:
    """Built at registration. `side_channel_base` is the port of rank 0's side channel of this
    engine (ours is that plus our rank): what a source P handshakes back with."""

    def __init__(self, worker: WorkerParts, agent: NixlAgent, geometry: WorkerGeometry,
                 inflight: InflightTracker, side_channel_base: int) -> None:
        self.worker = worker
        self.agent = agent
        self.geometry = geometry
        self.inflight = inflight
        self.side_channel_base = side_channel_base
        cfg = worker.config
        self.handshakes = HandshakeRunner(cfg.handshake_timeout_s, cfg.secret)
        self.readers: dict[tuple[str, int], RemoteEngine] = {}
        self.held_blocks: dict[str, list[list[int]]] = {}
        self.jobs: list[_Job] = []
        self.writes: dict[int, tuple[str, int, _Job]] = {}
        # D side: what runs once every source pushed (the worker's check of the load, if any),
        # and whether a load will be checked (then its sources wait for our `done` to free)
        self.on_all_pushed: Callable[[Load], None] = self.complete
        self.will_check: Callable[[RemoteEngine, dict[str, Any]], bool] = lambda engine, entry: False

    # ---- D side -------------------------------------------------------------------------
    def request_push(self, engine: RemoteEngine, entry: dict[str, Any]) -> None:
        w = self.worker
        now = w.clock()
        assert engine.plan is not None
        try:  # what the sources will write: checks the ids now, and gives the request's figures
            specs = engine.plan.request_ids(entry["local_block_ids"], entry["remote_block_ids"],
                                            entry["num_tokens"], entry["local_computed_tokens"])
        except (ValueError, KeyError) as exc:
            w.fail_request(entry["request_id"], _blocks(entry), f"cannot plan request: {exc}", bad_params=True)
            return
        sources = engine.plan.mapping.source_ranks
        load = w.book.start(entry["request_id"], entry, _blocks(entry), now)
        load.pushes_expected = len(sources)
        load.push_bytes = sum(spec.nbytes for spec in specs)
        load.push_descriptors = sum(len(spec.local_idx) for spec in specs)
        load.push_specs = list(specs)
        load.deadline = now + w.config.stall_timeout_s + w.config.handshake_timeout_s
        checked = self.will_check(engine, entry)
        for rank, name in engine.notify_agents(sources):
            info = {
                "d_request_id": entry["request_id"], "d_engine_id": w.config.engine_id,
                "d_host": w.config.side_channel_host, "d_port": self.side_channel_base,
                "d_rank": self.geometry.tp_rank, "local_block_ids": entry["local_block_ids"],
                "local_computed_tokens": entry["local_computed_tokens"],
                "num_tokens": entry["num_tokens"], "expected": engine.expected[rank],
                # wall clock, as kv_expires_at_ms: past it D has given up and P must not write
                "d_deadline_ms": int((time.time() + load.deadline - now) * 1000),
                # D reads our digests after `pushed`: free on its `done`, not on the WRITE's end
                "checked": checked,
            }
            try:
                w.send_or_raise(name, encode(PushRequest(entry["remote_request_id"], info), w.secret), engine)
            except TransferFailed as exc:
                if not w.retry_after_handshake(engine.engine_id, entry, f"push request not sent ({exc.reason})"):
                    w.stats.count("failed_notifications_total")
                    w.fail_request(entry["request_id"], _blocks(entry), f"cannot ask for the push: {exc.reason}")
                return
        w.notify(engine, entry, "notify", only_extra=True)

    def on_pushed(self, d_request_id: str, sender: str) -> None:
        w = self.worker
        load = w.book.get(d_request_id)
        if load is None or load.failed:
            log.info("late or unknown push completion for %s from %s ignored", d_request_id, sender)
            return
        load.pushes_seen.add(sender)
        if len(load.pushes_seen) == load.pushes_expected:
            self.on_all_pushed(load)

    def complete(self, load: Load) -> None:
        complete_push(self.worker.book, self.worker.out, load, self.worker.clock())

    # ---- P side -------------------------------------------------------------------------
    def remember_blocks(self, request_id: str, block_ids: list[list[int]]) -> None:
        self.held_blocks[request_id] = block_ids

    def forget_blocks(self, request_id: str) -> None:
        self.held_blocks.pop(request_id, None)

    def on_push_request(self, msg: PushRequest, now: float) -> None:
        self.jobs.append(_Job(msg, now))

    def poll(self, now: float) -> None:
        w = self.worker
        for rid, load in list(w.book.loads.items()):
            pushed = len(load.pushes_seen) >= load.pushes_expected  # then the check has its own deadline
            if load.pushes_expected and not pushed and not load.failed and now > load.deadline:
                w.stats.count("stalled_transfers_total")
                # A frozen P may still take the push request, or finish its WRITE, later: keep
                # the blocks out of use as a stalled pull's are.
                w.out.quarantine_s[rid] = w.config.quarantine_s
                w.fail_request(rid, load.blocks, "stalled: no push completion before the deadline",
                               stalled=True)
        for key, result in self.handshakes.take_done():
            assert isinstance(key, tuple)
            d_engine, _, _, d_rank = key
            if isinstance(result, BaseException):
                w.stats.count("failed_handshakes_total")
                log.warning("push handshake with %s failed: %s", key, result)
                # D is unreachable: drop its pending pushes (D fails them at its own deadline)
                # rather than handshaking again on every poll.
                self.jobs = [job for job in self.jobs if not _for_reader(job, d_engine, d_rank)]
                continue
            try:
                self.readers[(d_engine, d_rank)] = connect_writer(
                    self.agent, self.geometry, d_engine, d_rank, result[d_rank])
            except Exception as exc:
                w.stats.count("refused_peers_total")
                log.error("refusing push reader %s rank %d: %s", d_engine, d_rank, exc)
        keep = []
        wall_ms = time.time() * 1000
        for job in self.jobs:
            if now - job.received > w.config.stall_timeout_s:
                log.warning("push request for %s dropped: too old", job.request.request_id)
                continue
            d_deadline = job.request.info.get("d_deadline_ms")
            if isinstance(d_deadline, (int, float)) and wall_ms > d_deadline:
                # e.g. P was stopped past it: D failed or recomputed the load and may reuse
                # the blocks after its quarantine; a WRITE now would also wait on an idle D.
                w.stats.count("late_push_requests_total")
                log.warning("push request for %s dropped: D's deadline passed %.1f s ago",
                            job.request.request_id, (wall_ms - d_deadline) / 1000)
                continue
            if not self._try_write(job):
                keep.append(job)
        self.jobs = keep

    def _try_write(self, job: _Job) -> bool:
        info, rid = job.request.info, job.request.request_id
        try:
            d_engine, d_rank = str(info["d_engine_id"]), int(info["d_rank"])
            host, port = str(info["d_host"]), int(info["d_port"])
            blocks = self.held_blocks.get(rid)
            if blocks is None:
                return False
            reader = self.readers.get((d_engine, d_rank))
            if reader is None:
                key = (d_engine, host, port, d_rank)
                if not self.handshakes.pending(key):
                    self.handshakes.request(key, host, port, d_engine, [d_rank])
                return False
            assert reader.plan is not None
            (spec,) = reader.plan.request_ids(info["local_block_ids"], blocks, int(info["num_tokens"]),
                                              int(info["local_computed_tokens"]))
            expected, done = int(info["expected"]), encode(Pushed(str(info["d_request_id"])), self.worker.secret)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("bad push request for %s dropped: %s", rid, exc)
            return True
        h = reader.handles[d_rank]
        if not len(spec.local_idx):
            self.worker.send(h.agent_name, done)
            if not info.get("checked"):
                self.worker.leases.notify(rid, expected, job.received)
            return True
        try:
            t = self.agent.post("WRITE", h.local_handle, spec.remote_idx, h.remote_handle,
                                spec.local_idx, done, tag=("push", rid))
        except TransferFailed as exc:
            self.worker.stats.count("failed_transfers_total")
            log.warning("push WRITE for %s failed: %s", rid, exc.reason)
            self._drop_reader(d_engine, d_rank)
            return not self._retry(job)
        self.writes[id(t)] = (rid, expected, job)
        self.inflight.add(t)
        return True

    def on_transfer_done(self, t: Transfer, now: float) -> None:
        entry = self.writes.pop(id(t), None)
        if entry is not None:
            self.worker.stats.record(transfer_record(entry[0], t))
            if not entry[2].request.info.get("checked"):
                self.worker.leases.notify(entry[0], entry[1], now)

    def on_transfer_failed(self, t: Transfer) -> None:
        entry = self.writes.pop(id(t), None)
        if entry is not None:
            rid, _, job = entry
            self.worker.stats.count("failed_transfers_total")
            log.warning("push WRITE for %s failed: %s", rid, t.failure)
            info = job.request.info
            self._drop_reader(str(info["d_engine_id"]), int(info["d_rank"]))
            if self._retry(job):
                self.jobs.append(job)

    def _retry(self, job: _Job) -> bool:
        """Once per push request: a D that restarted under the same engine id is behind the
        connection that failed; the job stays queued, so the next poll handshakes afresh."""
        if job.retried:
            return False
        job.retried = True
        log.info("retrying the push for %s after a new handshake with %s", job.request.request_id,
                 job.request.info.get("d_engine_id"))
        return True

    def _drop_reader(self, d_engine: str, d_rank: int) -> None:
        reader = self.readers.pop((d_engine, d_rank), None)
        if reader is not None:
            release_engine(self.agent, reader)

    def shutdown(self) -> None:
        self.handshakes.shutdown()
        for d_engine, d_rank in list(self.readers):
            self._drop_reader(d_engine, d_rank)


def _for_reader(job: _Job, d_engine: str, d_rank: int) -> bool:
    info = job.request.info
    return bool(info.get("d_engine_id") == d_engine and info.get("d_rank") == d_rank)


def _blocks(entry: dict[str, Any]) -> set[int]:
    return {int(b) for ids in entry.get("local_block_ids", []) for b in ids}
