"""Pull mode, D side: READ a request's planned descriptors from each source rank.

Each P rank gets a `done` notification the moment its READ is done, so it frees the
blocks as soon as the data has left: sent from the worker's notification agent (a READ
then completes inside its post on CMA, see `notifier.py`), or, without one, attached
to the READ. A load finishes when all its READs are done; the first failure aborts
the rest and fails the request with exactly its blocks named.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import numpy as np

from kvlink.connector.loads import Load, complete_push, transfer_record
from kvlink.connector.notifs import Done, encode
from kvlink.connector.remote import RemoteEngine, conv_blocks
from kvlink.connector.sealer import Faults
from kvlink.connector.staging import LocalPages, bytes_at
from kvlink.connector.verifier import NoDigestSlots, PlannedCheck, Verifier
from kvlink.connector.worker_parts import WorkerParts
from kvlink.layout.geometry import WorkerGeometry
from kvlink.layout.spec import ModelSpec, is_ssm
from kvlink.plan.descriptors import IntArray
from kvlink.plan.request import ReadSpec
from kvlink.plan.staged import StagedRequest
from kvlink.transfer.agent import NixlAgent
from kvlink.transfer.inflight import InflightTracker
from kvlink.transfer.xfer import Transfer, TransferFailed

log = logging.getLogger("kvlink.connector")


class PullReader:
    """Built at registration; `engines` is the worker's directory of remote engines by id."""

    def __init__(self, worker: WorkerParts, agent: NixlAgent, geometry: WorkerGeometry,
                 inflight: InflightTracker, engines: Mapping[str, RemoteEngine], verifier: Verifier,
                 faults: Faults) -> None:
        self.worker = worker
        self.verifier = verifier
        self.faults = faults
        self.agent = agent
        self.geometry = geometry
        self.inflight = inflight
        self.engines = engines
        self._local_pages: LocalPages | None = None
        self._warned_unchecked: set[str] = set()

    def start(self, engine: RemoteEngine, entry: dict[str, Any]) -> bool:
        """Post a load's READs (or fail it); False while it waits for staging slots."""
        w = self.worker
        rid = entry["request_id"]
        assert engine.plan is not None
        if not self.same_incarnation(engine, entry):
            return True
        staged: StagedRequest | None = None
        try:
            if engine.staged is not None:
                staged = self.stage(engine, entry)
                if staged is None:
                    return rid in w.out.failed_recving
                specs = staged.specs
            else:
                specs = engine.plan.request_ids(entry["local_block_ids"], entry["remote_block_ids"],
                                                entry["num_tokens"], entry["local_computed_tokens"])
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            w.fail_request(rid, all_blocks(entry), f"cannot plan request: {exc}", bad_params=True)
            return True
        self.note_unchecked(engine, entry)
        # The check is planned on the verifier's helper thread while the KV READs run.
        planning = self.verifier.begin(engine, entry, specs)
        reserved: dict[int, list[int]] = {}
        if planning is not None:
            try:
                reserved = self.verifier.reserve(engine, entry, specs)
            except NoDigestSlots:
                planning.exception()  # wait for the helper to be done with the plan before the load waits
                if staged is not None:
                    assert engine.pool is not None
                    engine.pool.give(staged.slots)
                return self._wait_for_slots(entry, "free KV digest slots")
        load = w.book.start(rid, entry, all_blocks(entry), w.clock())
        posted = False
        try:
            load.conv = conv_blocks(engine, specs)
            if staged is not None:
                assert engine.pool is not None
                load.staging = (engine.pool, staged)
            posted = self._post_reads(engine, entry, load, specs, checked=planning is not None)
        finally:  # the plan is waited for and the reserved rows claimed or given back, whatever happened
            if planning is not None:
                self._checking(engine, load, planning, reserved, posted)
        if not posted:
            return True
        self.send_dones(load, engine)
        w.notify(engine, entry, "notify", only_extra=True)
        self.maybe_complete(load)
        return True

    def _post_reads(self, engine: RemoteEngine, entry: dict[str, Any], load: Load, specs: list[ReadSpec],
                    checked: bool) -> bool:
        """Post a load's KV READs, one per source rank; False when one was refused (the load
        then failed, or waits for a new handshake)."""
        w = self.worker
        for spec in specs:
            done = encode(Done(entry["remote_request_id"], engine.expected[spec.src_rank]), w.secret)
            handles = engine.handles[spec.src_rank]
            if not len(spec.local_idx):
                w.send(handles.agent_name, done, engine)
                continue
            attached = done if w.notifier is None and not checked else b""
            local_idx, remote_idx = self._read_ids(spec)
            try:
                t = self.agent.post("READ", handles.local_handle, local_idx,
                                    handles.remote_handle, remote_idx, attached, tag=load.request_id)
            except TransferFailed as exc:
                if not load.transfers and w.retry_after_handshake(
                        engine.engine_id, entry, f"READ refused ({exc.reason})"):
                    return False
                self.failed(load, engine, exc.reason)
                return False
            load.transfers.append(t)
            if not attached:
                load.dones.append((t, handles.agent_name, done))
            self.inflight.add(t)
        return True

    def _checking(self, engine: RemoteEngine, load: Load, planning: Future[PlannedCheck],
                  reserved: dict[int, list[int]], posted: bool) -> None:
        """The KV READs are posted: take the planned check into the reserved slots and read
        its digest slices (or give the slots back when the load is over already, or its
        READs were not all posted)."""
        current = posted and not load.failed and self.worker.book.get(load.request_id) is load
        try:
            planned = planning.result()
        except Exception as exc:  # a bad request the planner refused: the load must not run unchecked
            self.verifier.unreserve(engine, reserved)
            if current:
                self.abort_reads(engine, load, f"kvlink could not plan the KV check: {type(exc).__name__}: {exc}")
            return
        if not current:
            self.verifier.unreserve(engine, reserved)
            return
        load.check = self.verifier.claim(engine, planned, reserved)
        reason = self.verifier.read_slices(self.agent, self.inflight, engine, load, load.check)
        if reason is not None:
            self.failed(load, engine, reason)

    def abort_reads(self, engine: RemoteEngine, load: Load, reason: str) -> None:
        """Fail a load whose READs may still run (the peer is not at fault): P is told to
        free where its READ is done; one still running is aborted and its blocks wait for
        P's lease to end."""
        for t in load.transfers:
            if not t.finished:
                with contextlib.suppress(TransferFailed):  # a failed READ is over as well
                    self.agent.poll(t)
            if not t.finished:
                self.agent.abort(t, reason)
        self.worker.fail_request(load.request_id, load.blocks, reason)
        self.send_dones(load, engine)

    def _read_ids(self, spec: ReadSpec) -> tuple[IntArray, IntArray]:
        """A READ's descriptor ids (local, remote)."""
        local_idx, remote_idx = spec.local_idx, spec.remote_idx
        if self.faults.skip_descriptor and len(local_idx) > 1:  # test fault: a truncated transfer
            keep = np.arange(len(local_idx)) != len(local_idx) // 2
            local_idx, remote_idx = local_idx[keep], remote_idx[keep]
        return local_idx, remote_idx

    def _wait_for_slots(self, entry: dict[str, Any], what: str, advice: str = "") -> bool:
        """No free slots (staging pages, digest slots) for a load: it waits for them, up to the
        stall deadline; True once it has failed."""
        w = self.worker
        now = w.clock()
        since = entry.setdefault(f"_waiting_since {what}", now)
        if now - since <= w.config.stall_timeout_s:
            return False
        w.stats.count("stalled_transfers_total")
        w.fail_request(entry["request_id"], all_blocks(entry), (
            f"stalled: no {what} for {now - since:.1f} s (stall_timeout_s {w.config.stall_timeout_s}){advice}"),
            stalled=True)
        return True

    def send_dones(self, load: Load, engine: RemoteEngine | None) -> None:
        """Tell each P rank whose READ is done (and only those) that its blocks are free; a
        checked load tells them once its check is over (P keeps the blocks while D may read
        its digests again)."""
        if load.check is not None and not load.check.done:
            return
        still: list[tuple[Transfer | None, str, bytes]] = []
        for t, name, msg in load.dones:
            if t is None or t.state == "DONE" or load.check is not None:
                self.worker.send(name, msg, engine)
            elif t.state == "PROC":
                still.append((t, name, msg))
        load.dones = still

    def stage(self, engine: RemoteEngine, entry: dict[str, Any]) -> StagedRequest | None:
        """Staging slots and the staged request; None when the load waits for slots, or
        failed (then it is in `failed_recving`). Raises ValueError for unusable params."""
        w = self.worker
        staged, pool = engine.staged, engine.pool
        assert staged is not None and pool is not None
        num_tokens, computed = int(entry["num_tokens"]), int(entry["local_computed_tokens"])
        need = staged.slots_needed(num_tokens, computed)
        if need > pool.slots:
            remote_blocks = len(entry["remote_block_ids"][0])
            if remote_blocks * staged.read.remote_block_size < num_tokens:
                raise ValueError(f"remote block list of group 0 has {remote_blocks} blocks but "
                                 f"{num_tokens} tokens need more")
            w.fail_request(entry["request_id"], all_blocks(entry), (
                f"request needs {need} staging pages of {pool.kernel_block_size} tokens "
                f"({need * pool.slot_bytes / 2**20:.1f} MiB) but the staging area holds {pool.slots} "
                f"({w.config.staging_mib} MiB); raise staging_mib"))
            return None
        now = w.clock()
        slots = pool.take(need, now)
        if slots is None:
            self._wait_for_slots(entry, f"{need} free staging pages", "; raise staging_mib")
            return None
        try:
            request = staged.request(entry["local_block_ids"], entry["remote_block_ids"], num_tokens,
                                     computed, slots)
        except BaseException:
            pool.give(slots)
            raise
        w.stats.count("staged_loads_total")
        return request

    def same_incarnation(self, engine: RemoteEngine, entry: dict[str, Any]) -> bool:
        """P names its start in the params; blocks named by an earlier start hold nothing now.
        Checked before a pull and before asking for a push; False means the load was either
        queued again behind a fresh handshake or failed."""
        wanted, serving = entry.get("remote_incarnation"), incarnation(engine)
        if not wanted or not serving or wanted == serving:
            return True
        w = self.worker
        # Our view of P may be the stale one: look again before failing.
        if w.retry_after_handshake(engine.engine_id, entry, f"P serves incarnation {serving}, not {wanted}"):
            return False
        w.stats.count("restarted_peer_loads_total")
        w.fail_request(entry["request_id"], all_blocks(entry), (
            f"prefill engine {engine.engine_id} restarted after prefilling this request "
            f"(incarnation {wanted}, now {serving}); its KV is gone"), forbidden=True)
        return False

    def maybe_complete(self, load: Load) -> None:
        w = self.worker
        if load.failed or any(not t.finished for t in load.transfers):
            return
        if load.check is not None and not self._checked(load):
            return
        if load.pushes_expected:
            self.finish_push(load)
            return
        w.book.finish(load.request_id)
        relayout_s = self.relayout(load)
        records = [transfer_record(load.request_id, t) for t in load.transfers]
        for rec in records:
            w.stats.record(rec)
        w.out.finished_recving.add(load.request_id)
        figures = {
            "kv_bytes": float(sum(r.nbytes for r in records)),
            "kv_transfer_s": w.clock() - load.started,
            "kv_descriptors": float(sum(r.descriptors for r in records)),
        }
        if relayout_s is not None:
            figures["kv_relayout_s"] = relayout_s
        if load.check is not None:
            figures["kv_verified_bytes"] = float(load.check.hashed_bytes)
        w.out.transfer_figures[load.request_id] = figures

    def _checked(self, load: Load) -> bool:
        """Judge a load whose data and digest slices are in; True once it passed. A failed
        check fails the load (P is told to free either way)."""
        check = load.check
        assert check is not None
        if check.done:
            return True
        if check.reread_at is not None or any(not t.finished for t in check.reads):
            return False
        engine = self.engines.get(load.entry["remote_engine_id"])
        if engine is None:
            self.failed(load, None, "remote engine dropped while its KV was being checked")
            return False
        start = time.perf_counter()
        verdict = self.verifier.judge(engine, load, check)
        self.worker.stats.count("kv_verify_us_total", int((time.perf_counter() - start) * 1e6))
        if verdict == "reread":
            return False
        self._end_check(load, engine)
        if verdict is not None:
            self.rejected(load, verdict)
            return False
        return True

    def _end_check(self, load: Load, engine: RemoteEngine | None) -> None:
        """The check is over (passed, failed or given up): free its slots, let P free."""
        check = load.check
        if check is None or check.done:
            return
        check.done = True
        self.verifier.release(check.sources)
        self.send_dones(load, engine)

    def rejected(self, load: Load, reason: str) -> None:
        """The KV arrived but failed its check: the request must not run on it."""
        self.worker.fail_request(load.request_id, load.blocks, reason)

    def will_check(self, engine: RemoteEngine, entry: dict[str, Any]) -> bool:
        """Whether a push from `engine` will be checked: then its sources keep the blocks and
        their digests until our `done` (an idle P would neither serve the digest READ nor keep
        the digest rows of blocks it reused)."""
        return self.verifier.applies(engine) and bool(entry.get("token_ids")) and engine.plan is not None

    def note_unchecked(self, engine: RemoteEngine, entry: dict[str, Any]) -> None:
        """Count a load that goes unchecked although this D checks (its P keeps no digests:
        `--verify-kv off` there), and say so once per P engine."""
        if self.verifier.mode == "off" or self.verifier.applies(engine) or not entry.get("token_ids"):
            return
        self.worker.stats.count("kv_unchecked_loads_total")
        if engine.engine_id not in self._warned_unchecked:
            self._warned_unchecked.add(engine.engine_id)
            log.warning("loads from %s go unchecked: this D checks KV (--verify-kv %s) but that P "
                        "keeps no digests (it runs with verification off)", engine.engine_id, self.verifier.mode)

    def check_pushed(self, load: Load) -> None:
        """Push mode: every source wrote; read their digest slices, then judge the load."""
        engine = self.engines.get(load.entry["remote_engine_id"])
        if engine is None or not self.will_check(engine, load.entry):
            if engine is not None:
                self.note_unchecked(engine, load.entry)
            self.finish_push(load)
            return
        assert engine.plan is not None
        load.dones = [(None, name, encode(Done(load.entry["remote_request_id"], engine.expected[rank]),
                                          self.worker.secret))
                      for rank, name in engine.notify_agents(engine.plan.mapping.source_ranks)]
        try:
            load.check = self.verifier.prepare(engine, load.entry, load.push_specs)
        except NoDigestSlots:  # never unchecked when a check was promised: fail, P frees
            self.send_dones(load, engine)
            self.rejected(load, "no free KV digest slots to check the pushed KV")
            return
        if load.check is None:
            self.finish_push(load)
            self.send_dones(load, engine)
            return
        load.check.reread_at = self.worker.clock()
        self.recheck(self.worker.clock())

    def recheck(self, now: float) -> None:
        """Post the digest re-reads whose time has come."""
        for load in list(self.worker.book.loads.values()):
            check = load.check
            if check is None or check.done or load.failed or check.reread_at is None or check.reread_at > now:
                continue
            engine = self.engines.get(load.entry["remote_engine_id"])
            reason = "remote engine dropped while its KV was being checked" if engine is None else \
                self.verifier.reread(self.agent, self.inflight, engine, load, check)
            if reason is not None:
                self.failed(load, engine, reason)
            else:
                self.maybe_complete(load)

    def finish_push(self, load: Load) -> None:
        """Every source pushed and the check, if any, passed: a staged (layerwise) load is
        re-laid out from its staging pages into ours, then the request may run."""
        relayout_s = self.relayout(load)
        complete_push(self.worker.book, self.worker.out, load, self.worker.clock())
        if relayout_s is not None:
            self.worker.out.transfer_figures[load.request_id]["kv_relayout_s"] = relayout_s

    def relayout(self, load: Load) -> float | None:
        """Re-lay out a finished load into our own layout: a staged load's tokens from its
        staging slots into our pages (the slots go back), state blocks that arrived in the
        source's SSM conv layout into ours. Seconds taken; None when there was nothing to do."""
        start = time.perf_counter()
        if load.staging is None:
            return time.perf_counter() - start if self._relayout_conv(load) else None
        pool, staged = load.staging
        load.staging = None
        w = self.worker
        try:
            if any(r.size for r in staged.runs):
                g = self.geometry
                pool.relayout(self.local_pages(), g.kernel_block_size, g.page_order, g.model.head_dim,
                              staged.runs)
            for src, dst, nbytes in staged.states:  # a hybrid's state pages, whole, into our state blocks
                bytes_at(dst, nbytes)[:] = bytes_at(src, nbytes)
        finally:
            pool.give(staged.slots)
        self._relayout_conv(load)  # a state that came in the source's conv layout, now in our blocks
        elapsed = time.perf_counter() - start
        w.stats.count("relayout_bytes_total", staged.relayout_bytes)
        return elapsed

    def _relayout_conv(self, load: Load) -> bool:
        if load.conv is None:
            return False
        transpose, blocks = load.conv
        load.conv = None
        moved = transpose.apply(blocks, bytes_at)
        self.worker.stats.count("conv_relayout_bytes_total", moved)
        return True

    def local_pages(self) -> LocalPages:
        """Our attention pages as arrays, built at the first staged read."""
        if self._local_pages is None:
            self._local_pages = LocalPages(self.geometry)
        return self._local_pages

    def failed(self, load: Load, engine: RemoteEngine | None, reason: str) -> None:
        w = self.worker
        if load.failed:
            return
        # The tracker's reason reaches us wrapped by NixlAgent.abort ("READ with X failed: stalled: ...").
        stalled = reason.startswith("stalled") or " failed: stalled: " in reason
        w.stats.count("stalled_transfers_total" if stalled else "failed_transfers_total")
        for t in load.transfers + (load.check.reads if load.check is not None else []):
            if not t.finished:
                self.agent.abort(t, reason)
        self._end_check(load, engine)
        if engine is not None and not stalled:
            w.drop_engine(engine.engine_id)
        if stalled:
            # A frozen peer over TCP may still deliver the READ later: keep the blocks out of use.
            w.out.quarantine_s[load.request_id] = w.config.quarantine_s
        w.fail_request(load.request_id, load.blocks, reason, stalled=stalled)

    def on_polled(self, t: Transfer, failed: bool) -> bool:
        """Handle one finished READ of ours (KV or digests); False if it is not one."""
        w = self.worker
        digests = isinstance(t.tag, tuple) and t.tag[0] == "verify"
        load = w.book.get(str(t.tag[1] if digests else t.tag))  # type: ignore[index]
        if load is None or (load.pushes_expected and not digests):
            return digests
        engine = self.engines.get(load.entry["remote_engine_id"])
        if failed:
            self.failed(load, engine, t.failure or "transfer failed")
        else:
            self.send_dones(load, engine)
            self.maybe_complete(load)
        return True


def incarnation(engine: RemoteEngine) -> str | None:
    """The start of the remote engine we handshaked with (agent names end with it)."""
    names = set(engine.agents.values())
    return names.pop().rsplit("-", 1)[-1] if names else None


def local_tail(entry: dict[str, Any], model: ModelSpec, block_size: int) -> dict[str, Any]:
    """The scheduler side hands over the whole block table (prefix hits first); the planner
    wants each attention group's blocks from token `local_computed_tokens` on. SSM groups
    keep their list: the state lives in its last block."""
    skip = int(entry.get("local_computed_tokens", 0)) // block_size
    if skip <= 0 or "local_block_ids" not in entry:
        return entry
    tail = [list(ids) if is_ssm(group) else list(ids)[skip:]
            for group, ids in zip(model.groups, entry["local_block_ids"], strict=False)]
    return {**entry, "local_block_ids": tail}


def all_blocks(entry: dict[str, Any]) -> set[int]:
    return {int(b) for ids in entry.get("local_block_ids", []) for b in ids}
