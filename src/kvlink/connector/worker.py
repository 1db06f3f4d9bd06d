"""Worker side of the NIXL connector: one per TP rank; registers memory and moves bytes.

D (pull): handshake once per P engine, then READ exactly the planned descriptors and
send each P rank its `done` notification once its READ is done (from a second agent,
`notifier.py`, or attached to the READ). P: hold finished requests
under leases until every consumer rank has notified, or the lease runs out.
Push mode lives in `push.py`. Every wait has a deadline; failures name the blocks.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from kvlink.connector.api import ConnectorWorker, LoadFailure, StepMetadata, WorkerOutput
from kvlink.connector.cancels import cancel_load
from kvlink.connector.config import ConnectorConfig
from kvlink.connector.digest_table import DigestSlotPools, DigestTable
from kvlink.connector.directory import EngineDirectory
from kvlink.connector.inbox import drain_notifications
from kvlink.connector.integrity import AddressSpace
from kvlink.connector.lease import LeaseTable
from kvlink.connector.loads import Load, LoadBook
from kvlink.connector.notifier import Notifier
from kvlink.connector.notifs import (
    Done,
    encode,
    encode_heartbeats,
)
from kvlink.connector.pull import PullReader, all_blocks, local_tail
from kvlink.connector.push import PushWriter
from kvlink.connector.remote import RemoteEngine, encode_geometry
from kvlink.connector.sealer import Faults, Sealer
from kvlink.connector.staging import StagingPool
from kvlink.connector.stats import ConnectorStats
from kvlink.connector.verifier import Verifier
from kvlink.layout.geometry import WorkerGeometry, build_worker_geometry, check_worker_sizes
from kvlink.layout.limits import MAX_PORT
from kvlink.layout.spec import ModelSpec
from kvlink.transfer.agent import MemType, NixlAgent, check_mem_type
from kvlink.transfer.agent_config import AgentConfig
from kvlink.transfer.framing import resolve_secret
from kvlink.transfer.inflight import InflightTracker
from kvlink.transfer.side_channel import HandshakeServer
from kvlink.transfer.wire import PROTOCOL_VERSION, HandshakePayload
from kvlink.transfer.xfer import TransferFailed

log = logging.getLogger("kvlink.connector")
DIGEST_SLOTS = 8192  # rows of digest slices per source layout: a load takes one per block


class NixlWorker(ConnectorWorker):
    def __init__(
        self, config: ConnectorConfig, model: ModelSpec, tp_size: int, tp_rank: int,
        block_size: int, kernel_block_size: int, num_blocks: int,
        agent_config: AgentConfig | None = None, clock: Callable[[], float] = time.monotonic,
        page_order: str = "token_major", ssm_page_stride: int | None = None, aliased: bool = False,
        mem_type: MemType = "DRAM",
    ) -> None:
        check_worker_sizes(tp_size, tp_rank, block_size, kernel_block_size, num_blocks)
        if check_mem_type(mem_type) != "DRAM" and (config.verify_kv != "off" or page_order != "token_major"):
            # digest tables and staging pages are host memory, hashed and re-laid out through
            # host pointers, and one NIXL list holds one memory kind
            raise ValueError(f"KV in {mem_type} memory needs verify_kv 'off' (got {config.verify_kv!r}) and "
                             f"the token_major page order (got {page_order!r})")
        if config.side_channel_port and config.side_channel_port + tp_rank > MAX_PORT:
            raise ValueError(f"side_channel_port {config.side_channel_port} + tp_rank {tp_rank} is past "
                             f"port {MAX_PORT}; use a base port of at most {MAX_PORT - tp_size + 1}")
        self.config = config
        self.model = model
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.block_size, self.kernel_block_size, self.num_blocks = block_size, kernel_block_size, num_blocks
        self._agent_config = agent_config
        self.page_order = page_order  # element order inside a page (kvlink.layout.page_order)
        self.ssm_page_stride, self.aliased = ssm_page_stride, aliased  # see WorkerGeometry
        self.mem_type = mem_type  # NIXL memory kind of the KV caches (DRAM, or VRAM for GPU tensors)
        self.clock = clock
        self.secret = resolve_secret(config.secret)  # same secret as the side channel: authenticates notifications
        self.stats = ConnectorStats()
        self.leases = LeaseTable(config.lease_s, config.lease_extension_s)
        self.directory = EngineDirectory(config, self.stats)
        self.handshakes = self.directory.handshakes
        self.engines = self.directory.engines
        self.book = LoadBook()
        self._waiting: list[tuple[str, dict[str, Any]]] = []
        self.out = WorkerOutput()
        self.geometry: WorkerGeometry | None = None
        self.agent: NixlAgent | None = None
        self.server: HandshakeServer | None = None
        self.inflight: InflightTracker | None = None
        self.pull: PullReader | None = None
        self.push: PushWriter | None = None
        self._staging: dict[int, StagingPool] = {}
        self.notifier: Notifier | None = None
        self.faults = Faults.from_env()
        self.sealer: Sealer | None = None
        self.digest_slots: DigestSlotPools | None = None
        self.memory = AddressSpace([])

    # ---- registration -------------------------------------------------------------------
    def register_kv_caches(self, base_addrs: Sequence[int], nbytes: Sequence[int]) -> None:
        geometry = build_worker_geometry(
            self.model, self.tp_size, self.tp_rank, self.block_size, self.kernel_block_size,
            self.num_blocks, base_addrs,
            page_order=self.page_order, ssm_page_stride=self.ssm_page_stride, aliased=self.aliased)
        for region, n in zip(geometry.regions, nbytes, strict=True):
            if region.page_stride * region.num_pages != n:
                raise ValueError(f"layer {region.layer}: tensor has {n} bytes, layout expects "
                                 f"{region.page_stride * region.num_pages}; allocate with kv_tensor_specs")
        name = f"{self.config.engine_id}-r{self.tp_rank}-{self.config.incarnation or uuid.uuid4().hex[:8]}"
        agent = NixlAgent(name, self._agent_config, mem_type=self.mem_type)
        areas = [(r.base, r.page_stride * r.num_pages) for r in geometry.regions]
        agent.register_regions(areas)
        self.memory = AddressSpace(areas)
        table = DigestTable(geometry, agent) if self.config.verify_kv != "off" else None
        if table is not None:
            self.sealer = Sealer(table, self.memory, self.stats, self.faults)
            self.digest_slots = DigestSlotPools(agent, geometry.device_id, DIGEST_SLOTS)
        port = self.config.side_channel_port + self.tp_rank if self.config.side_channel_port else 0
        try:
            server = HandshakeServer(self.config.engine_id, host=self.config.side_channel_host,
                                     port=port, secret=self.config.secret)
        except OSError as exc:  # name kvlink's setting: the engine's own port is the first guess
            raise OSError(exc.errno, f"kvlink's side channel (side_channel_host "
                                     f"{self.config.side_channel_host!r}, side_channel_port "
                                     f"{self.config.side_channel_port} + TP rank {self.tp_rank} = port {port}) "
                                     f"cannot listen: {exc.strerror or exc}") from exc
        self._payload = HandshakePayload(
            version=PROTOCOL_VERSION, engine_id=self.config.engine_id, tp_rank=self.tp_rank,
            tp_size=self.tp_size, compat_hash=self.model.compat_hash(), agent_name=name,
            agent_metadata=agent.metadata(), geometry=encode_geometry(geometry), sent_time=time.time(),
            digest_table=table.base if table is not None else 0)
        server.set_payload(self.tp_rank, self._payload)
        self.geometry, self.agent, self.server = geometry, agent, server
        if self.config.separate_notifier:
            self.notifier = Notifier(f"{name}-n", self._agent_config)
            self.directory.on_release = self._forget_notified
            self.directory.on_connect = self._prepare_notifier
        self.inflight = InflightTracker(agent, self.config.stall_timeout_s)
        verifier = Verifier(self.config.verify_kv, self.config.verify_sample_units, self.stats, self.memory,
                            self.clock, self.config.stall_timeout_s, seed=self.tp_rank)
        self.pull = PullReader(self, agent, geometry, self.inflight, self.engines, verifier, self.faults)
        self.push = PushWriter(self, agent, geometry, self.inflight, int(server.port) - self.tp_rank)
        self.push.on_all_pushed, self.push.will_check = self.pull.check_pushed, self.pull.will_check
        self.push.stage = self.pull.stage
        self.push.take_requests = self._take_push_requests
        log.info("kvlink worker %s rank %d/%d: %d regions, %.1f MiB, side channel %s:%d",
                 self.config.engine_id, self.tp_rank, self.tp_size, len(geometry.regions),
                 sum(nbytes) / 2**20, server.host, server.port)

    @property
    def side_channel_port(self) -> int:
        assert self.server is not None, "register_kv_caches first"
        return int(self.server.port)

    # ---- per step -----------------------------------------------------------------------
    def start_load_kv(self, metadata: StepMetadata) -> None:
        now = self.clock()
        for save in metadata.saves:
            self.leases.hold(save["request_id"], now)
            assert self.push is not None
            self.push.remember_blocks(save["request_id"], save["block_ids"])
            if self.sealer is not None and self.sealer.seal(save):  # test fault: free at once
                self.leases.release(save["request_id"])
                self.out.finished_sending.add(save["request_id"])
        for stream in metadata.streams:
            assert self.push is not None
            self.push.open_stream(stream)
        for rid in metadata.frees:
            if self.leases.release(rid):  # a held request let go early: its blocks go back now
                self.out.finished_sending.add(rid)
                if self.push is not None:
                    self.push.forget_blocks(rid)
            if self.push is not None:
                self.push.end_stream(rid)
        self._waiting += [("load", local_tail(e, self.model, self.block_size)) for e in metadata.loads]
        self._waiting += [("notify", e) for e in metadata.notify_only]
        self._waiting += [("heartbeat", e) for e in metadata.heartbeats if self.directory.known(e)]
        self._advance()
        for rid in metadata.cancels:
            self._cancel(rid)
        if self.push is not None and self.push.waiting_for_d():
            # Layerwise: a push request that came in since the last poll must be attached
            # before this step's forward, or that forward's layers leave only at its end.
            self._take_push_requests()

    def _cancel(self, rid: str) -> None:
        """D: `rid` ended while its push or layerwise load was in flight (kvlink.connector.cancels)."""
        if cancel_load(self, rid, self.tp_rank):
            return
        waiting = [(kind, e) for kind, e in self._waiting if kind == "load" and e["request_id"] == rid]
        if waiting:  # not started (a handshake first): nothing was asked of P, nothing written
            self._waiting = [w for w in self._waiting if w not in waiting]
            self.fail_request(rid, all_blocks(waiting[0][1]), "cancelled before its load started")

    def _take_push_requests(self) -> None:
        if self.agent is None or self.push is None:
            return
        now = self.clock()
        drain_notifications(self.agent, self.secret, self.stats, self.leases, self.push, now)
        self.push.poll(now)

    def seal_now(self, seals: Sequence[dict[str, Any]]) -> None:
        """P: seal requests whose prefill the forward that just ran completed (vLLM calls
        this after the forward; their saves come one step later)."""
        if self.sealer is not None:
            for entry in seals:
                self.sealer.seal_early(entry)

    def _advance(self) -> None:
        """Finish handshakes, then run every waiting entry whose engine is ready."""
        assert self.agent is not None and self.geometry is not None and self.pull is not None
        self.directory.collect(self.agent, self.geometry, self._fail_waiting, self.staging_for,
                               self.digest_slots)
        still: list[tuple[str, dict[str, Any]]] = []
        for kind, entry in self._waiting:
            try:
                if not self._run(kind, entry):
                    still.append((kind, entry))
            except Exception as exc:  # one entry's failure must not take the engine down
                log.exception("request %s: %s could not start", entry.get("request_id"), kind)
                self._give_up(kind, entry, f"kvlink could not start this {kind}: {type(exc).__name__}: {exc}",
                              False)
        self._waiting = still

    def _run(self, kind: str, entry: dict[str, Any]) -> bool:
        """Run one waiting entry; False while it must wait (its engine not ready, no slots)."""
        assert self.pull is not None and self.geometry is not None
        try:
            engine = self.directory.lookup(entry, self.geometry)
        except ValueError as exc:  # the params name a P whose TP size cannot hold this model
            self._give_up(kind, entry, f"kvlink cannot read from this prefill engine: {exc}", True)
            return True
        if engine is None:
            return False
        engine.last_used = self.clock()
        mode = entry.get("transfer_mode")
        if kind == "load" and (mode == "layerwise" or (mode == "push" and engine.staged is None)):
            # Layerwise between kernel block sizes of a staged page order: P writes whole P
            # pages into our staging pages as it prefills; we re-lay them out once it pushed.
            assert self.push is not None
            if self.pull.same_incarnation(engine, entry):
                return self.push.request_push(engine, entry)
        elif kind == "load":
            if entry.get("transfer_mode") == "push":
                # P's WRITE cannot re-layout pages between kernel block sizes: D reads
                # through its staging pages instead (P frees on the same notification).
                self.stats.count("push_as_staged_pull_total")
                entry = {**entry, "transfer_mode": "pull"}
            return bool(self.pull.start(engine, entry))
        else:
            self.notify(engine, entry, kind)
        return True

    def _fail_waiting(self, engine_id: str, reason: str, bad_params: bool) -> None:
        keep = []
        for kind, entry in self._waiting:
            if entry["remote_engine_id"] == engine_id:
                self._give_up(kind, entry, reason, bad_params)
            else:
                keep.append((kind, entry))
        self._waiting = keep

    def _give_up(self, kind: str, entry: dict[str, Any], reason: str, bad_params: bool) -> None:
        if kind == "load":
            self.fail_request(entry["request_id"], all_blocks(entry), reason, bad_params=bad_params)
        else:
            self.stats.count("failed_notifications_total")

    def fail_request(self, rid: str, blocks: set[int], reason: str, bad_params: bool = False,
                     forbidden: bool = False, stalled: bool = False) -> None:
        """Report a load as failed with exactly `blocks` invalid (never silently dropped)."""
        load = self.book.get(rid)
        if load is not None:
            load.failed = True
            self.book.finish(rid)
            if load.check is not None and self.pull is not None:
                self.pull.verifier.release(load.check.sources)
            # P may still be writing into the staging pages of a push it has not finished
            writing = len(load.pushes_seen) < load.pushes_expected
            self.drop_staging(load, quarantine=stalled or writing or any(not t.finished for t in load.transfers))
        log.warning("request %s failed to load (%d blocks invalid): %s", rid, len(blocks), reason)
        self.out.failed_recving.add(rid)
        self.out.load_failures.setdefault(rid, LoadFailure(reason, bad_params, forbidden, stalled))
        self.out.invalid_block_ids |= blocks

    def retry_after_handshake(self, engine_id: str, entry: dict[str, Any], why: str) -> bool:
        """Once per load: forget what we know of a remote engine (it may have restarted behind
        stale metadata) and run this load again after a new handshake. False if the load
        already had its retry: the caller fails it."""
        if entry.get("_retried"):
            return False
        log.warning("load %s: %s; re-handshaking with %s once", entry["request_id"], why, engine_id)
        load = self.book.get(entry["request_id"])
        if load is not None:
            self.drop_staging(load, quarantine=False)
        self.book.finish(entry["request_id"])
        self.drop_engine(engine_id)
        self._waiting.append(("load", {**entry, "_retried": True}))
        return True

    def drop_engine(self, engine_id: str) -> None:
        self.directory.drop(self.agent, engine_id)

    # ---- staged reads (different kernel block sizes, kvlink.plan.staged) ---------------
    def staging_for(self, remote_kernel_block_size: int) -> StagingPool:
        """This worker's staging pool for P pages of `remote_kernel_block_size` tokens."""
        pool = self._staging.get(remote_kernel_block_size)
        if pool is None:
            assert self.agent is not None and self.geometry is not None
            pool = StagingPool(self.geometry, remote_kernel_block_size, self.config.staging_mib << 20,
                               self.agent)
            self._staging[remote_kernel_block_size] = pool
            self.memory.add(pool.base, pool.data)
            self._publish_staging()
            log.info("kvlink worker %s rank %d: %d staging pages of %d tokens (%.1f MiB) for P pages "
                     "of another kernel block size", self.config.engine_id, self.tp_rank, pool.slots,
                     remote_kernel_block_size, pool.capacity_bytes / 2**20)
        return pool

    def _publish_staging(self) -> None:
        """Offer our staging areas to writers (a layerwise P of another kernel block size
        WRITEs whole pages into them): their places, and agent metadata that now covers them.
        A P handshakes with us for a push only after our push request, so after this."""
        assert self.server is not None and self.agent is not None
        areas = tuple((k, pool.slots, tuple(r.base for r in pool.geometry.regions))
                      for k, pool in sorted(self._staging.items()))
        self._payload = msgspec.structs.replace(self._payload, agent_metadata=self.agent.metadata(),
                                                staging=areas)
        self.server.set_payload(self.tp_rank, self._payload)

    def drop_staging(self, load: Load, quarantine: bool) -> None:
        """Give a failed or requeued load's staging slots back (after the quarantine time when a
        READ into them may still land)."""
        if load.staging is None:
            return
        pool, staged = load.staging
        load.staging = None
        if quarantine:
            pool.quarantine(staged.slots, self.clock() + self.config.quarantine_s)
        else:
            pool.give(staged.slots)

    # ---- notifications ------------------------------------------------------------------
    def notify(self, engine: RemoteEngine, entry: dict[str, Any], kind: str, only_extra: bool = False) -> None:
        assert engine.plan is not None
        mapping = engine.plan.mapping  # computed once at handshake
        if kind == "heartbeat":
            beats = encode_heartbeats(entry["remote_request_ids"], self.secret)
            for _rank, name in engine.notify_agents(mapping.notify_ranks):
                for msg in beats:
                    self.send(name, msg, engine)
            return
        targets = mapping.notify_only_ranks if only_extra else mapping.notify_ranks
        if not only_extra:
            self.stats.count("notify_only_total")
        for rank, name in engine.notify_agents(targets):
            self.send(name, encode(Done(entry["remote_request_id"], engine.expected[rank]), self.secret), engine)

    def send(self, agent_name: str, msg: bytes, engine: RemoteEngine | None = None) -> None:
        """Notify one remote agent; a failure is counted and logged."""
        try:
            self.send_or_raise(agent_name, msg, engine)
        except TransferFailed as exc:
            self.stats.count("failed_notifications_total")
            log.warning("notification to %s failed: %s", agent_name, exc.reason)

    def send_or_raise(self, agent_name: str, msg: bytes, engine: RemoteEngine | None = None) -> None:
        """Notify one remote agent: from the notifier when it knows the agent's metadata
        (engines we read from or ask to push), else from the data agent. Raises
        TransferFailed."""
        assert self.agent is not None
        metadata = engine.metadata.get(agent_name) if engine is not None else None
        if self.notifier is not None and metadata is not None:
            try:
                self.notifier.send(agent_name, metadata, msg)
                return
            except TransferFailed:
                raise
            except Exception as exc:  # the notifier cannot load the peer (bad metadata, NIXL refusal)
                log.error("notification agent unusable (%s); notifying from the data agent", exc)
                self.notifier.close()
                self.notifier = None
        self.agent.send_notif(agent_name, msg)

    def _prepare_notifier(self, engine: RemoteEngine) -> None:
        if self.notifier is None:
            return
        ranks = engine.plan.mapping.notify_ranks if engine.plan is not None else ()
        try:
            for _, name in engine.notify_agents(ranks):
                self.notifier.prepare(name, engine.metadata[name])
        except Exception as exc:  # a failed wire-up shows again at the first send
            log.warning("notification agent: wire-up with engine %s not started: %s", engine.engine_id, exc)

    def _forget_notified(self, engine: RemoteEngine) -> None:
        if self.notifier is not None:
            self.notifier.forget(set(engine.metadata))

    # ---- polling ------------------------------------------------------------------------
    def get_finished(self) -> WorkerOutput:
        if self.agent is None or self.inflight is None or self.pull is None or self.push is None:
            return WorkerOutput()
        now = self.clock()
        drain_notifications(self.agent, self.secret, self.stats, self.leases, self.push, now)
        if self.notifier is not None:
            self.notifier.progress()
        self._advance()
        self.pull.recheck(now)
        result = self.inflight.poll_all(now)
        for t in result.failed:
            if not self.pull.on_polled(t, failed=True):
                self.push.on_transfer_failed(t)
        for t in result.done:
            if not self.pull.on_polled(t, failed=False):
                self.push.on_transfer_done(t, now)
        self.push.poll(now)
        done, expired = self.leases.collect(now)
        self.stats.counters["expired_leases_total"] = self.leases.expired_total
        for rid in expired:
            log.warning("lease of request %s expired before every consumer read it; freeing", rid)
        for rid in done | expired:
            self.push.forget_blocks(rid)
        self.out.finished_sending |= done | expired
        busy = {load.entry["remote_engine_id"] for load in self.book.loads.values()}
        busy |= {entry["remote_engine_id"] for _, entry in self._waiting}
        self.directory.evict_idle(self.agent, busy, now)
        out, self.out = self.out, WorkerOutput()
        return out

    def progress(self) -> None:
        """Let NIXL progress between engine steps (e.g. between the layers of a forward pass),
        so that a peer reading from us does not wait for the step to end."""
        if self.agent is not None:
            self.agent.progress()
        if self.notifier is not None:
            self.notifier.progress()
        if self.inflight is not None:
            self.inflight.advance()

    def has_inflight(self) -> bool:
        return bool(self.book.loads or self._waiting or self.leases.leases)

    def layer_sink(self) -> Callable[..., None] | None:
        return self.push.save_kv_layer if self.push is not None else None

    def get_stats(self) -> dict[str, Any]:
        # What P holds for decoders right now (vLLM's own scheduler metrics do not show it).
        held = self.push.held_blocks if self.push is not None else {}
        self.stats.gauges["pending_sends"] = float(len(self.leases.leases))
        self.stats.gauges["pending_send_blocks"] = float(sum(
            len(ids) for rid, groups in held.items() if rid in self.leases.leases for ids in groups))
        self.stats.gauges["loads_in_flight"] = float(len(self.book.loads))
        if self.server is not None:  # what our side channel refused (bad frames, wrong secret, ...)
            listener = self.server.stats
            self.stats.counters["rejected_handshakes_total"] = listener.rejected
            self.stats.counters["unauthenticated_handshakes_total"] = listener.unauthenticated
        return self.stats.take()

    def debug_state(self) -> dict[str, Any]:
        return {
            "leases": len(self.leases.leases),
            "loads_in_flight": len(self.book.loads),
            "open_transfers": len(self.inflight) if self.inflight is not None else 0,
            "waiting_for_handshake": len(self._waiting),
            "remote_engines": sorted(self.engines),
        }

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.inflight is not None:
            self.inflight.abort_all("shutdown")
        if self.pull is not None:
            self.pull.verifier.close()
        self.directory.shutdown(self.agent)
        if self.notifier is not None:
            self.notifier.close()
            self.notifier = None
        if self.agent is not None:
            if self.push is not None:
                self.push.shutdown()
            self.agent.close()
            self.agent = None
