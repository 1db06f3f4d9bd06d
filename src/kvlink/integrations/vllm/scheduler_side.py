"""The SCHEDULER-role half inside vLLM's EngineCore: vLLM's calls → kvlink's NixlScheduler."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvlink.connector.api import RequestView, StepMetadata, WorkerOutput
from kvlink.connector.config import ConnectorConfig
from kvlink.connector.params import wants_remote_decode
from kvlink.connector.scheduler import NixlScheduler
from kvlink.layout.spec import ModelSpec

log = logging.getLogger("kvlink.vllm")

# vLLM finish statuses after which P keeps the blocks for D (anything else: abort or error).
KEEP_STATUSES = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


def view(request: Any, prompt: list[int] | None = None) -> RequestView:
    tokens = prompt if prompt is not None else list(request.prompt_token_ids or ())
    return RequestView(request.request_id, tokens, request.kv_transfer_params)


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, tp_size: int, model: ModelSpec | None,
                 transfer_group_ids: Sequence[int]) -> None:
        self.config = config
        self.core = NixlScheduler(config, tp_size, model=model)
        self.transfer_group_ids = tuple(transfer_group_ids)
        self._local_hit: dict[str, int] = {}
        # Requests whose kv_transfer_params were refused on arrival (policy fail): their
        # "load" fails at once on the workers, so vLLM ends them with an error.
        self._refused: dict[str, str] = {}
        self._refused_loads: list[dict[str, Any]] = []
        # Hybrid P: the full prompt of requests P computes one token short (see _stop_short).
        self._full_prompt: dict[str, list[int]] = {}
        # P with verify_kv: requests that end with their prefill, sealed right after it (see _seals).
        self._prefills: dict[str, _Prefill] = {}
        # P, layerwise: block ids so far of the requests streamed layer by layer (see _layer_progress).
        self._stream_blocks: dict[str, list[list[int]]] = {}
        # Every kind kvlink moves inside vLLM streams layer by layer (an SSM state goes once the
        # prompt is through; a sliding group's tokens inside the final window only).
        self.streams_layers = model is not None

    def on_new_request(self, request: Any) -> None:
        if getattr(request, "abort_immediately", False):
            # vLLM refused the request before admission (or its load failed) and hands its
            # params over so that P's blocks are freed now.
            try:
                self.core.release_unadmitted(view(request))
            except Exception as exc:
                log.warning("request %s: not releasing P's blocks early: %s", request.request_id, exc)
            return
        try:
            self.core.on_new_request(view(request))
            self._stop_short(request)
            self._track_prefill(request)
        except Exception as exc:  # anything raised here would stop vLLM's engine core
            if self.config.load_failure_policy == "recompute" or not _wants_remote_prefill(request):
                log.warning("request %s: ignoring its kv_transfer_params (%s); computing it here",
                            request.request_id, exc)
                return
            log.warning("request %s: refusing its kv_transfer_params: %s", request.request_id, exc)
            self._refused[request.request_id] = str(exc)

    def _stop_short(self, request: Any) -> None:
        """Hybrid P: compute the prompt but its last token, so the SSM state P hands over is the
        one after N-1 tokens; D recomputes the last token from it (attention-only models move
        the KV of N-1 tokens the same way, but P may compute all N)."""
        params = request.kv_transfer_params
        if (not self.core.state_always_moves or not isinstance(params, dict)
                or params.get("do_remote_decode") is not True or params.get("_kvlink_stopped_short")
                or request.prompt_token_ids is None or request.num_prompt_tokens < 2):
            return
        self._full_prompt[request.request_id] = list(request.prompt_token_ids)
        del request.prompt_token_ids[-1]
        del request._all_token_ids[-1]
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params["_kvlink_stopped_short"] = True
        log.info("request %s: prefilling %d of %d prompt tokens (hybrid: D recomputes the last one)",
                 request.request_id, request.num_prompt_tokens, request.num_prompt_tokens + 1)

    def _track_prefill(self, request: Any) -> None:
        """P: a request that ends with its prefill (one output token) is sealed in the step
        that completes it; any other keeps being sealed when it finishes."""
        if (self.config.verify_kv == "off" or not wants_remote_decode(request.kv_transfer_params)
                or getattr(request, "max_tokens", None) != 1 or request.prompt_token_ids is None):
            return
        full = self._full_prompt.get(request.request_id, request.prompt_token_ids)
        self._prefills[request.request_id] = _Prefill(list(full[:-1]), int(request.num_prompt_tokens))

    def _seals(self, scheduler_output: Any) -> list[dict[str, Any]]:
        """The tracked requests whose prefill this step completes, with their block ids
        (the same entries their save will carry)."""
        if not self._prefills or scheduler_output is None:
            return []
        scheduled: dict[str, int] = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
        seen: list[tuple[str, int]] = []
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            tracked = self._prefills.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = [list(ids) for ids in new.block_ids]
                seen.append((new.req_id, int(new.num_computed_tokens)))
        cached: Any = getattr(scheduler_output, "scheduled_cached_reqs", None)
        for i, rid in enumerate(getattr(cached, "req_ids", ()) or ()):
            tracked = self._prefills.get(rid)
            if tracked is None:
                continue
            added = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                tracked.block_ids = [list(ids) for ids in added or ()]
            elif added is not None and tracked.block_ids is not None:
                for group, ids in enumerate(added):
                    tracked.block_ids[group].extend(ids)
            seen.append((rid, int(cached.num_computed_tokens[i])))
        out = []
        for rid, computed in seen:
            tracked = self._prefills[rid]
            if tracked.block_ids is None or computed + int(scheduled.get(rid, 0)) < tracked.prompt_len:
                continue
            del self._prefills[rid]
            out.append({"request_id": rid, "block_ids": tracked.block_ids, "token_ids": tracked.tokens,
                        "num_tokens": len(tracked.tokens)})
        return out

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        if rid in self._refused:
            missing = len(request.prompt_token_ids or ()) - 1 - num_computed_tokens
            if missing > 0:
                return missing, True
            log.warning("request %s: refused params but nothing to load; computing it here", rid)
            self._refused.pop(rid)
            return 0, False
        n, is_async = self.core.get_num_new_matched_tokens(view(request), num_computed_tokens)
        if n > 0:
            self._local_hit[rid] = num_computed_tokens
        return n, is_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        if num_external_tokens <= 0:
            return
        block_ids = [list(ids) for ids in blocks.get_block_ids()]
        if rid in self._refused:
            self._refused_loads.append({"request_id": rid, "error": self._refused.pop(rid),
                                        "local_block_ids": block_ids})
            return
        self.core.update_state_after_alloc(view(request), block_ids, num_external_tokens,
                                           self._local_hit.pop(rid, 0))

    def _layer_progress(self, scheduler_output: Any) -> list[dict[str, Any]]:
        """P, layerwise: each stream request this step computes, its blocks so far (per KV-cache
        group, in vLLM's group order, as kvlink's model has them) and the tokens it has once the
        forward ends (the worker writes each layer's new chunks right after it)."""
        streams = self.core.streams()
        if not streams or scheduler_output is None or not self.streams_layers:
            self._stream_blocks.clear()
            return []
        scheduled: dict[str, int] = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
        out = []
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            if new.req_id in streams:
                self._stream_blocks[new.req_id] = [list(ids) for ids in new.block_ids]
                out.append((new.req_id, int(new.num_computed_tokens)))
        cached: Any = getattr(scheduler_output, "scheduled_cached_reqs", None)
        for i, rid in enumerate(getattr(cached, "req_ids", ()) or ()):
            blocks = self._stream_blocks.get(rid)
            if rid not in streams or blocks is None:
                continue
            added = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                self._stream_blocks[rid] = [list(ids) for ids in added or ()]
            elif added is not None:
                for group, ids in enumerate(added):
                    blocks[group].extend(ids)
            out.append((rid, int(cached.num_computed_tokens[i])))
        for rid in [r for r in self._stream_blocks if r not in streams]:
            del self._stream_blocks[rid]
        return [{"request_id": rid, "block_ids": self._stream_blocks[rid],
                 "end": computed + int(scheduled.get(rid, 0))} for rid, computed in out]

    def build_step(self, scheduler_output: Any = None) -> StepMetadata:
        progress = self._layer_progress(scheduler_output)  # before the core's step: it ends streams
        step = self.core.build_step_metadata()
        step.layer_progress = progress
        step.seals = self._seals(scheduler_output)
        if self._refused_loads:
            step.loads.extend(self._refused_loads)
            self._refused_loads = []
        return step

    def update_connector_output(self, output: Any) -> None:
        self.core.update_connector_output(WorkerOutput(
            finished_sending=set(output.finished_sending or ()),
            finished_recving=set(output.finished_recving or ()),
            failed_recving=set(getattr(output, "failed_recving", None) or ()),
        ))

    def request_finished(self, request: Any, block_ids: Sequence[Sequence[int]]) -> tuple[bool, dict[str, Any] | None]:
        self._local_hit.pop(request.request_id, None)
        self._refused.pop(request.request_id, None)
        self._prefills.pop(request.request_id, None)
        full = self._full_prompt.pop(request.request_id, None)
        aborted = request.status.name not in KEEP_STATUSES
        try:
            done, params = self.core.request_finished(view(request, full), [list(ids) for ids in block_ids], aborted)
            if params is not None:
                params.pop("_kvlink_stopped_short", None)
            return done, params
        except Exception as exc:
            log.warning("request %s: not offering its KV to a decode instance: %s", request.request_id, exc)
            return False, None

    def has_pending_work(self) -> bool:
        """Leases held, loads outstanding or step work queued: vLLM keeps stepping the engine
        (its workers then drain notifications: P acts on push requests and frees blocks once
        D has read them). An idle P would otherwise sit on both until its next request."""
        return self.core.has_pending_work()

    def shutdown(self) -> None:
        self.core.shutdown()


@dataclass
class _Prefill:
    tokens: list[int]  # the tokens P ships (and seals)
    prompt_len: int  # tokens P computes (one fewer for a hybrid stopped short)
    block_ids: list[list[int]] | None = None


def _wants_remote_prefill(request: Any) -> bool:
    params = request.kv_transfer_params
    return isinstance(params, dict) and bool(params.get("do_remote_prefill"))
