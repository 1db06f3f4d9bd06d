"""Staged reads: whole P pages into a local staging area, then a local re-layout into D's pages.

Between different kernel block sizes, a page order that is not token-major (vLLM's CPU
pages, K transposed) splits every token chunk into one run per head dimension: tens of
thousands of tiny descriptors per request, and a pool-wide plan of millions. A staged
read instead moves whole P pages (one descriptor per layer and page run, exactly as
between equal block sizes) into staging pages shaped like P's, and D copies the tokens
into its own pages with `kvlink.layout.relayout.copy_token_runs`.

`StagedPlan` is built once per (reader worker, source engine); a request computes
integers only: the READ's descriptor indices and the re-layout's token runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import gcd

import numpy as np

from kvlink.layout.geometry import WorkerGeometry, build_worker_geometry
from kvlink.layout.page_order import DEFAULT_PAGE_ORDER
from kvlink.layout.relayout import RunArray, run_granule
from kvlink.layout.spec import FullAttention
from kvlink.plan.compat import IncompatibleLayout
from kvlink.plan.descriptors import IntArray
from kvlink.plan.request import ReadSpec
from kvlink.plan.transfer_plan import TransferPlan, build_transfer_plan


def needs_staging(local: WorkerGeometry, remote: WorkerGeometry) -> bool:
    """True when reader `local` should read `remote` through staging pages: different kernel
    block sizes, a page order that is not token-major, full attention only."""
    return (local.kernel_block_size != remote.kernel_block_size
            and local.page_order != DEFAULT_PAGE_ORDER
            and all(isinstance(g, FullAttention) for g in local.model.groups))


def staging_page_bytes(local: WorkerGeometry, remote_kernel_block_size: int) -> int:
    """Bytes of one staging slot: one P-sized page of every attention layer of this reader."""
    region = local.attention_regions[0]
    per_layer = region.units * remote_kernel_block_size * region.token_bytes
    return per_layer * len(local.attention_regions)


def staging_geometry(local: WorkerGeometry, remote_kernel_block_size: int, slots: int,
                     base_addrs: Sequence[int]) -> WorkerGeometry:
    """The staging area as a worker geometry: the reader's heads and page order, P's kernel
    block size, `slots` pages per layer at `base_addrs` (one per layer)."""
    return build_worker_geometry(
        local.model, local.tp_size, local.tp_rank, remote_kernel_block_size, remote_kernel_block_size,
        slots, base_addrs, device_id=local.device_id, page_order=local.page_order)


@dataclass(frozen=True, eq=False)
class StagedRequest:
    """One request: READs into `slots` of the staging area, then `runs` of token copies
    (rows of `kvlink.layout.relayout.RUN_FIELDS`: staging slot, token, D kernel page,
    token, count), the same for every attention layer."""

    specs: list[ReadSpec]
    runs: RunArray
    slots: tuple[int, ...]
    relayout_bytes: int


@dataclass(frozen=True, eq=False)
class StagedPlan:
    local: WorkerGeometry
    staging: WorkerGeometry
    read: TransferPlan

    @property
    def stage_tokens(self) -> int:
        return self.staging.kernel_block_size

    def slots_needed(self, num_tokens_to_ship: int, local_computed_tokens: int) -> int:
        if num_tokens_to_ship <= local_computed_tokens:
            return 0
        first = local_computed_tokens // self.stage_tokens * self.stage_tokens
        return -(-(num_tokens_to_ship - first) // self.stage_tokens)

    def request(
        self, local_block_ids: Sequence[Sequence[int] | IntArray],
        remote_block_ids: Sequence[Sequence[int] | IntArray], num_tokens_to_ship: int,
        local_computed_tokens: int, slots: Sequence[int],
    ) -> StagedRequest:
        """READ specs into `slots` (`slots_needed` of them) and the token runs that follow.

        Block lists as for `TransferPlan.request_ids`: D's from `local_computed_tokens` on,
        P's from token 0."""
        local, k = self.local, self.stage_tokens
        if local_computed_tokens < 0 or local_computed_tokens % local.block_size:
            raise ValueError(f"local_computed_tokens {local_computed_tokens} must be a non-negative "
                             f"multiple of the local block size {local.block_size}")
        need = self.slots_needed(num_tokens_to_ship, local_computed_tokens)
        if len(slots) != need:
            raise ValueError(f"request needs {need} staging slots, got {len(slots)}")
        slot_ids = np.asarray(slots, dtype=np.int64)
        if slot_ids.size and (int(slot_ids.min()) < 0 or int(slot_ids.max()) >= self.staging.num_blocks):
            raise ValueError(f"staging slots must lie in [0, {self.staging.num_blocks})")
        first = local_computed_tokens // k * k
        specs = self.read.request_ids([slot_ids], remote_block_ids, num_tokens_to_ship, first)
        if not need:
            return StagedRequest(specs, np.zeros((0, 5), dtype=np.int64), (), 0)
        runs = self._runs(np.asarray(local_block_ids[0], dtype=np.int64), slot_ids, first,
                          num_tokens_to_ship, local_computed_tokens)
        region = local.attention_regions[0]
        moved = int(runs[:, 4].sum()) * region.units * region.token_bytes * len(local.attention_regions)
        touched = _touched(local, np.asarray(local_block_ids[0], dtype=np.int64), local_computed_tokens,
                           self._end(num_tokens_to_ship))
        specs = [ReadSpec(s.src_rank, s.local_idx, s.remote_idx, s.nbytes, (touched,)) for s in specs]
        return StagedRequest(specs, runs, tuple(int(s) for s in slots), moved)

    def _end(self, num_tokens: int) -> int:
        c = gcd(self.stage_tokens, self.local.kernel_block_size)
        return -(-num_tokens // c) * c

    def _runs(self, local_ids: IntArray, slots: IntArray, first: int, num_tokens: int,
              computed: int) -> RunArray:
        local, k = self.local, self.stage_tokens
        dk, bs = local.kernel_block_size, local.block_size
        end = self._end(num_tokens)
        cuts = np.union1d(np.arange(-(-computed // k) * k, end, k, dtype=np.int64),
                          np.arange(computed, end, dk, dtype=np.int64))
        starts = np.union1d(cuts, [computed])
        starts = starts[(starts >= computed) & (starts < end)]
        counts = np.diff(np.append(starts, end))
        blocks = (starts - computed) // bs
        if int(blocks[-1]) >= local_ids.size:
            raise ValueError(f"local block list of group 0 has {local_ids.size} blocks but tokens "
                             f"[{computed}, {num_tokens}) need {int(blocks[-1]) + 1}")
        logical = local_ids[blocks]
        if int(logical.min()) < 0 or int(logical.max()) >= local.num_blocks:
            raise ValueError(f"local block ids of group 0 must lie in [0, {local.num_blocks}); got "
                             f"range [{int(logical.min())}, {int(logical.max())}]")
        d_page = logical * local.physical_per_logical + (starts % bs) // dk
        s_page = slots[(starts - first) // k]
        return np.stack([s_page, starts % k, d_page, starts % dk, counts], axis=1).astype(np.int64)


def _touched(local: WorkerGeometry, local_ids: IntArray, computed: int, end: int) -> IntArray:
    """D's logical blocks that tokens [computed, end) of the request write into."""
    if end <= computed:
        return np.zeros(0, dtype=np.int64)
    last = (end - 1 - computed) // local.block_size
    return local_ids[: last + 1]


def build_staged_plan(local: WorkerGeometry, staging: WorkerGeometry,
                      remotes: Mapping[int, WorkerGeometry]) -> StagedPlan:
    """Plan reader `local` against `remotes` through `staging` (see `staging_geometry`)."""
    remote = next(iter(remotes.values()))
    if not needs_staging(local, remote):
        raise ValueError("staging is for different kernel block sizes of a non token-major page "
                         "order and full attention only")
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
