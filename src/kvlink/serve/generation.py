"""One request's generation: engine outputs become text pieces, timings and a log line.

Shared by the completion and chat routes, streaming or not. Stop strings are cut
here; cutting one ends the iteration, which aborts the request in the engine.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from kvlink.serve.engine_loop import AsyncEngine
from kvlink.serve.metrics import MetricsRegistry
from kvlink.serve.stop_strings import StopStringFilter

logger = logging.getLogger("kvlink.serve")


class GenerationFailed(Exception):
    """The engine finished the request with an error (e.g. a failed KV load under policy fail).

    `kind` is the engine's `error_kind`: "bad_kv_transfer_params" means the request's
    params can never work (the client's fault), anything else is the server's.
    """

    def __init__(self, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class Piece:
    text: str
    finish_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class Summary:
    request_id: str
    role: str
    prompt_tokens: int
    output_tokens: int = 0
    finish_reason: str | None = None
    ttft_s: float | None = None
    total_s: float = 0.0
    kv_bytes: int | None = None
    kv_transfer_s: float | None = None
    kv_verified_bytes: int | None = None  # of kv_bytes, what D checked against P's digests

    def figures(self) -> dict[str, Any] | None:
        """The non-standard `kvlink` object of the final answer: where the time to first token
        went on this instance. Only when KV was loaded from a remote engine."""
        if self.kv_bytes is None:
            return None
        figures: dict[str, Any] = {"kv_bytes": self.kv_bytes, "kv_transfer_s": self.kv_transfer_s,
                                   "ttft_s": self.ttft_s, "role": self.role}
        if self.kv_verified_bytes is not None:
            figures["kv_verified_bytes"] = self.kv_verified_bytes
        return figures

    def log_line(self) -> str:
        ttft = "-" if self.ttft_s is None else f"{self.ttft_s * 1e3:.1f}ms"
        line = (
            f"request {self.request_id} role={self.role} prompt_tokens={self.prompt_tokens} "
            f"output_tokens={self.output_tokens} finish={self.finish_reason} ttft={ttft} "
            f"total={self.total_s * 1e3:.1f}ms"
        )
        if self.kv_bytes is not None:
            line += f" kv_bytes={self.kv_bytes}"
        if self.kv_transfer_s is not None:
            line += f" kv_transfer={self.kv_transfer_s * 1e3:.1f}ms"
        if self.kv_verified_bytes is not None:
            line += f" kv_verified_bytes={self.kv_verified_bytes}"
        return line


def _transfer_figures(output: Any, summary: Summary) -> None:
    # Engines report transfer figures under slightly different names; take what is there.
    for name in ("kv_bytes", "kv_transfer_bytes", "transfer_bytes"):
        value = getattr(output, name, None)
        if value is not None:
            summary.kv_bytes = int(value)
            break
    for name in ("kv_transfer_s", "kv_transfer_time_s", "transfer_s"):
        value = getattr(output, name, None)
        if value is not None:
            summary.kv_transfer_s = float(value)
            break
    verified = getattr(output, "kv_verified_bytes", None)
    if verified is not None:
        summary.kv_verified_bytes = int(verified)


async def generate_pieces(
    engine: AsyncEngine, tokenizer: Any, metrics: MetricsRegistry, summary: Summary,
    prompt_ids: list[int], sampling: Any, stop_strings: list[str],
    kv_transfer_params: dict[str, Any] | None, *, include_stop_str: bool = False,
    skip_special_tokens: bool = True,
) -> AsyncGenerator[Piece, None]:
    """Yield text pieces; the last one carries `finish_reason` and the engine's transfer params."""
    started = time.monotonic()
    last_token_at: float | None = None
    decoder = tokenizer.incremental_decoder(skip_special_tokens=skip_special_tokens)
    stops = StopStringFilter(stop_strings, include_in_output=include_stop_str)
    min_tokens, shown_tokens = sampling.min_tokens, 0
    outcome = "abort"  # what the client sees if the iteration is closed early
    outputs = engine.generate(summary.request_id, prompt_ids, sampling, kv_transfer_params)
    try:
        async with contextlib.aclosing(outputs):
            async for output in outputs:
                now = time.monotonic()
                new_ids = list(output.new_token_ids or [])
                if new_ids:
                    if last_token_at is None:
                        summary.ttft_s = now - started
                        metrics.observe("time_to_first_token_seconds", summary.ttft_s)
                    else:
                        for _ in new_ids:
                            metrics.observe("inter_token_latency_seconds", (now - last_token_at) / len(new_ids))
                    last_token_at = now
                    summary.output_tokens += len(new_ids)
                _transfer_figures(output, summary)
                if output.error:
                    raise GenerationFailed(str(output.error), getattr(output, "error_kind", None))
                # A stop token (end of sequence or one of `stop_token_ids`) ends the answer and is
                # counted; its text is part of it only with `include_stop_str_in_output`.
                stop_token = output.finished and output.finish_reason == "stop" and not include_stop_str
                shown = new_ids[:-1] if stop_token else new_ids
                text = ""
                for token in shown:  # a stop string cannot end in the first `min_tokens` tokens' text
                    shown_tokens += 1
                    text += stops.push(decoder.push(token), protected=shown_tokens <= min_tokens)
                if stops.stopped:
                    summary.finish_reason = "stop"
                    outcome = "ok"
                    yield Piece(text, "stop", output.kv_transfer_params)
                    return
                if output.finished:
                    summary.finish_reason = output.finish_reason or "stop"
                    outcome = "ok"
                    yield Piece(text + stops.push(decoder.flush()) + stops.flush(),
                                summary.finish_reason, output.kv_transfer_params)
                    return
                if text:
                    yield Piece(text)
    except Exception:
        outcome = "error"
        raise
    finally:
        summary.total_s = time.monotonic() - started
        metrics.observe("request_duration_seconds", summary.total_s)
        metrics.inc("prompt_tokens_total", summary.prompt_tokens)
        metrics.inc("generation_tokens_total", summary.output_tokens)
        if summary.kv_bytes is not None:
            metrics.inc("kv_bytes_total", summary.kv_bytes)
        if outcome != "ok":
            summary.finish_reason = outcome
        if outcome == "error":
            metrics.inc("requests_failed_total")
        metrics.inc("requests_total", outcome=outcome)
        logger.info(summary.log_line())
