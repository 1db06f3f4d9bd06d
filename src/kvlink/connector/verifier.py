"""D side of KV integrity: which digests a load reads, and the verdict before it may run.

A pulled load reads P's digest slices of its blocks right after its KV READ; a pushed
one reads them once P says `pushed`. Then the reader hashes its own copies
(`kvlink.connector.integrity.check`): a slice whose seed is not this request's tokens was
not sealed yet (P seals at its next step, or inside vLLM right after the prefill) or was sealed for other tokens (P reused the
block): it is read again, a few milliseconds apart, until the stall deadline; a unit whose
digest differs fails the load at once, naming the request, the pages and both digests.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlink.connector.checks import LoadCheck, SourceCheck
from kvlink.connector.integrity import AddressSpace, CheckResult, UnitViews, check, unit_views
from kvlink.connector.loads import Load
from kvlink.connector.remote import RemoteEngine
from kvlink.connector.stats import ConnectorStats
from kvlink.layout.digests import block_seeds
from kvlink.plan.descriptors import IntArray
from kvlink.plan.request import ReadSpec, first_token_to_ship
from kvlink.plan.verify import VerifySpec, verify_spec
from kvlink.transfer.agent import NixlAgent
from kvlink.transfer.inflight import InflightTracker
from kvlink.transfer.xfer import TransferFailed

log = logging.getLogger("kvlink.connector.verify")
REREAD_S = 0.002


def helper_can_run_apart() -> bool:
    """Whether a thread started here may run on another core than this one (threads inherit
    the CPU set of the thread that starts them)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    return getaffinity is None or len(getaffinity(0)) > 1


class NoDigestSlots(Exception):
    """Every digest slot of the engine is held by other loads; the load waits."""


def _slots(spec: VerifySpec, rows: list[int]) -> tuple[int, list[int]]:
    """How many of `rows` a spec's slices need (one per slice of its most listed group),
    and the row of each slice: the k-th slice of a group takes the k-th row."""
    seen: dict[int, int] = {}
    out = []
    for group in spec.slice_group.tolist():
        k = seen.get(group, 0)
        out.append(rows[k])
        seen[group] = k + 1
    return max(seen.values(), default=0), out


@dataclass(frozen=True)
class PlannedCheck:
    """What a load will check, before any slot is taken: per source rank, its spec and the
    bytes of its units."""

    specs: list[VerifySpec]
    views: list[UnitViews]
    seeds: npt.NDArray[np.uint64]
    unverifiable: int


class Verifier:
    """Builds, posts and judges the checks of one reader worker's loads.

    Planning a check (which units to hash, where they land, the views of their bytes) runs on one helper
    thread, so a pulled load plans its check while its READ runs: on CMA the copy runs inside
    NIXL's `transfer()`, which lets go of the GIL. Where this thread is bound to one core the
    plan runs on it instead. Slots are taken and digests posted on the
    worker's thread, which owns the NIXL agent.
    """

    def __init__(self, mode: str, sample_units: int, stats: ConnectorStats, memory: AddressSpace,
                 clock: Callable[[], float], deadline_s: float, seed: int = 0) -> None:
        self.mode = mode
        self.sample_units = sample_units
        self.stats = stats
        self.memory = memory
        self.clock = clock
        self.deadline_s = deadline_s
        # never drawn from by two threads at once: a pulled load has its plan before `start` returns
        self.rng = np.random.default_rng(seed)
        self._helper: ThreadPoolExecutor | None = None
        self._apart: bool | None = None  # whether a helper may run on another core (asked once)

    def applies(self, engine: RemoteEngine) -> bool:
        return self.mode != "off" and bool(engine.digest_slots)

    def checks(self, engine: RemoteEngine, entry: dict[str, Any]) -> bool:
        """Whether a load of `entry` from `engine` is checked."""
        return self.applies(engine) and bool(entry.get("token_ids")) and engine.plan is not None

    def begin(self, engine: RemoteEngine, entry: dict[str, Any], specs: list[ReadSpec]
              ) -> Future[PlannedCheck] | None:
        """Plan a load's check on the helper thread; None when nothing applies."""
        if not self.checks(engine, entry):
            return None
        if self._apart is None:
            self._apart = helper_can_run_apart()
        if self._helper is None and self._apart:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="kvlink-verify")
        if self._helper is not None:
            return self._helper.submit(self.plan, engine, entry, specs)
        # One core (a vLLM worker bound to its core): a helper could only take turns with
        # the copy, so the plan runs here, before the READ.
        planned: Future[PlannedCheck] = Future()
        try:
            planned.set_result(self.plan(engine, entry, specs))
        except Exception as exc:
            planned.set_exception(exc)
        return planned

    def plan(self, engine: RemoteEngine, entry: dict[str, Any], specs: list[ReadSpec]) -> PlannedCheck:
        """The units and slices a load checks, per source rank (pure; no slot taken)."""
        num_tokens, computed = int(entry["num_tokens"]), int(entry.get("local_computed_tokens", 0))
        plan = engine.plan
        assert plan is not None
        first_tokens = [first_token_to_ship(plan, g, num_tokens, computed) for g in range(len(plan.local.model.groups))]
        sample = (self.rng, self.sample_units) if self.mode == "sample" else None
        vspecs = []
        for spec in specs:
            if not len(spec.local_idx):
                continue
            source = plan.source(spec.src_rank)
            vspecs.append(verify_spec(spec.src_rank, engine.digest_geometries[spec.src_rank], source.local_descs,
                                      source.remote_descs, spec.local_idx, spec.remote_idx,
                                      entry["remote_block_ids"], num_tokens, first_tokens, sample))
        geometry = next(iter(engine.geometries.values()))
        seeds = np.array(block_seeds(entry["token_ids"], geometry.block_size, num_tokens), dtype=np.uint64)
        views = [unit_views(v, self.memory) for v in vspecs]  # looked up here, not after the READ
        return PlannedCheck(vspecs, views, seeds, sum(v.unverifiable for v in vspecs))

    def reserve(self, engine: RemoteEngine, entry: dict[str, Any], specs: list[ReadSpec]) -> dict[int, list[int]]:
        """Slot rows for a load whose check is still being planned: as many per source rank
        as the request has blocks in its longest group (a spec never needs more). Raises
        NoDigestSlots (nothing taken) when they are not free."""
        need = max((len(ids) for ids in entry["remote_block_ids"]), default=0)
        taken: dict[int, list[int]] = {}
        for spec in specs:
            if not len(spec.local_idx):
                continue
            rows = engine.digest_slots[spec.src_rank].take(need)
            if rows is None:
                self.unreserve(engine, taken)
                raise NoDigestSlots(f"no free digest slots for {entry['request_id']}")
            taken[spec.src_rank] = rows
        return taken

    def claim(self, engine: RemoteEngine, planned: PlannedCheck, reserved: dict[int, list[int]]) -> LoadCheck:
        """The check of a planned load, in the rows reserved for it (the rows it does not
        need go back)."""
        sources = []
        for vspec, views in zip(planned.specs, planned.views, strict=True):
            rows = reserved.pop(vspec.src_rank)
            pool = engine.digest_slots[vspec.src_rank]
            need, slots = _slots(vspec, rows)
            if need < len(rows):
                pool.give(rows[need:])
            sources.append(SourceCheck(vspec.src_rank, vspec, pool, slots, views))
        self.unreserve(engine, reserved)  # a source with nothing to check
        if planned.unverifiable:
            self.stats.count("kv_unverifiable_units_total", planned.unverifiable)
        return LoadCheck(sources, planned.seeds, self.clock() + self.deadline_s)

    def unreserve(self, engine: RemoteEngine, reserved: dict[int, list[int]]) -> None:
        """Give back slot rows reserved and not claimed."""
        for rank, rows in reserved.items():
            engine.digest_slots[rank].give(rows)
        reserved.clear()

    def prepare(self, engine: RemoteEngine, entry: dict[str, Any], specs: list[ReadSpec]) -> LoadCheck | None:
        """The check of a load, planned on this thread and its slots taken, at once; None
        when nothing applies. Raises NoDigestSlots (nothing taken) when the slots are all in use."""
        if not self.checks(engine, entry):
            return None
        planned = self.plan(engine, entry, specs)
        return self.claim(engine, planned, self.reserve(engine, entry, specs))

    def close(self) -> None:
        if self._helper is not None:
            self._helper.shutdown(wait=True)
            self._helper = None

    def indices(self, engine: RemoteEngine, check_: LoadCheck, src_rank: int) -> tuple[IntArray, IntArray]:
        """Descriptor ids (local, remote) of the source's digest slices, for its READ."""
        for src in check_.sources:
            if src.src_rank == src_rank:
                handles = engine.handles[src_rank]
                slots = engine.digest_slots[src_rank]
                groups = src.spec.slice_group
                local = handles.digest_local_base + groups * slots.slots + np.asarray(src.slots, dtype=np.int64)
                # the source's own table: a pool serves every source of one row shape, whatever its rows
                table = engine.digest_geometries[src_rank].layout
                remote = handles.digest_remote_base + groups * table.num_blocks + src.spec.slice_block
                return local.astype(np.int64), remote.astype(np.int64)
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty

    def judge(self, engine: RemoteEngine, load: Load, check_: LoadCheck) -> str | None:
        """After the slices landed: None when every unit checked out; "reread" when a seed was
        not this request's yet; otherwise the reason the load fails."""
        unsealed: list[tuple[int, tuple[int, int]]] = []
        for src in check_.sources:
            result: CheckResult = check(src.spec, src.pool.slices(src.spec.slice_group, src.slots),
                                        check_.seeds, self.memory, src.views)
            check_.hashed_bytes += result.hashed_bytes
            check_.units += result.units
            if result.mismatches:
                return self._mismatch(load, engine, src, result)
            unsealed += [(src.src_rank, s) for s in result.unsealed]
        if not unsealed:
            self.stats.count("kv_verified_units_total", check_.units)
            self.stats.count("kv_verified_bytes_total", check_.hashed_bytes)
            return None
        if self.clock() > check_.deadline:
            self.stats.count("kv_unsealed_loads_total")
            rank, (group, index) = unsealed[0]
            return (f"P's digests of {len(unsealed)} block(s) never matched this request's tokens "
                    f"within {self.deadline_s:g} s (first: P rank {rank}, group {group}, block {index} "
                    f"of the request): the blocks were reused for other tokens or never sealed")
        # P seals at its next step, which may wait behind a forward pass: back off (2, 4, ... 64 ms).
        check_.reread_at = self.clock() + REREAD_S * 2 ** min(check_.rereads, 5)
        return "reread"

    def _mismatch(self, load: Load, engine: RemoteEngine, src: SourceCheck, result: CheckResult) -> str:
        self.stats.count("kv_checksum_mismatch_total")
        group, index, unit, want, got = result.mismatches[0]
        pages = sorted({(g, i) for g, i, _, _, _ in result.mismatches})
        block_ids = load.entry["remote_block_ids"]
        named = ", ".join(f"group {g} block {block_ids[g][i]}" for g, i in pages[:8])
        reason = (f"KV checksum mismatch in {len(result.mismatches)} unit(s) from {engine.engine_id} "
                  f"rank {src.src_rank} ({named}{' ...' if len(pages) > 8 else ''}): unit {unit} of "
                  f"group {group} block {block_ids[group][index]} has digest {got:016x}, P sealed "
                  f"{want:016x}")
        log.error("request %s: %s", load.request_id, reason)
        return reason

    def reread(self, agent: NixlAgent, inflight: InflightTracker, engine: RemoteEngine, load: Load,
               check_: LoadCheck) -> str | None:
        """Read the slices again (digests only); the failure reason if a READ cannot be posted."""
        check_.reread_at = None
        check_.rereads += 1
        self.stats.count("kv_digest_rereads_total")
        return self.read_slices(agent, inflight, engine, load, check_)

    def read_slices(self, agent: NixlAgent, inflight: InflightTracker, engine: RemoteEngine, load: Load,
                    check_: LoadCheck) -> str | None:
        """Post the READs of the check's digest slices; the failure reason if one cannot be posted."""
        for src in check_.sources:
            local, remote = self.indices(engine, check_, src.src_rank)
            if not local.size:
                continue
            handles = engine.handles[src.src_rank]
            try:
                t = agent.post("READ", handles.local_handle, local, handles.remote_handle, remote, b"",
                               tag=("verify", load.request_id))
            except TransferFailed as exc:
                return f"digest READ refused: {exc.reason}"
            check_.reads.append(t)
            inflight.add(t)
        return None

    def release(self, sources: list[SourceCheck]) -> None:
        for src in sources:
            if src.slots:
                src.pool.give(sorted(set(src.slots)))
            src.slots = []
