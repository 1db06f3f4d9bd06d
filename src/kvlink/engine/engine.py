"""The reference engine: `step()` = schedule -> load KV -> run -> connector output -> postprocess.

With a connector it is one side of a P/D pair, driven only through `connector.api`;
without one it is a plain colocated engine.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvlink.connector.api import (
    ConnectorScheduler,
    ConnectorWorker,
    LoadFailurePolicy,
    WorkerOutput,
)
from kvlink.connector.params import InvalidTransferParams
from kvlink.engine.block_pool import BlockPool
from kvlink.engine.kv_cache import allocate_kv_caches, register_with
from kvlink.engine.model.base import PagedModel
from kvlink.engine.request import Request, RequestOutput, RequestStatus, SamplingParams
from kvlink.engine.runner import ModelRunner
from kvlink.engine.scheduler import ScheduledRun, Scheduler
from kvlink.layout.spec import is_ssm

logger = logging.getLogger("kvlink.engine")


class LLMEngine:
    """One engine instance (one worker rank) over `num_blocks` logical blocks per KV-cache group."""

    def __init__(
        self,
        model: PagedModel,
        num_blocks: int,
        block_size: int,
        kernel_block_size: int,
        connector_scheduler: ConnectorScheduler | None = None,
        connector_worker: ConnectorWorker | None = None,
        load_failure_policy: LoadFailurePolicy | None = None,
        *,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        prefill_chunk: int = 0,
    ) -> None:
        self.model, self.num_blocks, self.max_model_len = model, num_blocks, max_model_len
        self.block_size, self.kernel_block_size = block_size, kernel_block_size
        self.connector, self.worker = connector_scheduler, connector_worker
        if load_failure_policy is None:
            load_failure_policy = connector_scheduler.load_failure_policy if connector_scheduler else "fail"
        if load_failure_policy not in ("recompute", "fail"):
            raise ValueError(f"load_failure_policy must be 'recompute' or 'fail', got {load_failure_policy!r}")
        self.load_failure_policy: LoadFailurePolicy = load_failure_policy
        ssm_groups = [is_ssm(g) for g in model.spec.groups]
        self.pools = [BlockPool(num_blocks, block_size, enable_prefix_caching=not s) for s in ssm_groups]
        self.kv_caches = allocate_kv_caches(model.spec, model.tp_size, block_size, kernel_block_size, num_blocks)
        if connector_worker is not None:
            connector_worker.register_kv_caches(*register_with(self.kv_caches))

        self.scheduler = Scheduler(
            self.pools, ssm_groups, connector_scheduler, max_num_seqs, max_num_batched_tokens, prefill_chunk
        )
        self.runner = ModelRunner(model, self.kv_caches, block_size)
        if connector_worker is not None:  # P streams layers as the forward makes them (layerwise)
            self.runner.layer_sink = connector_worker.layer_sink()
        self.requests: dict[str, Request] = {}
        # Blocks of finished requests kept for the connector (P lease, or an aborted load in flight).
        self.held: dict[str, list[list[int]]] = {}
        # Transfer figures of finished loads, reported with the request's next output.
        self._figures: dict[str, dict[str, float]] = {}
        # Blocks of stalled loads a late transfer may still write: (release time, tables).
        self.quarantine: list[tuple[float, list[list[int]]]] = []
        self._outputs: list[RequestOutput] = []

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        if request_id in self.requests or request_id in self.held:
            raise ValueError(f"request id {request_id!r} is already in use; ids must be unique")
        params = params or SamplingParams()
        if self.max_model_len is not None and len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: {len(prompt_token_ids)} prompt tokens + max_tokens "
                f"{params.max_tokens} exceed max_model_len {self.max_model_len}; shorten one of them"
            )
        # Colocated, no connector: a `do_remote_decode` answer would be an empty completion and
        # no params, which a router passes on as P's; a `do_remote_prefill` request would be
        # prefilled here without telling P, which then holds the blocks for its whole lease.
        for flag, asks, instead in (("do_remote_decode", "for a prefill whose KV a remote decode instance reads",
                                     "a prefill"),
                                    ("do_remote_prefill", "to read the prompt's KV from a prefill instance",
                                     "a decode")):
            if self.connector is None and kv_transfer_params and kv_transfer_params.get(flag, False) is not False:
                raise InvalidTransferParams(
                    f"request {request_id!r}: kv_transfer_params.{flag} asks {asks}, but this engine has "
                    f"no KV connector (it serves colocated); send it to {instead} instance, or drop "
                    f"kv_transfer_params")
        request = Request(request_id, list(prompt_token_ids), params, kv_transfer_params)
        if self.connector is not None:
            # May refuse bad kv_transfer_params; the request must not be registered then.
            self.connector.on_new_request(request.view())
        self.requests[request_id] = request
        self.scheduler.add(request)

    def abort(self, request_id: str) -> bool:
        """Finish a request now (reason "abort"); False if it is not in the engine.

        A request that finished already, its blocks held for a remote decoder, is let go: the
        caller aborting it never passed its params on (it left before they arrived)."""
        request = self.requests.get(request_id)
        if request is None:
            return self.release_held(request_id)
        self._finish(request, "abort", aborted=True)
        return True

    def release_held(self, request_id: str,
                     why: str = "its caller left before taking its KV params") -> bool:
        """P: free now the blocks a finished request holds for a remote decoder that will never
        come (`why`: by default, its caller left before taking the params). False when none
        are held for it."""
        if request_id not in self.held or self.connector is None or not self.connector.release_held(request_id):
            return False
        logger.info("request %s: %s; freeing its blocks", request_id, why)
        return True

    def release_by_params(self, kv_transfer_params: dict[str, Any]) -> bool:
        """P: a router hands back the params of a request it never passed to a decoder (the
        decode leg could not reach one, or its client left first): free the request's blocks
        now, not when the lease ends. False when nothing is held for them. Raises ValueError
        without a connector, and the connector's errors for params it did not issue."""
        if self.connector is None:
            raise ValueError("this engine has no KV connector: it holds no KV for decoders")
        request_id = self.connector.held_by_params(kv_transfer_params)
        return request_id is not None and self.release_held(request_id, "a router handed its KV params back unused")

    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        for request in scheduled.rejected:
            self._finish(request, "error", error=request.error)
        if self.connector is not None:
            metadata = self.connector.build_step_metadata()
            if self.worker is not None:
                self.worker.start_load_kv(metadata)
        sampled = self.runner.run(scheduled.runs)
        if self.connector is not None:
            output = self.worker.get_finished() if self.worker is not None else WorkerOutput()
            self.connector.update_connector_output(output)
            self._apply_connector_output(output)
        self._postprocess(scheduled.runs, sampled)
        outputs, self._outputs = self._outputs, []
        return outputs

    def has_unfinished(self) -> bool:
        pending = self.connector is not None and self.connector.has_pending_work()
        return bool(self.requests or self.held or self._outputs or self.quarantine) or pending

    def stats(self) -> dict[str, Any]:
        return {
            "num_blocks": self.num_blocks,
            "requests": len(self.requests),
            "free_blocks": [pool.num_free_blocks for pool in self.pools],
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "waiting_for_remote_kv": len(self.scheduler.parked),
            "held_requests": len(self.held),
            "held_blocks": [sum(len(t[g]) for t in self.held.values()) for g in range(len(self.pools))],
            "quarantined_blocks": [sum(len(t[g]) for _, t in self.quarantine) for g in range(len(self.pools))],
            "connector": self.worker.debug_state() if self.worker is not None else {},
        }

    def check_integrity(self) -> None:
        """Pools are consistent and every reference belongs to a live or held request."""
        tables = [r.block_tables for r in self.requests.values() if r.block_tables]
        tables += list(self.held.values())
        tables += [t for _, t in self.quarantine]
        for group, pool in enumerate(self.pools):
            pool.check_integrity([t[group] for t in tables])

    def _postprocess(self, runs: list[ScheduledRun], sampled: dict[str, int]) -> None:
        for run in runs:
            request = run.request
            if request.status is not RequestStatus.RUNNING:
                continue
            request.num_computed_tokens = run.start_pos + run.num_tokens
            for pool, table in zip(self.pools, request.block_tables, strict=True):
                pool.cache_full_blocks(table, request.all_token_ids, request.num_computed_tokens)
            if request.num_computed_tokens < request.num_tokens_to_compute:
                continue  # a chunk of the prompt: the next one comes in a later step
            if request.prefill_only:
                self._finish(request, "length")
                continue
            token = sampled[request.request_id]
            request.output_token_ids.append(token)
            reason = self._stop_reason(request, token)
            if reason is not None:
                self._finish(request, reason, new_token_ids=[token])
            else:
                self._outputs.append(self._with_figures(RequestOutput(request.request_id, [token])))

    def _stop_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if token in params.stop_tokens(self.model.eos_token_ids):
            return "stop"
        if len(request.output_token_ids) >= params.max_tokens:
            return "length"
        return None

    def _apply_connector_output(self, output: WorkerOutput) -> None:
        if output.invalid_block_ids:
            for pool in self.pools:
                pool.invalidate(output.invalid_block_ids)
        for request_id, figures in output.transfer_figures.items():
            if request_id in self.requests:
                self._figures[request_id] = figures
        self._release_quarantine()
        done = output.finished_sending | output.finished_recving | output.failed_recving
        for request_id in done & self.held.keys():
            self._free_or_quarantine(self.held.pop(request_id), output.quarantine_s.get(request_id))
        for request_id in output.finished_recving:
            self.scheduler.resume_after_load(request_id, loaded=True)
        for request_id in output.failed_recving:
            request = self.scheduler.parked.get(request_id)
            if request is None:
                continue
            if request_id in output.quarantine_s:
                self._free_or_quarantine(request.block_tables, output.quarantine_s[request_id])
                request.block_tables = []
            if self.load_failure_policy == "recompute":
                self.scheduler.resume_after_load(request_id, loaded=False)
            else:
                request.status = RequestStatus.WAITING  # the load has ended: nothing writes the blocks
                failure = output.load_failures.get(request_id)
                if failure is not None and failure.forbidden:
                    self._finish(request, "error", error_kind="forbidden_kv_transfer_params", error=(
                        f"refusing the kv_transfer_params of request {request_id!r}: {failure.reason}; "
                        "send the request through the prefill instance again"
                    ))
                    continue
                if failure is not None and failure.bad_params:
                    self._finish(request, "error", error_kind="bad_kv_transfer_params", error=(
                        f"cannot load the KV cache of request {request_id!r} with the given "
                        f"kv_transfer_params: {failure.reason}"
                    ))
                    continue
                why = f": {failure.reason}" if failure is not None else ""
                kind = "kv_load_stalled" if failure is not None and failure.stalled else "kv_load_failed"
                self._finish(request, "error", error_kind=kind, error=(
                    f"loading the KV cache of request {request_id!r} from the prefill instance "
                    f"failed{why}; load_failure_policy is 'fail': retry the request, or run the "
                    "decode instance with load_failure_policy='recompute' to prefill locally"
                ))

    def _finish(
        self, request: Request, reason: str, *, error: str | None = None, aborted: bool = False,
        new_token_ids: list[int] | None = None, error_kind: str | None = None,
    ) -> None:
        """Leave every queue; free the blocks unless the connector still reads or writes them."""
        loading = request.status is RequestStatus.WAITING_FOR_REMOTE_KV
        self.scheduler.remove(request)
        request.status, request.finish_reason, request.error = RequestStatus.FINISHED, reason, error
        tables, request.block_tables = request.block_tables, []
        delay_free, params = False, None
        if self.connector is not None:
            delay_free, params = self.connector.request_finished(request.view(), tables, aborted)
        if tables and (delay_free or loading):
            self.held[request.request_id] = tables
        else:
            self.scheduler.free_blocks(tables)
        del self.requests[request.request_id]
        self._outputs.append(self._with_figures(RequestOutput(
            request.request_id, new_token_ids or [], True, reason, error, params,
            error_kind=error_kind,
        )))

    def _free_or_quarantine(self, tables: list[list[int]], hold_s: float | None) -> None:
        if hold_s:
            self.quarantine.append((time.monotonic() + hold_s, tables))
        else:
            self.scheduler.free_blocks(tables)

    def _release_quarantine(self) -> None:
        now = time.monotonic()
        keep = []
        for until, tables in self.quarantine:
            if until <= now:
                self.scheduler.free_blocks(tables)
            else:
                keep.append((until, tables))
        self.quarantine = keep

    def _with_figures(self, output: RequestOutput) -> RequestOutput:
        figures = self._figures.pop(output.request_id, None)
        if figures is not None:
            output.kv_bytes = int(figures.get("kv_bytes", 0))
            output.kv_transfer_s = figures.get("kv_transfer_s")
            if "kv_verified_bytes" in figures:
                output.kv_verified_bytes = int(figures["kv_verified_bytes"])
        return output
