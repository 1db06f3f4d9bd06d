"""The OpenAI-compatible HTTP app of one instance (P, D or both) over an `AsyncEngine`."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from kvlink.connector.params import (
    ForbiddenTransferParams,
    InvalidTransferParams,
    wants_remote_prefill,
)
from kvlink.serve import memory
from kvlink.serve.body_limit import limit_bodies
from kvlink.serve.disconnect import unless_disconnected
from kvlink.serve.engine_loop import AsyncEngine, EngineDead, EngineOverloaded, RequestTimeout
from kvlink.serve.errors import APIError, install_error_handlers
from kvlink.serve.generation import GenerationFailed, Piece, Summary, generate_pieces
from kvlink.serve.metrics import MetricsRegistry, render_stats_gauges
from kvlink.serve.prompts import chat_prompt_ids, completion_prompt_ids, token_budget
from kvlink.serve.protocol import ChatCompletionRequest, CompletionRequest
from kvlink.serve.request_ids import request_id_of
from kvlink.serve.responses import Kind, ResponseShape, sse

logger = logging.getLogger("kvlink.serve")
SamplingFactory = Callable[..., Any]
_STATS_TIMEOUT_S = 5.0
_STATS_GIVE_UP_S = 60.0  # a scrape shows no engine gauges once the engine took this long to answer
_SCRAPE_WAIT_S = 0.5  # how long /metrics waits for the engine's stats before serving the last ones


def engine_sampling_params() -> SamplingFactory:
    from kvlink.engine.request import SamplingParams

    return SamplingParams  # type: ignore[no-any-return]


# Seconds a client should wait before retrying an instance that is busy, or whose engine
# died (it answers again once restarted).
RETRY_AFTER_OVERLOADED_S = 1
RETRY_AFTER_DEAD_S = 5

# The engine's `error_kind` for a request it finished with an error -> (status, code).
# Only params that can never work are the client's fault; a P that is gone, broke off
# or stalled is the server side's, and retrying (through a prefill instance) can work.
_FAILURE_STATUS = {
    "bad_kv_transfer_params": (400, "invalid_kv_transfer_params"),
    "forbidden_kv_transfer_params": (403, "forbidden_kv_transfer_params"),
    "kv_load_failed": (502, "kv_load_failed"),
    "kv_load_stalled": (504, "kv_load_timeout"),
}


def _as_api_error(error: Exception) -> APIError:
    """Every failure a request can meet, as the status a client or router acts on."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ForbiddenTransferParams):  # unsigned, altered or stale: nothing was read
        return APIError(403, str(error), "forbidden_kv_transfer_params")
    if isinstance(error, InvalidTransferParams):  # named: a router tells these from the client's faults
        return APIError(400, str(error), "invalid_value", param="kv_transfer_params")
    if isinstance(error, ValueError):  # add_request refused the input
        return APIError(400, str(error), "invalid_value")
    if isinstance(error, EngineOverloaded):
        return APIError(503, str(error), "engine_overloaded", retry_after_s=RETRY_AFTER_OVERLOADED_S)
    if isinstance(error, RequestTimeout | TimeoutError):
        return APIError(504, str(error) or "timed out", "timeout")
    if isinstance(error, EngineDead):
        return APIError(503, str(error), "engine_dead", retry_after_s=RETRY_AFTER_DEAD_S)
    if isinstance(error, GenerationFailed):
        if error.kind in _FAILURE_STATUS:
            status, code = _FAILURE_STATUS[error.kind]
            return APIError(status, str(error), code)
        return APIError(500, f"generation failed: {error}", error.kind or "generation_failed")
    return APIError(500, f"internal error: {error!r}", "internal_error")


def check_model(requested: str | None, served: str) -> None:
    """404 `model_not_found` for a model this instance does not serve (none named: the served one)."""
    if requested is not None and requested != served:
        raise APIError(404, f"The model `{requested}` does not exist on this instance, which serves "
                            f"`{served}` (see GET /v1/models); send model={served!r} or leave it out.",
                       "model_not_found", param="model")


def build_app(
    engine: AsyncEngine, tokenizer: Any, model_name: str, role: str, metrics: MetricsRegistry,
    *, max_model_len: int, sampling_factory: SamplingFactory | None = None,
    warnings: Sequence[str] = (), kv_endpoint: dict[str, Any] | None = None,
) -> FastAPI:
    """`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`, `/metrics`,
    `/debug/state`, `/debug/memory` (and `POST /debug/memory/trim`).

    `warnings`: what is unsafe about how this instance runs (e.g. unsigned params); /health
    repeats them so a monitor sees them, not only the start-up log."""
    app = FastAPI(title=f"kvlink {role} instance", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    limit_bodies(app)
    metrics.gauges.setdefault("requests_in_flight", lambda: float(engine.in_flight))
    make_sampling = sampling_factory

    def sampling_for(body: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> Any:
        nonlocal make_sampling
        if make_sampling is None:
            make_sampling = engine_sampling_params()
        stop_ids = set(body.stop_token_ids or ())
        if not body.ignore_eos:
            stop_ids |= set(tokenizer.eos_token_ids)
        return make_sampling(
            max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
            seed=body.seed, stop_token_ids=tuple(sorted(stop_ids)), ignore_eos=body.ignore_eos,
            min_tokens=min(body.min_tokens, max_tokens),
        )

    async def release_prefilled(
        body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int], request_id: str,
    ) -> None:
        """Refused before the engine saw it: if P already prefilled it, let P free it now."""
        try:
            if not wants_remote_prefill(body.kv_transfer_params):
                return
            released = await engine.release_remote_prefill(
                prompt_ids, sampling_for(body, 1), dict(body.kv_transfer_params or {}))
        except Exception as error:  # the refusal still goes out; P's lease frees it later
            logger.warning("request %s: could not tell the prefill engine to free it: %s", request_id, error)
            return
        if released:
            logger.info("request %s refused; told the prefill engine to free its KV blocks", request_id)

    async def serve(
        raw: Request, body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
        requested_max_tokens: int | None,
    ) -> Response:
        request_id = "(refused id)"  # for the log line of a refusal before the id is taken
        try:
            request_id = request_id_of(raw)
            check_model(body.model, model_name)
            if role == "decode" and (body.kv_transfer_params or {}).get("do_remote_decode") is True:
                # A decode instance is not asked for its KV: nothing would hand its blocks back
                # (its /v1/kv_release is a prefill instance's).
                raise APIError(400, "kv_transfer_params.do_remote_decode asks for a prefill whose KV a "
                                    "decode instance reads; this is a decode instance: send it to a "
                                    "--role prefill instance", "invalid_value", param="kv_transfer_params")
            max_tokens = token_budget(len(prompt_ids), requested_max_tokens, max_model_len)
            if body.min_tokens > max_tokens:
                raise APIError(400, f"min_tokens={body.min_tokens} is more than the {max_tokens} tokens this "
                                    f"answer may have (max_tokens, or what fits the context)",
                               "invalid_value", param="min_tokens")
        except APIError:
            await release_prefilled(body, prompt_ids, request_id)
            raise
        kind: Kind = "chat" if isinstance(body, ChatCompletionRequest) else "completion"
        shape = ResponseShape(kind, request_id, model_name)
        summary = Summary(request_id, role, prompt_tokens=len(prompt_ids))
        pieces = generate_pieces(
            engine, tokenizer, metrics, summary, prompt_ids, sampling_for(body, max_tokens),
            body.stop_strings, body.kv_transfer_params, include_stop_str=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
        )
        try:
            # The first piece is awaited before answering, so refusals and failures that
            # happen before any token (bad params, failed KV load) get a real HTTP status.
            first = await unless_disconnected(raw, pieces.__anext__())
        except Exception as error:
            await pieces.aclose()
            raise _as_api_error(error) from error
        if body.stream:
            events = _stream(shape, first, pieces, summary, body.include_usage_in_stream)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            texts, last = await unless_disconnected(raw, _collect(first, pieces))
        except Exception as error:
            raise _as_api_error(error) from error
        finally:
            await pieces.aclose()
        return JSONResponse(shape.full(
            "".join(texts), last.finish_reason, summary.prompt_tokens, summary.output_tokens,
            last.kv_transfer_params, summary.figures(),
        ))

    @app.post("/v1/completions")
    async def completions(raw: Request, body: CompletionRequest) -> Response:
        return await serve(raw, body, completion_prompt_ids(body, tokenizer, max_model_len), body.max_tokens)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request, body: ChatCompletionRequest) -> Response:
        prompt_ids = chat_prompt_ids(body, tokenizer, max_model_len)
        return await serve(raw, body, prompt_ids, body.requested_max_tokens)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "owned_by": "kvlink",
                "max_model_len": max_model_len, "role": role}
        return {"object": "list", "data": [card]}

    @app.get("/v1/kv_endpoint")
    async def endpoint() -> Response:
        """P: the side channel a D asks for a layerwise push (kv_transfer_params fields)."""
        if kv_endpoint is None:
            return APIError(404, f"this {role} instance takes no layerwise push requests",
                            "not_a_prefill_instance").response()
        return JSONResponse(kv_endpoint)

    @app.post("/v1/kv_release")
    async def kv_release(raw: Request) -> Response:
        """P: a router hands back, unused, the `kv_transfer_params` of a request it never
        passed to a decoder (the decode leg could not reach one, or its client left first):
        the blocks are freed now instead of when the lease ends. Body: `{"kv_transfer_params":
        {...}}` as P answered them; answer: `{"released": bool}` (false: nothing was held for
        them any more). Params this engine did not issue and sign are refused (403)."""
        if role != "prefill":
            return APIError(404, f"this {role} instance holds no KV for decoders", "not_a_prefill_instance").response()
        try:
            body = json.loads(await raw.body())
        except (ValueError, RecursionError) as error:
            return APIError(400, f"request body is not valid JSON: {error}", "invalid_json").response()
        params = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if not isinstance(params, dict):
            return APIError(400, 'the body must be {"kv_transfer_params": {...}}, the params this instance '
                                 "answered with", "invalid_value", param="kv_transfer_params").response()
        try:
            released = await engine.release_by_params(params)
        except Exception as error:
            return _as_api_error(error).response()
        metrics.inc("kv_params_handed_back_total", outcome="released" if released else "nothing_held")
        return JSONResponse({"released": released})

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            return APIError(503, engine.dead_reason or "engine not running", "engine_dead",
                            retry_after_s=RETRY_AFTER_DEAD_S).response()
        answer: dict[str, Any] = {"status": "ok", "role": role, "model": model_name}
        if warnings:
            answer["warnings"] = list(warnings)
        return JSONResponse(answer)

    # The engine answers stats between steps; a long prefill step would hold a scrape (and
    # drop the engine's gauges). A scrape waits briefly for fresh stats, else serves the last
    # ones with their age, while the asked-for stats land for the next scrape.
    engine_stats: dict[str, Any] = {"last": None, "at": 0.0, "asking": None}

    async def fresh_stats() -> None:
        try:
            stats = await asyncio.wait_for(engine.stats(), _STATS_GIVE_UP_S)
        except Exception:  # the engine is gone or stuck: the scrape shows no engine gauges
            engine_stats["last"] = None
            return
        engine_stats["last"], engine_stats["at"] = stats, time.monotonic()

    async def stop_asking() -> None:
        asking = engine_stats["asking"]
        if asking is not None and not asking.done() and asking.get_loop() is asyncio.get_running_loop():
            asking.cancel()

    app.router.add_event_handler("shutdown", stop_asking)

    @app.get("/metrics")
    async def prometheus() -> Response:
        text = metrics.render()
        asking = engine_stats["asking"]
        if asking is None or asking.done() or asking.get_loop() is not asyncio.get_running_loop():
            asking = engine_stats["asking"] = asyncio.ensure_future(fresh_stats())
        # metrics must render even while the engine is busy or gone
        await asyncio.wait({asking}, timeout=_SCRAPE_WAIT_S)
        if engine_stats["last"] is not None and engine.alive:
            prefix = f"{metrics.prefix}_engine"
            text += render_stats_gauges(prefix, engine_stats["last"])
            age = time.monotonic() - engine_stats["at"]
            text += f"# TYPE {prefix}_stats_age_seconds gauge\n{prefix}_stats_age_seconds {age:.3f}\n"
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/debug/state")
    async def debug_state() -> dict[str, Any]:
        try:
            stats = await asyncio.wait_for(engine.stats(), _STATS_TIMEOUT_S)
        except Exception as error:
            raise _as_api_error(error) from error
        return {"role": role, "in_flight": engine.in_flight, "engine": stats}

    @app.get("/debug/memory")
    async def debug_memory() -> dict[str, Any]:
        return memory.snapshot()

    @app.post("/debug/memory/trim")
    async def debug_memory_trim() -> dict[str, Any]:
        before = memory.rss_kib()
        released = memory.trim()
        return {"released": released, "rss_kib_before": before, **memory.snapshot()}

    return app


async def _collect(first: Piece, pieces: AsyncIterator[Piece]) -> tuple[list[str], Piece]:
    texts, last = [first.text], first
    while last.finish_reason is None:
        last = await pieces.__anext__()
        texts.append(last.text)
    return texts, last




async def _stream(
    shape: ResponseShape, first: Piece, pieces: AsyncGenerator[Piece, None], summary: Summary,
    include_usage: bool,
) -> AsyncIterator[str]:
    """SSE events; an error after the first token is sent as an error event, then [DONE]."""
    piece = first
    try:
        yield sse(shape.chunk(piece.text, piece.finish_reason, first=True,
                              kv_transfer_params=piece.kv_transfer_params,
                              figures=summary.figures() if piece.finish_reason is not None else None))
        async for piece in pieces:
            figures = summary.figures() if piece.finish_reason is not None else None
            yield sse(shape.chunk(piece.text, piece.finish_reason,
                                  kv_transfer_params=piece.kv_transfer_params, figures=figures))
        if include_usage:
            usage_chunk = shape.usage_chunk(summary.prompt_tokens, summary.output_tokens)
            if summary.figures() is not None:
                usage_chunk["kvlink"] = summary.figures()
            yield sse(usage_chunk)
    except Exception as error:
        yield sse(_as_api_error(error).body())  # headers are gone: the status is in the event
    finally:
        await pieces.aclose()
    yield sse("[DONE]")
