"""Continuous batching: decode running requests, admit waiting ones while blocks allow, preempt when out.

Each group has its own pool. Attention groups need `ceil(tokens / block_size)` blocks;
an SSM group needs one block per request (its state page), never prefix-cached.
A waiting request whose remote KV is loading is parked with its blocks held.

Prefix hits of a hybrid model: cached attention blocks do not restore the SSM state
after them, so a hybrid request uses its attention hits only when a remote load brings
the state (P's state after N-1 tokens, into the request's fresh SSM block).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvlink.connector.api import ConnectorScheduler
from kvlink.engine.block_pool import BlockPool
from kvlink.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledRun:
    """Feed `request.all_token_ids[start_pos : start_pos + num_tokens]` this step."""

    request: Request
    start_pos: int
    num_tokens: int


@dataclass
class SchedulerOutput:
    runs: list[ScheduledRun] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    rejected: list[Request] = field(default_factory=list)  # can never fit in the pools


class Scheduler:
    def __init__(
        self, pools: list[BlockPool], ssm_groups: list[bool], connector: ConnectorScheduler | None,
        max_num_seqs: int = 16, max_num_batched_tokens: int = 2048, prefill_chunk: int = 0,
    ) -> None:
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be 0 (whole prompts) or a positive token count, got {prefill_chunk}")
        self.pools, self.ssm_groups, self.connector = pools, ssm_groups, connector
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.prefill_chunk = prefill_chunk
        self.has_state = any(ssm_groups)
        self.attention_groups = [g for g, ssm in enumerate(ssm_groups) if not ssm]
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.parked: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if not self._make_room(request, out):
                continue
            self._grow(request, request.num_tokens)
            num_new = self._chunk(request)  # 1 when decoding; the next chunk of a long prompt
            out.runs.append(ScheduledRun(request, request.num_computed_tokens, num_new))
            budget -= num_new
        while self.waiting and not out.preempted and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if not request.block_tables and not self._admit(request, out):
                break
            self.waiting.popleft()
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
                self.parked[request.request_id] = request
                continue
            if request in out.rejected:
                continue
            num_new = self._chunk(request)
            if num_new > budget and out.runs:
                self.waiting.appendleft(request)
                break
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.runs.append(ScheduledRun(request, request.num_computed_tokens, num_new))
            budget -= num_new
        return out

    def _chunk(self, request: Request) -> int:
        """Tokens of the request's next forward: all that remain, or with `prefill_chunk` at
        most that many (a long prompt then prefills over several steps, decodes in between)."""
        remaining = max(0, request.num_tokens_to_compute - request.num_computed_tokens)
        return min(remaining, self.prefill_chunk) if self.prefill_chunk else remaining

    def _admit(self, request: Request, out: SchedulerOutput) -> bool:
        """Allocate blocks (and ask the connector for remote KV); False when it must wait."""
        no_hits: list[list[int]] = [[] for _ in self.pools]
        hits = self._prefix_hits(request)
        missing = self._missing(request, hits)
        if any(m > pool.num_blocks for m, pool in zip(missing, self.pools, strict=True)):
            request.error = (
                f"request {request.request_id!r} needs {missing} blocks per group but the pools hold "
                f"{[p.num_blocks for p in self.pools]}; shorten the prompt or raise num_blocks"
            )
            out.rejected.append(request)
            return True
        # Hybrid hits hold only if a remote load brings the state; the connector says so only
        # once, so there must be room for the request without them too.
        needs_state = self.has_state and any(hits)
        if not self._can_allocate(missing, hits) or (
                needs_state and not self._can_allocate(self._missing(request, no_hits), no_hits)):
            return False
        num_local = max(len(h) for h in hits) * self.pools[0].block_size
        count, is_async = 0, False
        if self.connector is not None and not request.remote_kv_considered:
            request.remote_kv_considered = True
            count, is_async = self.connector.get_num_new_matched_tokens(request.view(), num_local)
        if needs_state and not (count > 0 or is_async):
            hits, num_local = no_hits, 0
            missing = self._missing(request, hits)
        request.block_tables = [
            p.allocate(m, h) for p, m, h in zip(self.pools, missing, hits, strict=True)
        ]
        request.num_local_prefix_tokens = request.num_computed_tokens = num_local
        if self.connector is not None:
            self.connector.update_state_after_alloc(request.view(), request.block_tables, count, num_local)
        if is_async:  # also with count 0: a hybrid request's full hit still loads P's state
            request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        elif count > 0:  # loaded synchronously by the worker before this step's forward
            request.num_computed_tokens = len(request.prompt_token_ids) - 1
        return True

    def _missing(self, request: Request, hits: list[list[int]]) -> list[int]:
        return [
            1 if ssm else pool.blocks_for(request.num_tokens) - len(hits[g])
            for g, (pool, ssm) in enumerate(zip(self.pools, self.ssm_groups, strict=True))
        ]

    def _can_allocate(self, missing: list[int], hits: list[list[int]]) -> bool:
        return all(p.can_allocate(m, h) for p, m, h in zip(self.pools, missing, hits, strict=True))

    def _prefix_hits(self, request: Request) -> list[list[int]]:
        """Leading cached blocks per group (the SSM groups' lists stay empty)."""
        may_load_state = self.connector is not None and not request.remote_kv_considered
        if not self.attention_groups or (self.has_state and not may_load_state):
            return [[] for _ in self.pools]
        hits = [[] if ssm else pool.match_prefix(request.all_token_ids)
                for pool, ssm in zip(self.pools, self.ssm_groups, strict=True)]
        # Leave at least one token to compute: its logits are what the step samples from.
        usable = max(0, request.num_tokens_to_compute - 1) // self.pools[0].block_size
        common = min(usable, *(len(hits[g]) for g in self.attention_groups))
        return [h[:common] for h in hits]

    def _make_room(self, request: Request, out: SchedulerOutput) -> bool:
        """Preempt the newest running requests until `request` can grow; False if it was preempted."""
        while not all(
            ssm or pool.can_append(table, request.num_tokens)
            for pool, ssm, table in zip(self.pools, self.ssm_groups, request.block_tables, strict=True)
        ):
            victim = self.running[-1]
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _grow(self, request: Request, num_tokens: int) -> None:
        for pool, ssm, table in zip(self.pools, self.ssm_groups, request.block_tables, strict=True):
            if not ssm:
                pool.may_append(table, num_tokens)

    def preempt(self, request: Request) -> None:
        """Free the request's blocks and queue it first; it recomputes locally when readmitted."""
        self.running.remove(request)
        self.free_blocks(request.block_tables)
        request.block_tables = []
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def resume_after_load(self, request_id: str, loaded: bool) -> Request | None:
        """A parked request's load ended: continue from the loaded KV, or start over locally."""
        request = self.parked.pop(request_id, None)
        if request is None:
            return None
        if loaded:
            request.num_computed_tokens = len(request.prompt_token_ids) - 1
        else:
            self.free_blocks(request.block_tables)
            request.block_tables, request.num_computed_tokens = [], 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        return request

    def remove(self, request: Request) -> None:
        """Take a finishing request out of every queue; its blocks are the caller's to release."""
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self.parked.pop(request.request_id, None)

    def free_blocks(self, block_tables: list[list[int]]) -> None:
        for pool, table in zip(self.pools, block_tables, strict=False):
            pool.deallocate(table)
