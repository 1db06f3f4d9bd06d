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

import numpy as np

from kvlink.connector.handshakes import HandshakeRunner
from kvlink.connector.layerwise import LayerProgress, Stream, tokens_ready
from kvlink.connector.loads import Load, complete_push, transfer_record
from kvlink.connector.notifs import Cancel, Cancelled, Pushed, PushRequest, encode
from kvlink.connector.remote import RemoteEngine, connect_writer, conv_blocks, release_engine
from kvlink.connector.worker_parts import WorkerParts
from kvlink.layout.geometry import WorkerGeometry
from kvlink.layout.spec import is_ssm
from kvlink.plan.request import ReadSpec
from kvlink.plan.staged import StagedRequest
from kvlink.transfer.agent import NixlAgent
from kvlink.transfer.inflight import InflightTracker
from kvlink.transfer.xfer import Transfer, TransferFailed

log = logging.getLogger("kvlink.connector.push")


@dataclass
class _Job:
    request: PushRequest
    received: float
    retried: bool = False  # a WRITE to a D we knew failed once: D may have restarted
    layers: LayerProgress | None = None  # layerwise: what went to D while P prefilled

    @property
    def layerwise(self) -> bool:
        return bool(self.request.info.get("layerwise"))


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
        # Layerwise (P): requests announced by the scheduler side, the jobs writing each one's
        # layers as the forward makes them, and those layer WRITEs in flight.
        self.streams: dict[str, Stream] = {}
        self.stream_keys: dict[str, str] = {}  # D's name for a stream -> P's request id
        self.streaming: dict[str, list[_Job]] = {}
        self.layer_writes: dict[int, _Job] = {}
        self.cancelled: list[_Job] = []  # D asked us to stop: answered once their WRITEs landed
        self.take_requests: Callable[[], None] | None = None  # the worker's: new push requests, now
        # D side: what runs once every source pushed (the worker's check of the load, if any),
        # and whether a load will be checked (then its sources wait for our `done` to free)
        self.on_all_pushed: Callable[[Load], None] = self.complete
        self.will_check: Callable[[RemoteEngine, dict[str, Any]], bool] = lambda engine, entry: False
        # D side, staged layerwise: staging slots and the staged request (the pull reader's)
        self.stage: Callable[[RemoteEngine, dict[str, Any]], StagedRequest | None] = lambda engine, entry: None

    # ---- D side -------------------------------------------------------------------------
    def request_push(self, engine: RemoteEngine, entry: dict[str, Any]) -> bool:
        """Ask every source rank to write the load; False while it waits (staging slots)."""
        w = self.worker
        now = w.clock()
        assert engine.plan is not None
        layerwise = entry.get("transfer_mode") == "layerwise"
        staged: StagedRequest | None = None
        target_ids, target_computed = entry["local_block_ids"], entry["local_computed_tokens"]
        try:  # what the sources will write: checks the ids now, and gives the request's figures
            p_ids = _p_ids_for_figures(engine, entry)
            if engine.staged is not None:  # layerwise only: P writes whole pages into staging
                staged = self.stage(engine, {**entry, "remote_block_ids": p_ids})
                if staged is None:
                    return entry["request_id"] in w.out.failed_recving
                specs = staged.specs
                target_ids = [list(staged.slots)] * len(self.geometry.model.groups)
                target_computed = staged.first
            else:
                specs = engine.plan.request_ids(entry["local_block_ids"], p_ids, entry["num_tokens"],
                                                entry["local_computed_tokens"])
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            w.fail_request(entry["request_id"], _blocks(entry), f"cannot plan request: {exc}", bad_params=True)
            return True
        sources = engine.plan.mapping.source_ranks
        load = w.book.start(entry["request_id"], entry, _blocks(entry), now)
        if staged is not None:
            assert engine.pool is not None
            load.staging = (engine.pool, staged)
        load.pushes_expected = len(sources)
        load.push_bytes = sum(spec.nbytes for spec in specs)
        load.push_descriptors = sum(len(spec.local_idx) for spec in specs)
        load.push_specs = list(specs)
        load.conv = conv_blocks(engine, specs)
        load.deadline = now + w.config.stall_timeout_s + w.config.handshake_timeout_s
        if layerwise:  # P may still have its queue and the whole prefill ahead of it
            load.deadline += w.config.layerwise_wait_s
        checked = self.will_check(engine, entry)
        for rank, name in engine.notify_agents(sources):
            info = {
                "d_request_id": entry["request_id"], "d_engine_id": w.config.engine_id,
                "d_host": w.config.side_channel_host, "d_port": self.side_channel_base,
                "d_rank": self.geometry.tp_rank, "local_block_ids": target_ids,
                "local_computed_tokens": target_computed,
                "num_tokens": entry["num_tokens"], "expected": engine.expected[rank],
                # wall clock, as kv_expires_at_ms: past it D has given up and P must not write
                "d_deadline_ms": int((time.time() + load.deadline - now) * 1000),
                # D reads our digests after `pushed`: free on its `done`, not on the WRITE's end
                "checked": checked,
            }
            if layerwise:  # P writes as it prefills, and only for the prompt it prefills
                info.update(layerwise=True, prompt_hash=entry["prompt_hash"])
            if engine.staged is not None:  # the ids are staging pages of P's kernel block size
                info["staging"] = engine.staged.stage_tokens
            try:
                w.send_or_raise(name, encode(PushRequest(entry["remote_request_id"], info), w.secret), engine)
            except TransferFailed as exc:
                if not w.retry_after_handshake(engine.engine_id, entry, f"push request not sent ({exc.reason})"):
                    w.stats.count("failed_notifications_total")
                    w.fail_request(entry["request_id"], _blocks(entry), f"cannot ask for the push: {exc.reason}")
                return True
        w.notify(engine, entry, "notify", only_extra=True)
        return True

    def on_pushed(self, d_request_id: str, sender: str,
                  remote_block_ids: tuple[tuple[int, ...], ...] | None = None) -> None:
        w = self.worker
        load = w.book.get(d_request_id)
        if load is None or load.failed:
            log.info("late or unknown push completion for %s from %s ignored", d_request_id, sender)
            return
        layerwise = remote_block_ids is not None and load.entry.get("transfer_mode") == "layerwise"
        if layerwise and not self._learn_p_blocks(load, remote_block_ids or ()):
            return
        load.pushes_seen.add(sender)
        if len(load.pushes_seen) == load.pushes_expected:
            self.on_all_pushed(load)

    def _learn_p_blocks(self, load: Load, ids: tuple[tuple[int, ...], ...]) -> bool:
        """Layerwise: P's blocks, known now; the digest check of the load reads P's digests of
        them. Every source rank names the same blocks (P's ranks share one block table)."""
        w = self.worker
        listed = [list(g) for g in ids]
        known = load.entry.get("remote_block_ids") or []
        if any(known) and known != listed:
            w.fail_request(load.request_id, load.blocks, "P's ranks named different blocks for one request")
            return False
        engine = w.engines.get(load.entry["remote_engine_id"])
        if not any(known) and engine is not None and engine.plan is not None:
            load.entry = {**load.entry, "remote_block_ids": listed}
            e = load.entry
            try:
                if load.staging is not None and engine.staged is not None:
                    load.push_specs = engine.staged.request(e["local_block_ids"], listed, e["num_tokens"],
                                                            e["local_computed_tokens"], load.staging[1].slots).specs
                else:
                    load.push_specs = engine.plan.request_ids(e["local_block_ids"], listed, e["num_tokens"],
                                                              e["local_computed_tokens"])
            except (ValueError, KeyError) as exc:
                w.fail_request(load.request_id, load.blocks, f"P named blocks that cannot hold the request: {exc}")
                return False
        return True

    def complete(self, load: Load) -> None:
        complete_push(self.worker.book, self.worker.out, load, self.worker.clock())

    # ---- P side -------------------------------------------------------------------------
    def remember_blocks(self, request_id: str, block_ids: list[list[int]]) -> None:
        self.held_blocks[request_id] = block_ids

    def forget_blocks(self, request_id: str) -> None:
        self.held_blocks.pop(request_id, None)
        self.end_stream(request_id)

    def open_stream(self, entry: dict[str, object]) -> None:
        rid = str(entry["request_id"])
        stream = Stream(rid, str(entry["prompt_hash"]), int(str(entry["num_tokens"])), str(entry.get("key") or rid))
        self.streams[rid] = stream
        holder = self.stream_keys.get(stream.key)
        if holder is not None and holder in self.streams and holder != rid:
            # First come keeps the name; a D asking by it gets that one (or is refused by
            # the prompt check), never this request's KV.
            log.warning("layerwise key %r of request %s already names request %s; not streaming it",
                        stream.key, rid, holder)
            return
        self.stream_keys[stream.key] = rid

    def end_stream(self, request_id: str) -> None:
        """P freed the request (D read it, its lease ran out, or it was aborted)."""
        stream = self.streams.pop(request_id, None)
        if stream is not None and self.stream_keys.get(stream.key) == request_id:
            del self.stream_keys[stream.key]
        self.streaming.pop(request_id, None)

    def waiting_for_d(self, request_id: str | None = None) -> bool:
        """A layerwise request (any, when None) still prefilling that no D has asked for yet."""
        rids = self.streams if request_id is None else ([request_id] if request_id in self.streams else [])
        return any(not self.streaming.get(rid) and rid not in self.held_blocks for rid in rids)

    def resolve(self, request_id: str) -> str:
        """P's own id of the request a layerwise D names by its key (else `request_id`)."""
        return self.stream_keys.get(request_id, request_id)

    def on_push_request(self, msg: PushRequest, now: float) -> None:
        self.jobs.append(_Job(msg, now))

    def on_cancel(self, msg: Cancel) -> None:
        """D's request ended before we finished writing it: drop its jobs (the WRITEs already
        posted still land) and answer once nothing of ours is in flight into its blocks."""
        def asked(job: _Job) -> bool:
            return (_for_reader(job, msg.d_engine_id, msg.d_rank)
                    and job.request.info.get("d_request_id") == msg.d_request_id)

        if any(asked(job) for _, _, job in self.writes.values()):
            return  # its last WRITE is in flight, and `pushed` with it: that is D's answer
        found = [job for job in self.jobs if asked(job)]
        if not found:
            log.info("cancel of %s from %s ignored: no push of it waits here", msg.d_request_id, msg.d_engine_id)
            return
        self.jobs = [job for job in self.jobs if not asked(job)]
        for job in found:
            self._unstream(job)
        self.cancelled += found
        self.worker.stats.count("cancelled_pushes_total", len(found))

    def _answer_cancels(self, now: float) -> None:
        keep = []
        for job in self.cancelled:
            if job.layers is not None and job.layers.inflight:
                keep.append(job)
                continue
            info = job.request.info
            d_engine, d_rank = str(info["d_engine_id"]), int(info["d_rank"])
            reader = self.readers.get((d_engine, d_rank))
            d_deadline = info.get("d_deadline_ms")
            if reader is None and isinstance(d_deadline, (int, float)) and time.time() * 1000 < d_deadline:
                # Not connected to that D yet (it cancelled before we got to it): connect to
                # answer, while an answer still helps D.
                self._connect(d_engine, str(info["d_host"]), int(info["d_port"]), d_rank)
                keep.append(job)
                continue
            self._end_cancelled(job, reader, now)
        self.cancelled = keep

    def _connect(self, d_engine: str, host: str, port: int, d_rank: int) -> None:
        """Start the handshake with that D rank, unless one is under way."""
        key = (d_engine, host, port, d_rank)
        if not self.handshakes.pending(key):
            self.handshakes.request(key, host, port, d_engine, [d_rank])

    def _end_cancelled(self, job: _Job, reader: RemoteEngine | None, now: float) -> None:
        """Answer D (when connected to it) and count the cancel as its `done` for our lease."""
        info, rid = job.request.info, self.resolve(job.request.request_id)
        if reader is not None:
            h = reader.handles[int(info["d_rank"])]
            self.worker.send(h.agent_name, encode(Cancelled(str(info["d_request_id"])), self.worker.secret))
        self.worker.leases.notify(rid, int(info["expected"]), now)
        log.info("push of %s to %s rank %s cancelled by D%s", rid,
                 info["d_engine_id"], info["d_rank"], "" if reader is not None else " (not answered: not connected)")

    def save_kv_layer(self, request_id: str, layer: int, computed: int, tables: list[Any]) -> None:
        """After `layer` of a forward of `request_id`: WRITE that layer's chunks that are now
        complete to every D rank that asked, if their connection is ready."""
        if self.take_requests is not None and self.waiting_for_d(request_id):
            # D's push request may have come in since this forward began (P and D got the
            # request at once, and one forward can be the whole prefill): look, between layers.
            self.take_requests()
        jobs = self.streaming.get(request_id)
        if not jobs:
            return
        p_ids: list[list[int]] | None = None
        for job in jobs:
            progress, info = job.layers, job.request.info
            reader = self.readers.get((str(info["d_engine_id"]), int(info["d_rank"])))
            if progress is None or progress.failed or reader is None or reader.plan is None:
                continue
            num_tokens = int(info["num_tokens"])
            end = tokens_ready(computed, num_tokens, reader.plan.chunk_tokens)
            # This layer, and (the job joined mid-forward) the earlier layers of this forward.
            for done in range(layer + 1):
                start = progress.sent[done]
                if end <= start:
                    continue
                if p_ids is None:  # torch tensors (kvlink's engine) or lists (vLLM's block ids)
                    p_ids = [[int(b) for b in (t.tolist() if hasattr(t, "tolist") else t)] for t in tables]
                try:
                    (spec,) = reader.plan.request_ids(info["local_block_ids"], p_ids, num_tokens,
                                                      int(info["local_computed_tokens"]), tokens=(start, end),
                                                      layers=[done])
                except (KeyError, TypeError, ValueError) as exc:
                    log.warning("layerwise write of %s layer %d dropped: %s", request_id, done, exc)
                    progress.failed = True
                    break
                progress.sent[done] = end
                if len(spec.local_idx):
                    self._post_layer(job, reader, spec, request_id)
        self.inflight.advance()  # over TCP the data moves when someone progresses the agent

    def _post_layer(self, job: _Job, reader: RemoteEngine, spec: Any, request_id: str) -> None:
        progress = job.layers
        assert progress is not None
        h = reader.handles[int(job.request.info["d_rank"])]
        try:
            t = self.agent.post("WRITE", h.local_handle, spec.remote_idx, h.remote_handle, spec.local_idx,
                                tag=("layer", request_id))
        except TransferFailed as exc:
            self.worker.stats.count("failed_transfers_total")
            log.warning("layerwise WRITE for %s failed: %s", request_id, exc.reason)
            progress.failed = True
            return
        progress.inflight += 1
        progress.writes += 1
        progress.bytes += spec.nbytes
        self.layer_writes[id(t)] = job
        self.inflight.add(t)

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
                for job in [j for j in self.cancelled if _for_reader(j, d_engine, d_rank)]:
                    self.cancelled.remove(job)
                    self._end_cancelled(job, None, now)
                continue
            try:
                self.readers[(d_engine, d_rank)] = connect_writer(
                    self.agent, self.geometry, d_engine, d_rank, result[d_rank])
            except Exception as exc:
                w.stats.count("refused_peers_total")
                log.error("refusing push reader %s rank %d: %s", d_engine, d_rank, exc)
        self._answer_cancels(now)
        keep = []
        wall_ms = time.time() * 1000
        for job in self.jobs:
            # A layerwise request waits for P's queue and prefill: D's deadline bounds it.
            if now - job.received > w.config.stall_timeout_s and not job.layerwise:
                log.warning("push request for %s dropped: too old", job.request.request_id)
                continue
            d_deadline = job.request.info.get("d_deadline_ms")
            if isinstance(d_deadline, (int, float)) and wall_ms > d_deadline:
                # e.g. P was stopped past it: D failed or recomputed the load and may reuse
                # the blocks after its quarantine; a WRITE now would also wait on an idle D.
                w.stats.count("late_push_requests_total")
                log.warning("push request for %s dropped: D's deadline passed %.1f s ago",
                            job.request.request_id, (wall_ms - d_deadline) / 1000)
                self._unstream(job)
                continue
            if not self._try_write(job):
                keep.append(job)
        self.jobs = keep

    def _try_write(self, job: _Job) -> bool:
        info, rid = job.request.info, self.resolve(job.request.request_id)
        try:
            d_engine, d_rank = str(info["d_engine_id"]), int(info["d_rank"])
            host, port = str(info["d_host"]), int(info["d_port"])
            blocks = self.held_blocks.get(rid)
            stream = self.streams.get(rid)
            if job.layerwise and stream is not None and (
                    info.get("prompt_hash") != stream.prompt_hash or int(info["num_tokens"]) != stream.num_tokens):
                self.worker.stats.count("refused_push_requests_total")
                log.warning("layerwise push request for %s refused: D's prompt is not the one P "
                            "prefills (prompt hash or length differ)", rid)
                self._unstream(job)
                return True
            if blocks is None and not job.layerwise:
                return False
            # Layerwise, D may ask before P has the request: connect now, the prefill comes later.
            reader = self.readers.get((d_engine, d_rank))
            if reader is None:
                self._connect(d_engine, host, port, d_rank)
                return False
            if int(info.get("staging") or 0) != reader.staged_tokens:
                # D's ids are of another space than our plan writes into: never guess which
                self.worker.stats.count("refused_push_requests_total")
                log.warning("push request for %s refused: D names %s, our plan for it writes into %s",
                            rid, _space(int(info.get("staging") or 0)), _space(reader.staged_tokens))
                self._unstream(job)
                return True
            if job.layerwise and stream is None:  # not here yet, or not a layerwise request here
                return False
            assert reader.plan is not None
            if job.layerwise and job.layers is None:  # from now on each finished layer goes out
                job.layers = LayerProgress.start(self.geometry.model.num_layers)
                self.streaming.setdefault(rid, []).append(job)
            if blocks is None:
                return False
            if job.layers is not None and job.layers.inflight:
                return False  # `pushed` must mean all of it landed: the layer WRITEs first
            if job.layers is not None and job.layers.failed:
                log.warning("layerwise push of %s dropped after a failed layer WRITE", rid)
                self._unstream(job)
                return True
            spec = self._final_spec(job, reader, blocks)
            if job.layerwise:  # one line per layerwise push: how much went during the prefill
                during = job.layers
                log.info("layerwise push of %s to %s rank %d: %d WRITEs (%d bytes) during the prefill, "
                         "%d bytes after it", rid, d_engine, d_rank, during.writes if during else 0,
                         during.bytes if during else 0, spec.nbytes)
            named = tuple(tuple(int(b) for b in g) for g in blocks) if job.layerwise else None
            expected = int(info["expected"])
            done = encode(Pushed(str(info["d_request_id"]), named), self.worker.secret)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("bad push request for %s dropped: %s", rid, exc)
            self._unstream(job)
            return True
        self._unstream(job)
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

    def _final_spec(self, job: _Job, reader: RemoteEngine, blocks: list[list[int]]) -> Any:
        """The whole request, or (layerwise) what the layer WRITEs left: one spec."""
        info = job.request.info
        assert reader.plan is not None
        args = (info["local_block_ids"], blocks, int(info["num_tokens"]), int(info["local_computed_tokens"]))
        if job.layers is None:
            (spec,) = reader.plan.request_ids(*args)
            return spec
        parts = [reader.plan.request_ids(*args, tokens=(start, int(info["num_tokens"])), layers=layers)[0]
                 for start, layers in job.layers.remainder()]
        return ReadSpec(parts[0].src_rank, np.concatenate([p.local_idx for p in parts]),
                        np.concatenate([p.remote_idx for p in parts]), sum(p.nbytes for p in parts),
                        parts[0].local_blocks)

    def _unstream(self, job: _Job) -> None:
        jobs = self.streaming.get(self.resolve(job.request.request_id))
        if jobs is not None and job in jobs:
            jobs.remove(job)

    def on_transfer_done(self, t: Transfer, now: float) -> None:
        layered = self.layer_writes.pop(id(t), None)
        if layered is not None:
            assert layered.layers is not None
            layered.layers.inflight -= 1
            self.worker.stats.record(transfer_record(layered.request.request_id, t))
            return
        entry = self.writes.pop(id(t), None)
        if entry is not None:
            self.worker.stats.record(transfer_record(entry[0], t))
            if not entry[2].request.info.get("checked"):
                self.worker.leases.notify(entry[0], entry[1], now)

    def on_transfer_failed(self, t: Transfer) -> None:
        layered = self.layer_writes.pop(id(t), None)
        if layered is not None:  # D gets no `pushed`: it fails or recomputes at its deadline
            assert layered.layers is not None
            layered.layers.inflight -= 1
            layered.layers.failed = True
            self.worker.stats.count("failed_transfers_total")
            log.warning("layerwise WRITE for %s failed: %s", layered.request.request_id, t.failure)
            info = layered.request.info
            self._drop_reader(str(info["d_engine_id"]), int(info["d_rank"]))
            return
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


def _space(staging_tokens: int) -> str:
    return f"staging pages of {staging_tokens} tokens" if staging_tokens else "its own blocks"


def _for_reader(job: _Job, d_engine: str, d_rank: int) -> bool:
    info = job.request.info
    return bool(info.get("d_engine_id") == d_engine and info.get("d_rank") == d_rank)


def _p_ids_for_figures(engine: RemoteEngine, entry: dict[str, Any]) -> list[list[int]]:
    """P's block ids, or (layerwise: P has not allocated them yet) placeholders of the same
    length: the request's figures and the check of D's ids depend only on how many."""
    if entry.get("transfer_mode") != "layerwise" or any(entry.get("remote_block_ids") or []):
        return list(entry["remote_block_ids"])
    assert engine.plan is not None
    size, tokens = engine.plan.remote_block_size, int(entry["num_tokens"])
    return [[0] if is_ssm(g) else [0] * (-(-tokens // size)) for g in engine.plan.local.model.groups]


def _blocks(entry: dict[str, Any]) -> set[int]:
    return {int(b) for ids in entry.get("local_block_ids", []) for b in ids}
