"""Scheduler side of the NIXL connector: decides what moves, never touches memory.

P: a finished `do_remote_decode` request keeps its blocks (delay_free) and answers with
the params D needs. D: a `do_remote_prefill` request asks for N-1 prompt tokens from
P, gets blocks, and is parked until the workers report the load finished or failed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvlink.connector.api import ConnectorScheduler, RequestView, StepMetadata, WorkerOutput
from kvlink.connector.config import ConnectorConfig
from kvlink.connector.notifs import MAX_REQUEST_ID_BYTES
from kvlink.connector.params import (
    ForbiddenTransferParams,
    RemotePrefillParams,
    StaleTransferParams,
    check_integrity,
    is_layerwise,
    parse_remote_prefill,
    prompt_hash,
    requested_mode,
    sign,
    wants_remote_decode,
    wants_remote_prefill,
)
from kvlink.connector.replay import UsedParams
from kvlink.connector.secret import require_secret
from kvlink.layout.limits import TP, check
from kvlink.layout.spec import ModelSpec, is_ssm

log = logging.getLogger("kvlink.connector")


@dataclass
class _RemoteRequest:
    params: RemotePrefillParams
    loaded: bool = False


class NixlScheduler(ConnectorScheduler):
    """One per engine. `tp_size` is this engine's TP size (advertised to the peer); `model`
    tells whether requests carry SSM state (None: a model without it).

    Needs the deployment's shared secret (or `config.insecure_unsigned_params`): P signs
    the params it hands out, D refuses params P did not sign. `wall_clock` (Unix seconds)
    dates the params' expiry; P's and D's clocks must agree to well within a lease.
    """

    def __init__(
        self, config: ConnectorConfig, tp_size: int, clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time, *, model: ModelSpec | None = None,
    ) -> None:
        self.config = config
        self.tp_size = check("tp_size", tp_size, TP)
        # D's prefix hits never hold P's SSM state after N-1 tokens: it always moves.
        self.state_always_moves = model is not None and any(is_ssm(g) for g in model.groups)
        self.load_failure_policy = config.load_failure_policy
        self._clock = clock
        self._notify_until = float("-inf")  # has_pending_work while workers deliver notify-only entries
        self._wall_clock = wall_clock
        self._remote: dict[str, _RemoteRequest] = {}
        # P: requests whose blocks wait for a decoder, with what their params say (`_issued`):
        # params handed back must be these
        self._held: dict[str, tuple[Any, ...]] = {}
        self._streams: set[str] = set()  # P: layerwise requests still prefilling
        self._step = StepMetadata()
        self._last_heartbeat = float("-inf")
        self._secret = require_secret(config.secret, config.insecure_unsigned_params, config.engine_id)
        self._used = UsedParams()  # D: params a request took, refused to any other (replays)

    # ---- D side -------------------------------------------------------------------------
    def on_new_request(self, request: RequestView) -> None:
        # Both flags are checked now: request_finished() runs inside the engine step, where a
        # bad `do_remote_decode` would raise and stop the engine thread.
        if wants_remote_decode(request.kv_transfer_params) and self._mode(request) == "layerwise":
            self._streams.add(request.request_id)
            key = (request.kv_transfer_params or {}).get("layerwise_id")
            self._step.streams.append({
                "request_id": request.request_id, "prompt_hash": prompt_hash(request.prompt_token_ids),
                "num_tokens": max(0, len(request.prompt_token_ids) - 1),
                # the proxy's name for it, which D uses (an engine may rename its requests)
                "key": key if isinstance(key, str) and key else request.request_id})
        if wants_remote_prefill(request.kv_transfer_params):
            assert request.kv_transfer_params is not None
            params = parse_remote_prefill(request.kv_transfer_params)
            if is_layerwise(params):  # P has not seen the request yet: nothing it signed to check
                self._remote[request.request_id] = _RemoteRequest(params)
                return
            try:
                now = self._wall_clock()
                check_integrity(params, request.prompt_token_ids, self._secret, now)
                if self._secret is not None:  # unsigned params can be forged at will anyway
                    self._used.claim(params, request.request_id, now)
            except StaleTransferParams as stale:
                if self.load_failure_policy != "recompute":
                    raise
                # P's blocks may belong to another request by now: read nothing, prefill here.
                log.warning("request %s: %s; prefilling it here (load_failure_policy recompute)",
                            request.request_id, stale)
                return
            self._remote[request.request_id] = _RemoteRequest(params)

    def release_unadmitted(self, request: RequestView) -> None:
        """D: `request` will never run (the engine refused it before admission) but carries
        P's params: if P signed them, tell P to free those blocks now, not at lease expiry.
        Its prompt is not checked (the engine may not have kept it)."""
        if not wants_remote_prefill(request.kv_transfer_params):
            return
        assert request.kv_transfer_params is not None
        params = parse_remote_prefill(request.kv_transfer_params)
        if is_layerwise(params):  # P holds nothing for us yet: its stream ends with its request
            return
        check_integrity(params, None, self._secret, self._wall_clock())
        self._step.notify_only.append(self._entry(request.request_id, params))

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int, bool]:
        remote = self._remote.get(request.request_id)
        if remote is None or remote.loaded:
            return 0, False
        shipped = len(request.prompt_token_ids) - 1
        missing = shipped - num_computed_tokens
        # Layerwise: P frees on our push request's answer, so even a full hit asks for it.
        if missing <= 0 and not (self.state_always_moves and shipped > 0) and not is_layerwise(remote.params):
            # D already holds every token P could send: only tell P to free.
            self._step.notify_only.append(self._entry(request.request_id, remote.params))
            del self._remote[request.request_id]
            return 0, False
        return max(0, missing), True

    def update_state_after_alloc(
        self, request: RequestView, block_ids: Sequence[Sequence[int]], num_external_tokens: int,
        num_computed_tokens: int,
    ) -> None:
        remote = self._remote.get(request.request_id)
        if remote is None or remote.loaded:
            return
        remote.loaded = True
        entry = self._entry(request.request_id, remote.params)
        entry.update(
            local_block_ids=[list(ids) for ids in block_ids],
            local_computed_tokens=num_computed_tokens,
            num_tokens=len(request.prompt_token_ids) - 1,
        )
        if self.config.verify_kv != "off":  # the tokens seed the digests D checks
            entry["token_ids"] = list(request.prompt_token_ids[:-1])
        if is_layerwise(remote.params):  # P writes only for the prompt it prefills
            entry["prompt_hash"] = prompt_hash(request.prompt_token_ids)
        self._step.loads.append(entry)

    def _entry(self, request_id: str, p: RemotePrefillParams) -> dict[str, Any]:
        return {
            "request_id": request_id,
            "remote_request_id": p.remote_request_id,
            "remote_engine_id": p.remote_engine_id,
            "remote_host": p.remote_host,
            "remote_port": p.remote_port,
            "remote_tp_size": p.tp_size,
            "remote_block_ids": [list(ids) for ids in p.remote_block_ids],
            "transfer_mode": p.transfer_mode,
            "remote_incarnation": p.remote_incarnation,
        }

    # ---- both sides ---------------------------------------------------------------------
    def build_step_metadata(self) -> StepMetadata:
        now = self._clock()
        if now - self._last_heartbeat >= self.config.heartbeat_interval_s:
            self._last_heartbeat = now
            self._step.heartbeats = self._heartbeats()
        if self._step.notify_only:
            # The workers may first have to handshake with that P (or give up on a dead one):
            # keep the engine stepping for as long as that can take.
            self._notify_until = now + self.config.handshake_timeout_s + 2.0
        step, self._step = self._step, StepMetadata()
        return step

    def _heartbeats(self) -> list[dict[str, Any]]:
        by_engine: dict[tuple[str, str, int, int], list[str]] = {}
        for remote in self._remote.values():
            p = remote.params
            key = (p.remote_engine_id, p.remote_host, p.remote_port, p.tp_size)
            by_engine.setdefault(key, []).append(p.remote_request_id)
        return [
            {"remote_engine_id": e, "remote_host": h, "remote_port": port, "remote_tp_size": tp,
             "remote_request_ids": ids}
            for (e, h, port, tp), ids in by_engine.items()
        ]

    def release_held(self, request_id: str) -> bool:
        if request_id not in self._held:
            return False
        self._step.frees.append(request_id)  # the worker drops the lease and reports it sent
        return True

    def held_by_params(self, kv_transfer_params: dict[str, Any]) -> str | None:
        params = parse_remote_prefill(kv_transfer_params)
        if params.remote_engine_id != self.config.engine_id:
            raise ForbiddenTransferParams(
                f"kv_transfer_params name prefill engine {params.remote_engine_id!r}; this is "
                f"{self.config.engine_id!r}: hand params back to the instance that issued them")
        try:
            check_integrity(params, None, self._secret, self._wall_clock())
        except StaleTransferParams:
            return None  # the lease is over: the blocks went back with it
        if self.config.incarnation and params.remote_incarnation != self.config.incarnation:
            return None  # issued by an earlier start of this engine: its blocks are gone
        if self._held.get(params.remote_request_id) != _issued(params.kv_signature, params.kv_expires_at_ms,
                                                               params.prompt_hash, params.remote_block_ids):
            return None  # another request's params under the same id (a client reusing ids)
        return params.remote_request_id

    def update_connector_output(self, output: WorkerOutput) -> None:
        for rid in output.finished_recving | output.failed_recving:
            self._remote.pop(rid, None)
        for rid in output.finished_sending:
            self._held.pop(rid, None)

    def request_finished(
        self, request: RequestView, block_ids: Sequence[Sequence[int]], aborted: bool,
    ) -> tuple[bool, dict[str, Any] | None]:
        if request.request_id in self._streams:
            self._streams.discard(request.request_id)
            if aborted or not any(block_ids):  # no lease will end it: the worker drops the stream now
                self._step.frees.append(request.request_id)
        remote = self._remote.pop(request.request_id, None)
        if remote is not None and not remote.loaded and not is_layerwise(remote.params):
            # Aborted before D allocated: P must not wait for the lease to run out.
            self._step.notify_only.append(self._entry(request.request_id, remote.params))
        elif remote is not None and remote.loaded and remote.params.transfer_mode in ("push", "layerwise"):
            # Aborted while P is to write into our blocks (the load has not ended, or it
            # would be gone): P must stop before the blocks can go back.
            self._step.cancels.append(request.request_id)
        if not wants_remote_decode(request.kv_transfer_params):
            return False, None
        if aborted or not any(block_ids):
            return False, None
        if len(request.request_id.encode()) > MAX_REQUEST_ID_BYTES:
            log.warning("request %.64s...: its id is over %d bytes, too long for the notifications D sends "
                        "about it; no KV kept for a decoder", request.request_id, MAX_REQUEST_ID_BYTES)
            return False, None
        save: dict[str, Any] = {"request_id": request.request_id, "block_ids": [list(ids) for ids in block_ids]}
        if self.config.verify_kv != "off":  # P seals the tokens it ships
            save["num_tokens"] = max(0, len(request.prompt_token_ids) - 1)
            save["token_ids"] = list(request.prompt_token_ids[:-1])
        self._step.saves.append(save)
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.config.engine_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": [list(ids) for ids in block_ids],
            "remote_host": self.config.side_channel_host,
            "remote_port": self.config.side_channel_port,
            "tp_size": self.tp_size,
            "remote_num_tokens": max(0, len(request.prompt_token_ids) - 1),
            # A router may pick the mode per request; the engine's setting is the default. A
            # layerwise request that reaches D the classic way (P's params) is a push.
            "transfer_mode": "push" if self._mode(request) == "layerwise" else self._mode(request),
            "prompt_hash": prompt_hash(request.prompt_token_ids),
            # P's lease starts with the worker's next step, so it ends a little after this.
            "kv_expires_at_ms": int((self._wall_clock() + self.config.lease_s) * 1000),
        }
        if self.config.incarnation:
            params["remote_incarnation"] = self.config.incarnation
        if self._secret is not None:
            params["kv_signature"] = sign(params, self._secret)
        self._held[request.request_id] = _issued(params.get("kv_signature"), params["kv_expires_at_ms"],
                                                 params["prompt_hash"], params["remote_block_ids"])
        return True, params

    def streams(self) -> set[str]:
        """P: the layerwise requests still prefilling."""
        return self._streams

    def _mode(self, request: RequestView) -> str:
        return requested_mode(request.kv_transfer_params) or self.config.transfer_mode

    def has_pending_work(self) -> bool:
        s = self._step
        return bool(self._remote or self._held or s.loads or s.saves or s.notify_only or s.frees
                    or self._clock() < self._notify_until)

    def shutdown(self) -> None:
        self._remote.clear()


def _issued(signature: str | None, expires_at_ms: int | None, prompt: str | None,
            block_ids: Sequence[Sequence[int]]) -> tuple[Any, ...]:
    """What tells one request's params from another's under the same request id."""
    return signature, expires_at_ms, prompt, tuple(tuple(ids) for ids in block_ids)
