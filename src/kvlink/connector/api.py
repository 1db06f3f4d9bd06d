"""The engine-facing connector API: a scheduler side and a worker side, engine-agnostic.

An engine (ours, or any other that owns paged KV memory) drives a connector with
these calls and nothing else. The scheduler side decides *what* moves; the worker
side (one per TP rank) moves bytes. In a single-process engine both live together.

Call order per engine step (see docs/connector-api.md):

    scheduler: on_new_request -> get_num_new_matched_tokens -> (engine allocates)
               -> update_state_after_alloc -> build_step_metadata
    worker:    start_load_kv(metadata) ... get_finished() each step
    scheduler: update_connector_output(output); request_finished(...) at the end
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

LoadFailurePolicy = Literal["recompute", "fail"]
TransferMode = Literal["pull", "push", "layerwise"]


@dataclass(frozen=True)
class RequestView:
    """What the connector needs to know about a request, engine-independent.

    `block_ids` and other per-group lists are indexed by KV-cache group.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class StepMetadata:
    """Per-step instructions from the scheduler side to every worker (plain data, picklable-free)."""

    loads: list[dict[str, Any]] = field(default_factory=list)
    saves: list[dict[str, Any]] = field(default_factory=list)
    notify_only: list[dict[str, Any]] = field(default_factory=list)
    frees: list[str] = field(default_factory=list)
    heartbeats: list[dict[str, Any]] = field(default_factory=list)
    # P (vLLM): requests whose prefill this step's forward completes, shaped like `saves`;
    # the worker seals them right after the forward (`NixlWorker.seal_now`), so their
    # digests are in place before P's answer leaves the engine.
    seals: list[dict[str, Any]] = field(default_factory=list)
    # P (layerwise): requests whose layers go to D as the forward produces them, once D asks:
    # {"request_id", "prompt_hash", "num_tokens"} (tokens P computes, prompt length - 1).
    streams: list[dict[str, Any]] = field(default_factory=list)
    # P inside vLLM (layerwise): the stream requests this step's forward computes, with their
    # block ids so far and the tokens computed once it ends ({"request_id", "block_ids", "end"}).
    layer_progress: list[dict[str, Any]] = field(default_factory=list)
    # D: requests aborted while their push or layerwise load waited for P's WRITEs. The
    # workers ask P to stop and give the blocks back once P answers (else at the deadline).
    cancels: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class LoadFailure:
    """Why one load failed.

    `bad_params`: the request's `kv_transfer_params` name a peer or blocks that cannot be
    used (side channel unreachable or serving another engine, incompatible layout, block
    ids outside the peer's pool). Sending the same request again fails again.
    `forbidden`: the params no longer grant access to P's blocks (P restarted since it made
    them): nothing was read, and reading would have returned another request's KV.
    `stalled`: the transfer made no progress before the stall deadline (P frozen or cut off).
    Anything else (P unreachable, dead or broken mid-transfer) is worth retrying elsewhere.
    """

    reason: str
    bad_params: bool = False
    forbidden: bool = False
    stalled: bool = False


@dataclass
class WorkerOutput:
    """What one worker reports after a step; the engine merges them across TP ranks."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    # Per finished load: {"kv_bytes", "kv_transfer_s", "kv_descriptors"} (for logs and responses).
    transfer_figures: dict[str, dict[str, float]] = field(default_factory=dict)
    # Per request in `failed_recving`, when the worker knows why (for the client's error).
    load_failures: dict[str, LoadFailure] = field(default_factory=dict)
    # Failed loads whose blocks may still be written by a late transfer (a stalled, not dead,
    # peer): the engine keeps those blocks out of use for this many seconds.
    quarantine_s: dict[str, float] = field(default_factory=dict)


class ConnectorScheduler(abc.ABC):
    """Scheduler side. Owns leases and per-request transfer state; never touches memory."""

    load_failure_policy: LoadFailurePolicy = "fail"

    @abc.abstractmethod
    def on_new_request(self, request: RequestView) -> None:
        """A request entered the engine (starts lease heartbeats on D)."""

    @abc.abstractmethod
    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens beyond `num_computed_tokens` that can be loaded from a remote engine.

        Returns `(count, is_async)`: when async, the engine allocates blocks for them
        and parks the request until the worker reports it in `finished_recving`.
        """

    @abc.abstractmethod
    def update_state_after_alloc(
        self, request: RequestView, block_ids: Sequence[Sequence[int]], num_external_tokens: int,
        num_computed_tokens: int,
    ) -> None:
        """The engine allocated `block_ids` (per group, whole request) for the request."""

    @abc.abstractmethod
    def build_step_metadata(self) -> StepMetadata:
        """Collect this step's work for the workers and clear per-step state."""

    @abc.abstractmethod
    def update_connector_output(self, output: WorkerOutput) -> None:
        """Merged worker output of the step."""

    @abc.abstractmethod
    def request_finished(
        self, request: RequestView, block_ids: Sequence[Sequence[int]], aborted: bool,
    ) -> tuple[bool, dict[str, Any] | None]:
        """Returns `(delay_free, kv_transfer_params)`.

        With `delay_free` the engine keeps the blocks until the request appears in
        `finished_sending`; `kv_transfer_params` go back to the client (P -> proxy -> D).
        """

    def has_pending_work(self) -> bool:
        """True while leases, loads or pushes are outstanding (the engine keeps stepping)."""
        return False

    def release_held(self, request_id: str) -> bool:
        """P: a finished request whose blocks wait for a decoder was aborted after all (its
        caller left before the params went out): free them now, not at the lease's end
        (they come back in `finished_sending`). False when nothing is held for it."""
        return False

    def held_by_params(self, kv_transfer_params: dict[str, Any]) -> str | None:
        """P: a router hands back unused the `kv_transfer_params` of a request (its decoder
        never got them, or is done with them). Returns the id of the held request they
        belong to, once they prove to be this engine's, signed, in their lease and the very
        params of the request held under that id now; the engine then lets it go
        (`release_held`). None for params of an earlier start, past their lease, or of an
        earlier request under the same id (nothing is held for them). Raises
        `InvalidTransferParams` for malformed params, `ForbiddenTransferParams` for params
        this engine did not issue."""
        return None

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop background threads and listeners."""


class ConnectorWorker(abc.ABC):
    """Worker side: one per TP rank. Registers memory and moves bytes."""

    @abc.abstractmethod
    def register_kv_caches(self, base_addrs: Sequence[int], nbytes: Sequence[int]) -> None:
        """Register every cache tensor of this rank, in layer order (see layout.kv_tensor_specs)."""

    @abc.abstractmethod
    def start_load_kv(self, metadata: StepMetadata) -> None:
        """Post this step's loads, saves and notifications; never blocks on a transfer."""

    @abc.abstractmethod
    def get_finished(self) -> WorkerOutput:
        """Poll transfers, notifications and leases; report what finished or failed."""

    def layer_sink(self) -> Callable[..., None] | None:
        """What the engine's forward calls after each layer of a P prefill, as
        `sink(request_id, layer, tokens_computed_after_this_forward, block_tables)` (layerwise
        mode writes that layer's new pages to D right then); None: nothing to stream."""
        return None

    def get_stats(self) -> dict[str, Any]:
        """Accumulated transfer stats since the last call."""
        return {}

    def debug_state(self) -> dict[str, Any]:
        """Counts of leases, loads and open transfers (tests assert nothing leaks)."""
        return {}

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release transfers, remote agents and registered memory."""
