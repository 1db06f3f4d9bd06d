"""A request inside the engine: its tokens, sampling settings, blocks and lifecycle state."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlink.connector.api import RequestView


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """`temperature == 0` is greedy; otherwise top-p sampling seeded by `seed` (None: random)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # no stop token (end of sequence unless ignored, `stop_token_ids`) is sampled before this many
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def stop_tokens(self, eos_token_ids: Iterable[int]) -> frozenset[int]:
        """The tokens that end an answer: `stop_token_ids`, and the model's end of sequence
        unless `ignore_eos`."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # Set on the first output after this request's KV was loaded from a remote engine.
    kv_bytes: int | None = None
    kv_transfer_s: float | None = None
    kv_verified_bytes: int | None = None  # of those bytes, what D hashed and checked (verify_kv)
    # With `error`: "bad_kv_transfer_params" (the request's params cannot work),
    # "forbidden_kv_transfer_params" (they no longer grant access to P's blocks), "kv_load_stalled"
    # (no progress before the stall deadline) or "kv_load_failed" (P unreachable or broke off).
    error_kind: str | None = None


@dataclass(eq=False)
class Request:
    """Compared by identity: the engine holds exactly one object per request id."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer_params: dict[str, Any] | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_tables: list[list[int]] = field(default_factory=list)
    # Set once the connector has been asked for remote KV, so a requeued request never asks twice.
    remote_kv_considered: bool = False
    num_local_prefix_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r} has an empty prompt")
        if self.params.temperature > 0:
            self.generator = torch.Generator()
            if self.params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(self.params.seed)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prefill_only(self) -> bool:
        """P side of disaggregation: compute KV for the prompt minus its last token, sample nothing."""
        return bool(self.kv_transfer_params and self.kv_transfer_params.get("do_remote_decode"))

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens whose KV must exist after this request's next forward."""
        return len(self.prompt_token_ids) - 1 if self.prefill_only else self.num_tokens

    def view(self) -> RequestView:
        return RequestView(self.request_id, self.prompt_token_ids, self.kv_transfer_params)
