"""Staged reads: whole P pages into a local staging area, then a local re-layout into D's pages.

Between different kernel block sizes, a page order that is not token-major (vLLM's CPU
pages, K transposed) splits every token chunk into one run per head dimension: tens of
thousands of tiny descriptors per request, and a pool-wide plan of millions. A staged
read instead moves whole P pages (one descriptor per layer and page run, exactly as
between equal block sizes) into staging pages shaped like P's, and D copies the tokens
into its own pages with `kvlink.layout.relayout.copy_token_runs`.

`StagedPlan` is built once per (reader worker, source engine); a request computes
integers only: the READ's descriptor indices and the re-layout's token runs.

Several attention groups (a sliding-window model's local and global layers, which vLLM's
hybrid KV cache keeps as groups aliasing one allocation) share the staging slots: slot j
holds P's page of tokens `[first + j*k, first + (j+1)*k)` for every layer, each layer's
page read from its own group's P block. A sliding group reads and copies only the chunks
inside its window; each group copies into its own D blocks. A hybrid model's SSM state
(Mamba2, GDN) is not cut by tokens: it is read into the last slot's page of each SSM layer
and copied whole into D's state block (`StagedPlan.state_copies`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from math import gcd

import numpy as np

from kvlink.layout.geometry import Region, WorkerGeometry, build_worker_geometry
from kvlink.layout.page_order import DEFAULT_PAGE_ORDER
from kvlink.layout.relayout import RunArray, run_granule
from kvlink.layout.spec import GDN, FullAttention, Mamba2, SlidingWindow, is_ssm
from kvlink.plan.compat import IncompatibleLayout
from kvlink.plan.descriptors import IntArray
from kvlink.plan.request import ReadSpec
from kvlink.plan.transfer_plan import TransferPlan, build_transfer_plan

STAGED_GROUPS = (FullAttention, SlidingWindow, Mamba2, GDN)


def needs_staging(local: WorkerGeometry, remote: WorkerGeometry) -> bool:
    """True when reader `local` should read `remote` through staging pages: different kernel
    block sizes, a page order that is not token-major, attention groups (full or sliding
    window), optionally with Mamba2 or GDN groups."""
    return (local.kernel_block_size != remote.kernel_block_size
            and local.page_order != DEFAULT_PAGE_ORDER
            and all(isinstance(g, STAGED_GROUPS) for g in local.model.groups))


def staging_layer_bytes(local: WorkerGeometry, remote_kernel_block_size: int) -> list[int]:
    """Bytes of one staging slot per layer, in layer order: a P-sized page of an attention
    layer, the (unpadded) state page of an SSM layer."""
    return [r.page_len if r.kind == "ssm" else r.units * remote_kernel_block_size * r.token_bytes
            for r in local.regions]


def staging_page_bytes(local: WorkerGeometry, remote_kernel_block_size: int) -> int:
    """Bytes of one staging slot: one P-sized page of every layer of this reader."""
    return sum(staging_layer_bytes(local, remote_kernel_block_size))


def staging_geometry(local: WorkerGeometry, remote_kernel_block_size: int, slots: int,
                     base_addrs: Sequence[int]) -> WorkerGeometry:
    """The staging area as a worker geometry: the reader's heads and page order, P's kernel
    block size, `slots` pages per layer at `base_addrs` (one per layer; SSM pages packed)."""
    return build_worker_geometry(
        local.model, local.tp_size, local.tp_rank, remote_kernel_block_size, remote_kernel_block_size,
        slots, base_addrs, device_id=local.device_id, page_order=local.page_order)


@dataclass(frozen=True, eq=False)
class StagedRequest:
    """One request: READs into `slots` of the staging area, then `runs[g]` of token copies
    (rows of `kvlink.layout.relayout.RUN_FIELDS`: staging slot, token, D kernel page,
    token, count) for every attention layer of group g. Slot j holds tokens from
    `first + j * k` (k: P's kernel block size)."""

    specs: list[ReadSpec]
    runs: tuple[RunArray, ...]
    slots: tuple[int, ...]
    relayout_bytes: int
    first: int = 0
    # SSM layers: (staging address, D address, bytes) of the state page copied whole
    states: tuple[tuple[int, int, int], ...] = ()

    @property
    def copies(self) -> bool:
        return any(r.size for r in self.runs) or bool(self.states)


@dataclass(frozen=True, eq=False)
class StagedPlan:
    local: WorkerGeometry
    staging: WorkerGeometry
    read: TransferPlan

    @property
    def stage_tokens(self) -> int:
        return self.staging.kernel_block_size

    @cached_property
    def group_bytes(self) -> tuple[int, ...]:
        """Per group, over its layers of this reader: the bytes a token takes in an attention
        group, the state page in an SSM group (what a copy of one moves)."""
        out = [0] * len(self.local.model.groups)
        for r in self.local.regions:
            out[r.group] += r.page_len if r.kind == "ssm" else r.units * r.token_bytes
        return tuple(out)

    @cached_property
    def state_pages(self) -> tuple[tuple[int, Region, Region], ...]:
        """(group, staging region, reader region) of each SSM layer."""
        return tuple((own.group, staged, own) for staged, own in zip(self.staging.regions, self.local.regions,
                                                                     strict=True) if own.kind == "ssm")

    def group_starts(self, num_tokens_to_ship: int, local_computed_tokens: int) -> list[int]:
        """First token each group copies into D's pages: D's prefix hit, and for a sliding
        group no earlier than its window (on a chunk both block sizes share, as a direct
        read would start)."""
        c = gcd(self.stage_tokens, self.local.kernel_block_size)
        starts = []
        for group in self.local.model.groups:
            start = local_computed_tokens
            if isinstance(group, SlidingWindow):
                start = max(start, max(0, num_tokens_to_ship - group.window) // c * c)
            starts.append(start)
        return starts

    def first_token(self, num_tokens_to_ship: int, local_computed_tokens: int) -> int:
        """The first token staged (slot 0's first): the earliest group start, on P's pages."""
        start = min(self.group_starts(num_tokens_to_ship, local_computed_tokens))
        return start // self.stage_tokens * self.stage_tokens

    @property
    def has_state(self) -> bool:
        return any(is_ssm(g) for g in self.local.model.groups)

    def slots_needed(self, num_tokens_to_ship: int, local_computed_tokens: int) -> int:
        """Staging slots of a request; a hybrid's state needs one even when D holds every
        attention token (it moves whenever a token is shipped)."""
        state = 1 if self.has_state and num_tokens_to_ship > 0 else 0
        if num_tokens_to_ship <= local_computed_tokens:
            return state
        first = self.first_token(num_tokens_to_ship, local_computed_tokens)
        return max(state, -(-(num_tokens_to_ship - first) // self.stage_tokens))

    def request(
        self, local_block_ids: Sequence[Sequence[int] | IntArray],
        remote_block_ids: Sequence[Sequence[int] | IntArray], num_tokens_to_ship: int,
        local_computed_tokens: int, slots: Sequence[int],
    ) -> StagedRequest:
        """READ specs into `slots` (`slots_needed` of them) and the token runs that follow.

        Block lists as for `TransferPlan.request_ids`: D's from `local_computed_tokens` on,
        P's from token 0, one list per group."""
        local = self.local
        groups = len(local.model.groups)
        if local_computed_tokens < 0 or local_computed_tokens % local.block_size:
            raise ValueError(f"local_computed_tokens {local_computed_tokens} must be a non-negative "
                             f"multiple of the local block size {local.block_size}")
        if len(local_block_ids) != groups or len(remote_block_ids) != groups:
            raise ValueError(f"expected block ids for {groups} groups, got {len(local_block_ids)} "
                             f"local and {len(remote_block_ids)} remote")
        need = self.slots_needed(num_tokens_to_ship, local_computed_tokens)
        if len(slots) != need:
            raise ValueError(f"request needs {need} staging slots, got {len(slots)}")
        slot_ids = np.asarray(slots, dtype=np.int64)
        if slot_ids.size and (int(slot_ids.min()) < 0 or int(slot_ids.max()) >= self.staging.num_blocks):
            raise ValueError(f"staging slots must lie in [0, {self.staging.num_blocks})")
        first = self.first_token(num_tokens_to_ship, local_computed_tokens)
        specs = self.read.request_ids([slot_ids] * groups, remote_block_ids, num_tokens_to_ship, first)
        if not need:
            return StagedRequest(specs, tuple(np.zeros((0, 5), dtype=np.int64) for _ in range(groups)), (), 0, first)
        end = self._end(num_tokens_to_ship)
        runs: list[RunArray] = []
        touched: list[IntArray] = []
        moved = 0
        states: dict[int, tuple[int, int]] = {}
        for g, start in enumerate(self.group_starts(num_tokens_to_ship, local_computed_tokens)):
            ids = np.asarray(local_block_ids[g], dtype=np.int64)
            if is_ssm(local.model.groups[g]):  # the state after the shipped tokens, whole
                if not ids.size or not 0 <= int(ids[-1]) < local.num_blocks:
                    raise ValueError(f"SSM group {g} needs a local state block in [0, {local.num_blocks}); "
                                     f"got {ids[-1:].tolist()}")
                states[g] = (int(slot_ids[-1]), int(ids[-1]))
                runs.append(np.zeros((0, 5), dtype=np.int64))
                touched.append(ids[-1:])
                moved += self.group_bytes[g]
                continue
            group_runs = self._runs(g, ids, slot_ids, first, end, local_computed_tokens, start)
            runs.append(group_runs)
            moved += int(group_runs[:, 4].sum()) * self.group_bytes[g]
            touched.append(_touched(local, ids, local_computed_tokens, start, end))
        specs = [ReadSpec(s.src_rank, s.local_idx, s.remote_idx, s.nbytes, tuple(touched)) for s in specs]
        copies = tuple((staged.base + states[g][0] * staged.page_stride, own.base + states[g][1] * own.page_stride,
                        own.page_len) for g, staged, own in self.state_pages if g in states)
        return StagedRequest(specs, tuple(runs), tuple(int(s) for s in slots), moved, first, copies)

    def _end(self, num_tokens: int) -> int:
        c = gcd(self.stage_tokens, self.local.kernel_block_size)
        return -(-num_tokens // c) * c

    def _runs(self, group: int, local_ids: IntArray, slots: IntArray, first: int, end: int,
              computed: int, start: int) -> RunArray:
        """Token runs of tokens [start, end) into D's blocks `local_ids` (listed from `computed`)."""
        local, k = self.local, self.stage_tokens
        dk, bs = local.kernel_block_size, local.block_size
        if start >= end:
            return np.zeros((0, 5), dtype=np.int64)
        cuts = np.union1d(np.arange(-(-start // k) * k, end, k, dtype=np.int64),
                          np.arange(-(-start // dk) * dk, end, dk, dtype=np.int64))
        starts = np.union1d(cuts, [start])
        starts = starts[(starts >= start) & (starts < end)]
        counts = np.diff(np.append(starts, end))
        blocks = (starts - computed) // bs
        if int(blocks[-1]) >= local_ids.size:
            raise ValueError(f"local block list of group {group} has {local_ids.size} blocks but tokens "
                             f"[{computed}, {end}) need {int(blocks[-1]) + 1}")
        logical = local_ids[blocks]
        if int(logical.min()) < 0 or int(logical.max()) >= local.num_blocks:
            raise ValueError(f"local block ids of group {group} must lie in [0, {local.num_blocks}); got "
                             f"range [{int(logical.min())}, {int(logical.max())}]")
        d_page = logical * local.physical_per_logical + (starts % bs) // dk
        s_page = slots[(starts - first) // k]
        return np.stack([s_page, starts % k, d_page, starts % dk, counts], axis=1).astype(np.int64)


def _touched(local: WorkerGeometry, local_ids: IntArray, computed: int, start: int, end: int) -> IntArray:
    """D's logical blocks (listed from token `computed`) that tokens [start, end) write into."""
    if end <= start:
        return np.zeros(0, dtype=np.int64)
    last = (end - 1 - computed) // local.block_size
    return local_ids[(start - computed) // local.block_size: last + 1]


def build_staged_plan(local: WorkerGeometry, staging: WorkerGeometry,
                      remotes: Mapping[int, WorkerGeometry]) -> StagedPlan:
    """Plan reader `local` against `remotes` through `staging` (see `staging_geometry`)."""
    remote = next(iter(remotes.values()))
    if not needs_staging(local, remote):
        raise ValueError("staging is for different kernel block sizes of a non token-major page "
                         "order and attention groups, with or without Mamba2 or GDN groups")
    if staging.kernel_block_size != remote.kernel_block_size:
        raise ValueError(f"staging pages hold {staging.kernel_block_size} tokens, P's kernel "
                         f"blocks {remote.kernel_block_size}")
    chunk = gcd(local.kernel_block_size, remote.kernel_block_size)
    granule = run_granule(local.page_order)
    if chunk % granule:
        raise IncompatibleLayout([
            f"page order {local.page_order!r} moves whole granules of {granule} tokens, but kernel "
            f"block sizes P {remote.kernel_block_size} and D {local.kernel_block_size} only share "
            f"chunks of {chunk} tokens"])
    return StagedPlan(local, staging, build_transfer_plan(staging, remotes))
