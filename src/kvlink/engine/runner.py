"""Runs one step's scheduled token runs through the model, one sequence at a time, and samples."""

from __future__ import annotations

import torch

from kvlink.engine.model.base import LayerSink, LayerStream, PagedModel
from kvlink.engine.request import SamplingParams
from kvlink.engine.sampler import sample
from kvlink.engine.scheduler import ScheduledRun


class ModelRunner:
    """Owns nothing but references: the model, the worker's caches and the logical block size."""

    def __init__(self, model: PagedModel, caches: list[torch.Tensor], block_size: int) -> None:
        self.model, self.caches, self.block_size = model, caches, block_size
        self.layer_sink: LayerSink | None = None  # the connector's, when it streams layers

    def run(self, runs: list[ScheduledRun]) -> dict[str, int]:
        """Next token per request id; prefill-only requests (P side) and empty runs sample nothing."""
        sampled: dict[str, int] = {}
        for run in runs:
            request = run.request
            if run.num_tokens == 0:
                continue
            end = run.start_pos + run.num_tokens
            input_ids = torch.tensor(request.all_token_ids[run.start_pos : end], dtype=torch.int64)
            tables = [torch.tensor(t, dtype=torch.int64) for t in request.block_tables]
            # Only the last row is sampled: the full [T, vocab] logits of a long prompt would be a
            # large temporary per prefill, which fragmented P's malloc heap (RSS grew in steps).
            # P reports each finished layer of a prefill (a layerwise stream sends it on).
            stream = None
            if request.prefill_only and self.layer_sink is not None:
                stream = LayerStream(request.request_id, end, self.layer_sink)
            logits = self.model.forward(
                input_ids, run.start_pos, tables, self.caches, block_size=self.block_size,
                last_token_only=True, stream=stream,
            )
            if not request.prefill_only and end >= request.num_tokens_to_compute:  # not a prompt chunk
                last = logits[-1]
                if len(request.output_token_ids) < request.params.min_tokens:
                    last = self._without_stop_tokens(last, request.params)
                sampled[request.request_id] = sample(last, request.params, request.generator)
        return sampled

    def _without_stop_tokens(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """`logits` with every token that would end the answer made impossible (`min_tokens`)."""
        ids = [t for t in params.stop_tokens(self.model.eos_token_ids) if 0 <= t < logits.shape[-1]]
        if not ids:
            return logits
        masked = logits.clone()
        masked[torch.tensor(ids, dtype=torch.int64)] = float("-inf")
        return masked
